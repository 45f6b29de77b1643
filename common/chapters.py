"""The chapters, in order: the one list that the scripts, tests, tools and notebooks use.

To insert a chapter, add its folder here (and renumber the folders after it): every other file
asks this list for a chapter's folder, number and base. tests/test_chapters.py fails while any
file still names a folder or a chapter number that the list does not hold."""

FOLDERS = [
    "01_single_gpu",
    "02_grad_accumulation",
    "03_dataparallel",
    "04_ddp",
    "05_multinode",
    "06_fault_tolerance",
    "07_fsdp",
    "08_slow_link",
]
CHAPTERS = dict(enumerate(FOLDERS, start=1))  # chapter number -> its folder (train.py, README.md)

# The chapter whose train.py a chapter's page and exercise start from, where it is not the one
# before it: chapter 04's DDP replaces chapter 03's DataParallel, so its diff against 02 is DDP
# alone; 06, 07 and 08 each change chapter 05 (07 replaces its DDP with FSDP, 08 with DiLoCo's
# rare syncs), as restarts and stops (06) are not the idea of 07 or 08.
BASES = {4: 2, 7: 5, 8: 5}

# The chapters whose run is not chapter 01's, step for step (their own tests say what they match
# instead): the checker compares them with their own train.py, and the committed parity figure
# (docs/figures/CAPTIONS.md) leaves them out.
NOT_CHAPTER_01S_RUN = {8}  # DiLoCo's copies train apart between syncs


def base(chapter: int) -> int:
    """The chapter that `chapter` is shown as a change of: its page's diff, its exercise's start."""
    return BASES.get(chapter, chapter - 1)
