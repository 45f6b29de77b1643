"""The six chapters, in order: the one list that the scripts, tests, tools and notebooks use."""

FOLDERS = "01_single_gpu 02_grad_accumulation 03_dataparallel 04_ddp 05_multinode 06_fsdp".split()
CHAPTERS = dict(enumerate(FOLDERS, start=1))  # chapter number -> its folder (train.py, README.md)
