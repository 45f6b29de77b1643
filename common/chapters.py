"""The five chapters, in order: the one list that the scripts, tests, tools and notebooks use."""

# chapter number -> its folder, which holds its train.py, README.md and notebook
CHAPTERS = {
    1: "01_single_gpu",
    2: "02_grad_accumulation",
    3: "03_dataparallel",
    4: "04_ddp",
    5: "05_multinode",
}
