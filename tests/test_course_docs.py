"""The course around the code stays true to it: the published diffs, the figures, the
troubleshooting guide and the workshop."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.chapters import CHAPTERS, NOT_CHAPTER_01S_RUN
from layout import REPO

FOLDERS = list(CHAPTERS.values())
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tool(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )


# ---- published diffs ---------------------------------------------------------------------------


def test_published_diffs_are_current():
    """docs/diffs/*.diff and the whole diff in every chapter README match the train.py files."""
    proc = tool("-m", "maintainer.publish_diffs", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def copy_course(tmp_path: Path) -> Path:
    """The chapters' train.py and README.md (with the diff markers) in a scratch folder."""
    root = tmp_path / "repo"
    for chapter in FOLDERS:
        (root / chapter).mkdir(parents=True)
        shutil.copy(REPO / chapter / "train.py", root / chapter / "train.py")
        readme = REPO / chapter / "README.md"
        text = readme.read_text() if readme.exists() else f"# {chapter}\n"
        if "<!-- diff:begin -->" not in text:
            text += "\n## What changed\n\n<!-- diff:begin -->\n<!-- diff:end -->\n\nMore text.\n"
        (root / chapter / "README.md").write_text(text)
    return root


def test_diff_check_fails_when_the_code_changes(tmp_path):
    root = copy_course(tmp_path)
    diffs = root / "docs" / "diffs"
    diffs.mkdir(parents=True)
    stray = diffs / f"{FOLDERS[3]}_from_02.diff"
    stray.write_text("a diff under a name no chapter has\n")
    # nothing published yet
    assert tool("-m", "maintainer.publish_diffs", "--check", "--root", root).returncode != 0
    assert tool("-m", "maintainer.publish_diffs", "--root", root).returncode == 0
    assert tool("-m", "maintainer.publish_diffs", "--check", "--root", root).returncode == 0
    assert not stray.exists()  # one file per chapter

    before = copy_course(tmp_path / "untouched") / FOLDERS[1] / "README.md"
    readme = (root / FOLDERS[1] / "README.md").read_text()
    diff = (diffs / f"{FOLDERS[1]}.diff").read_text()
    assert diff.startswith(f"--- a/{FOLDERS[0]}/train.py\n+++ b/{FOLDERS[1]}/train.py\n")
    assert diff in readme  # the chapter text shows the published diff ...
    # ... and the rest of it is untouched
    assert readme.startswith(before.read_text().split("<!-- diff:begin -->")[0])
    assert readme.endswith(before.read_text().split("<!-- diff:end -->")[1])
    # chapter 04 against its base, 02: DDP alone, chapter 03's class neither added nor removed
    diff = (diffs / f"{FOLDERS[3]}.diff").read_text()
    assert diff.startswith(f"--- a/{FOLDERS[1]}/train.py\n+++ b/{FOLDERS[3]}/train.py")
    assert "DataParallel(nn.DataParallel)" not in diff
    readme = (root / FOLDERS[3] / "README.md").read_text()
    assert f"What changed from chapter 02: `{FOLDERS[3]}/train.py`" in readme

    # a change to a chapter's script that is not republished: both the file and the README are stale
    script = root / FOLDERS[1] / "train.py"
    script.write_text(script.read_text() + "# changed, and not republished\n")
    (diffs / f"{FOLDERS[6]}.diff").unlink()
    proc = tool("-m", "maintainer.publish_diffs", "--check", "--root", root)
    assert proc.returncode != 0
    assert f"docs/diffs/{FOLDERS[1]}.diff is out of date" in proc.stderr
    assert f"the diff in {FOLDERS[1]}/README.md is out of date" in proc.stderr
    assert f"docs/diffs/{FOLDERS[3]}.diff is out of date" in proc.stderr  # 02 is chapter 04's base
    assert f"docs/diffs/{FOLDERS[6]}.diff is missing" in proc.stderr

    # republishing fixes it, and a README without the markers is reported
    assert tool("-m", "maintainer.publish_diffs", "--root", root).returncode == 0
    assert tool("-m", "maintainer.publish_diffs", "--check", "--root", root).returncode == 0
    (root / FOLDERS[1] / "README.md").write_text("# no markers\n")
    proc = tool("-m", "maintainer.publish_diffs", "--check", "--root", root)
    assert proc.returncode != 0
    assert "lacks the lines" in proc.stderr


# ---- figures -----------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    assert path.exists(), f"{path} was not written"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a real figure ({len(data)} bytes)"
    assert len(data) > 10_000, f"{path} is not a real figure ({len(data)} bytes)"


def test_committed_figures_cover_every_chapter():
    figures = REPO / "docs" / "figures"
    assert_png(figures / "parity_loss.png")
    captions = (figures / "CAPTIONS.md").read_text()
    assert "in float64" in captions  # the rounding control is in the committed figure
    for number, chapter in CHAPTERS.items():
        if number in NOT_CHAPTER_01S_RUN:
            continue  # its run is not chapter 01's: the parity figure leaves it out
        assert f"{chapter}/train.py" in captions, (
            f"the committed figures predate {chapter}: docs/figures/CAPTIONS.md names no run of it"
        )


# ---- troubleshooting and workshop --------------------------------------------------------------

CITATION = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")


def test_troubleshooting_cites_tests_that_exist():
    text = (REPO / "docs" / "TROUBLESHOOTING.md").read_text()
    citations = CITATION.findall(text)
    assert len(citations) >= 8
    missing = []
    for file, name in citations:
        path = REPO / "tests" / file
        if not path.exists() or not re.search(rf"^\s*def {name}\(", path.read_text(), re.MULTILINE):
            missing.append(f"tests/{file}::{name}")
    assert not missing, f"TROUBLESHOOTING.md cites tests that do not exist: {missing}"


DEEP_DIVES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "deep").glob("*.md"))
# the design's main line ends at chapter 05; chapters 06 and 07 come after it, read when needed
MAIN_LINE = FOLDERS[:5]
MAIN_PATH = ["README.md", *(f"{chapter}/README.md" for chapter in MAIN_LINE)]
AFTER_MAIN_LINE = [f"{chapter}/README.md" for chapter in FOLDERS[5:]]


MAIN_PATH_WORDS = 14_000
CHAPTER_AFTER_MAIN_LINE_WORDS = 2_500
# chapter 08's whole diff replaces DDP (2,300 words, as chapter 04's replaces DataParallel: the
# rounds, each rank's checkpoint on its own disk and the resume's refusals), and its page carries
# the table of what it measured on the slow link; chapter 07's diff from 05 replaces DDP too, and
# its page says what FSDP does not shard (rank 0's host memory)
LONGER_CHAPTER_WORDS = {"07_fsdp/README.md": 2_800, "08_slow_link/README.md": 3_600}
PARTS = ["## The idea", "## Run it", "## The diff", "## Check it yourself", "## Deep dives"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PAGES = ["docs/TROUBLESHOOTING.md", "docs/WORKSHOP.md", *MAIN_PATH, *AFTER_MAIN_LINE, *DEEP_DIVES]
# a repository path as the pages write it: 01_single_gpu/train.py, maintainer/make_plots.py, ...
NAMED_PATH = re.compile(
    r"(?<![\w/.-])((?:0\d_[a-z_]+|tools|common|docs|tests|bench|maintainer|workers|\.ci)/"
    r"[\w./-]+\.(?:py|sh|ipynb|md|png|sbatch))"
)


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_page_names_or_links_exists(page):
    """The paths a page names (`01_single_gpu/train.py`) and the files it links to exist."""
    path = REPO / page
    text = path.read_text()
    named = set(NAMED_PATH.findall(text))
    # a learner's own copy (04_ddp/my_exercise.py) is the learner's to make
    mine = {p for p in named if p.rsplit("/", 1)[-1].startswith("my_")}
    missing = sorted(p for p in named - mine if not (REPO / p).exists())
    assert not missing, f"{page} names files that do not exist: {missing}"
    links = [target for target in LINK.findall(text) if "://" not in target]
    missing = [target for target in links if not (path.parent / target).exists()]
    assert not missing, f"{page} links to files that do not exist: {missing}"


def test_the_main_path_stays_short_and_every_chapter_reads_in_five_parts():
    """The main path fits an afternoon; every chapter page has the same five parts, and its check
    runs on a copy of the exercise (the course's own stays intact)."""
    words = sum(len((REPO / page).read_text().split()) for page in MAIN_PATH)
    assert words <= MAIN_PATH_WORDS, f"the main path has {words} words, more than {MAIN_PATH_WORDS}"
    for page in AFTER_MAIN_LINE:
        words = len((REPO / page).read_text().split())
        limit = LONGER_CHAPTER_WORDS.get(page, CHAPTER_AFTER_MAIN_LINE_WORDS)
        assert words <= limit, f"{page} has {words} words, more than {limit}"
    for chapter in FOLDERS:
        text = (REPO / chapter / "README.md").read_text()
        headings = [line for line in text.splitlines() if line.startswith("## ")]
        assert headings == PARTS, f"{chapter}/README.md has the parts {headings}, not {PARTS}"
        check = text.split("## Check it yourself")[1].split("## Deep dives")[0]
        if chapter == FOLDERS[0]:
            assert "pytest -m quick" in check
        else:
            assert f"cp -n {chapter}/exercise.py {chapter}/my_exercise.py" in check, chapter
            assert f"python -m tools.check {chapter}/my_exercise.py" in check, chapter


def test_every_deep_dive_is_linked_and_opens_with_why_to_read_it():
    linked = set()
    for page in [*MAIN_PATH, *AFTER_MAIN_LINE]:
        linked |= {
            (REPO / page).parent.joinpath(t).resolve()
            for t in LINK.findall((REPO / page).read_text())
        }
    assert len(DEEP_DIVES) >= 5
    for page in DEEP_DIVES:
        assert (REPO / page).resolve() in linked, f"no README links to {page}"
        first = (REPO / page).read_text().split("\n\n")[1]
        assert not first.startswith(("#", "```", "|", "-")), (
            f"{page} does not open with a paragraph"
        )
