"""common/chapters.py is the one list of chapters: no file names a chapter folder, a chapter
number or a path into a chapter that the list does not hold (a renumbering leaves none behind)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from common.chapters import CHAPTERS, FOLDERS, base
from layout import REPO

# A name shaped like a chapter folder: two digits, an underscore, a word (04_ddp, 01_tiny, 20_steps)
FOLDER_SHAPED = re.compile(r"(?<![\w])(\d\d)_([a-z][a-z0-9]*(?:_[a-z0-9]+)*)")
# Where a path starts at the repository's root: the line's start, a space or punctuation, `../`,
# `./`, a diff header's `a/` and `b/`, and docs/diffs/ (the published diffs are named after the
# chapters); not after another folder (out/01_tiny, out/05_multinode/20_steps)
ROOT_PATH_BEFORE = re.compile(r"(?:^|[\s`\"'(\[<=:,|*])(?:\.\.?/|[ab]/|docs/diffs/)*$")
# "chapter 9", "chapters 01-09", "chapters 02 to 06" (but "shorten chapter 03 to 10 minutes")
CHAPTER_WORD = re.compile(
    r"\b[Cc]hapter (\d{1,2})\b|\b[Cc]hapters (\d{1,2})(?:\s*(?:[–-]|to|and)\s*(\d{1,2})\b)?"
)
CHAPTER_ARGUMENT = re.compile(r"\bchapter=(\d+)")
CHAPTER_THEN_FOLDER = re.compile(r"\b[Cc]hapter (\d\d) \(`?(\d\d_\w+?)/?`?[),]")
TABLE_ROW = re.compile(r"^\|\s*(\d\d)\s*\|(.*)$")
SKIPPED_SUFFIXES = {".png", ".gz", ".jpg", ".svg", ".pdf"}
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()


def tracked_files(root: Path = REPO) -> list[str]:
    """git's list of the course's files; without .git, every file but the runs' and caches'."""
    if (root / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
        )
        return listed.stdout.splitlines()
    skipped = {"out", "data", ".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
    return [
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file()
        and not skipped & set(path.relative_to(root).parts)
        and not path.name.startswith("my_")
    ]


def number_of(folders: list[str]) -> dict[str, int]:
    return {folder: number for number, folder in enumerate(folders, start=1)}


def base_folder(token: str, folders: list[str]) -> str | None:
    """The listed folder a name is, or begins with (04_ddp_from_02 is 04_ddp's), else None."""
    for folder in folders:
        if token == folder or token.startswith(folder + "_"):
            return folder
    return None


def chapter_named(rest: str, folders: list[str]) -> str | None:
    """The listed folder whose name after the number `rest` is or begins with (fsdp_quick)."""
    for folder in folders:
        name = folder[3:]
        if rest == name or rest.startswith(name + "_"):
            return folder
    return None


def stale_names(path: str, text: str, folders: list[str] = FOLDERS) -> list[str]:
    """Every chapter folder or number in one file's text that the list `folders` does not hold,
    as 'path:line: why'."""
    numbers = number_of(folders)
    found = []

    def stale(line_no: int, why: str) -> None:
        found.append(f"{path}:{line_no}: {why}")

    lines = text.splitlines()
    for line_no, line in enumerate(lines, 1):
        for m in FOLDER_SHAPED.finditer(line):
            token, number, rest = m.group(), int(m.group(1)), m.group(2)
            if base_folder(token, folders):
                continue
            named = chapter_named(rest, folders)
            if named is not None:
                stale(line_no, f"{token}: that chapter is {named}")
                continue
            as_folder = line[m.end() :].startswith(("/", ".diff"))
            if as_folder and ROOT_PATH_BEFORE.search(line[: m.start()]):
                stale(line_no, f"{token} is used as a chapter folder, but the list lacks it")
                continue
            before = line[: m.start()].rstrip()
            if before.lower().endswith("chapter") and number not in numbers.values():
                stale(line_no, f"chapter {token}: no such chapter")
        for m in CHAPTER_WORD.finditer(line):
            for number in filter(None, m.groups()):
                if int(number) not in numbers.values():
                    stale(line_no, f"{m.group()}: no chapter {number}")
        for m in CHAPTER_ARGUMENT.finditer(line):
            if int(m.group(1)) not in numbers.values():
                stale(line_no, f"{m.group()}: no chapter {m.group(1)}")
        for m in CHAPTER_THEN_FOLDER.finditer(line):
            folder = base_folder(m.group(2), folders)
            if folder is not None and numbers[folder] != int(m.group(1)):
                stale(line_no, f"{m.group()}: {folder} is chapter {numbers[folder]:02d}")
        row = TABLE_ROW.match(line)
        if row:
            named = {base_folder(t.group(), folders) for t in FOLDER_SHAPED.finditer(row.group(2))}
            named.discard(None)
            if len(named) == 1 and numbers[(folder := named.pop())] != int(row.group(1)):
                stale(line_no, f"the row of chapter {row.group(1)} names {folder}")
    return found


def read_text(root: Path, path: str) -> str | None:
    if Path(path).suffix in SKIPPED_SUFFIXES:
        return None
    try:
        return (root / path).read_text()
    except (UnicodeDecodeError, FileNotFoundError):
        return None


def chapter_path_at(path: str, root: Path = REPO) -> str | None:
    """Why a path into a chapter folder names nothing there, or None (it exists, a learner or a
    run writes it, or it is a site page of a file that exists)."""
    parts = path.split("/")
    known = root / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if known.is_file():
            return None  # a site page made from the file: 04_ddp/train.py/index.html
        if (known / ".gitignore").exists() or part.startswith("my_"):
            return None  # a folder of runs' files (its .gitignore), a learner's own copy
        siblings = {p.stem for p in known.iterdir()} if known.is_dir() else set()
        if not (known / part).exists():
            if i == len(parts) - 1 and part in siblings:
                return None  # the site's page of notebook.ipynb: 04_ddp/notebook/
            return f"{path} does not exist"
        known = known / part
    return None


def missing_paths(path: str, text: str, folders: list[str] = FOLDERS, root: Path = REPO) -> list:
    """Every path into a chapter folder that one file's text names and that is not there."""
    into = re.compile(rf"(?:\.\.?/|[ab]/)*((?:{'|'.join(folders)})/[\w./-]*\w)")
    found = []
    for line_no, line in enumerate(text.splitlines(), 1):
        for m in into.finditer(line):
            if not ROOT_PATH_BEFORE.search(line[: m.start()]):
                continue  # out/05_multinode/20_steps: a run's folder
            why = chapter_path_at(m.group(1), root)
            if why:
                found.append(f"{path}:{line_no}: {why}")
    return found


def test_no_file_names_a_chapter_the_list_does_not_hold():
    found = []
    for path in tracked_files():
        if path == THIS_FILE:
            continue  # the stale names planted in the tests below
        text = read_text(REPO, path)
        if text is not None:
            found += stale_names(path, text) + missing_paths(path, text)
    assert not found, "names common/chapters.py does not hold:\n" + "\n".join(found)


def test_a_moved_file_fails_and_what_a_learner_or_a_run_writes_passes():
    folder = FOLDERS[4]
    assert missing_paths("any.md", f"sbatch {folder}/slurm.sbatch", FOLDERS)
    assert missing_paths("any.md", f"[page](../{folder}/READ_ME.md)", FOLDERS)
    written = [
        f"cp -n {folder}/exercise.py {folder}/my_exercise.py",
        f"{FOLDERS[5]}/logs/gpt-multinode-JOB_ID.out",
        f"{FOLDERS[3]}/notebook/ and {FOLDERS[3]}/train.py/index.html",
        f"out/{folder}/20_steps/ckpt.pt",
    ]
    for text in written:
        assert missing_paths("any.md", text, FOLDERS) == [], text


def test_every_chapter_folder_is_listed():
    top = {path.split("/")[0] for path in tracked_files() if "/" in path}
    folders = {name for name in top if FOLDER_SHAPED.fullmatch(name)}
    assert folders == set(FOLDERS), f"folders {sorted(folders - set(FOLDERS))} are not listed"
    assert list(CHAPTERS.values()) == FOLDERS
    assert all(folder.startswith(f"{n:02d}_") for n, folder in CHAPTERS.items())


OLD = [*FOLDERS[:5], "06_fsdp"]  # the list before chapter 06 was inserted
# the number the next chapter appended to the list would take: no folder holds it yet, so the
# stale names below stay stale whatever chapters the list gains
UNLISTED = len(FOLDERS) + 1


@pytest.mark.parametrize(
    "text",
    [
        "see 06_fsdp/README.md",
        "torchrun 06_fsdp/train.py --out-dir out/06_fsdp/quick",
        "`out/06_fsdp_quick` holds the run",
        'CHAPTER = "06_fsdp"',
        "[diff](../docs/diffs/06_fsdp.diff)",
        "| 06 | [`07_fsdp/`](07_fsdp/README.md) | FSDP |",
        "chapter 06 (07_fsdp)",
        f"chapter 07 and chapter {UNLISTED:02d}",
        f"Plan(chapter={UNLISTED})",
        f"bash {UNLISTED:02d}_next/run.sh and ../{UNLISTED:02d}_next/README.md",
        f"the chapters 01-{UNLISTED:02d}",
    ],
)
def test_a_stale_name_fails(text):
    assert stale_names("any.md", text, FOLDERS), text


@pytest.mark.parametrize(
    "text",
    [
        "python 01_single_gpu/train.py --out-dir out/01_tiny",
        "RUN_DIR=out/05_multinode/20_steps bash 05_multinode/simulate_two_nodes.sh",
        "[the diff against 02](../docs/diffs/04_ddp_from_02.diff)",
        'runs["04_diverged"] and folder / "01_facts" and "02_b2x4"',
        "| 07 | [`07_fsdp/`](07_fsdp/README.md) | FSDP |",
        "chapter 07 (07_fsdp), chapters 01-07, CourseParser(chapter=7)",
    ],
)
def test_a_run_folder_or_a_derived_name_passes(text):
    assert stale_names("any.md", text, FOLDERS) == [], text


def test_the_old_list_fails_on_the_course_as_it_is():
    """The README against the list before 06_fault_tolerance was inserted: its table fails."""
    text = (REPO / "README.md").read_text()
    assert any(
        "06_fault_tolerance" in why or "07_fsdp" in why
        for why in stale_names("README.md", text, OLD)
    )


def test_every_page_names_its_base():
    """A page's first section names its base alone (its diff: test_published_diffs_are_current)."""
    for number, folder in list(CHAPTERS.items())[1:]:
        page = (REPO / folder / "README.md").read_text()
        idea = " ".join(page.split("\n## ")[1].split())
        named = {int(m) for m in re.findall(r"\bextends chapter (\d\d)\b", idea)}
        assert named == {base(number)}, f"{folder}/README.md says it extends {named or 'nothing'}"
