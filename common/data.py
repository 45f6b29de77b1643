"""From a corpus to batches: prepare once into token files (GPT-2 ids as uint16), then read windows.

Window i holds tokens [i*T, i*T + T] (T = block_size, one more so that the targets are the inputs
shifted by one). Which windows a step reads is the sampler's business: this module knows nothing
about ranks."""

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .support.corpus import corpus_source, read_corpus
from .support.errors import CourseError
from .tokenizer import get_tokenizer

FORMAT_VERSION = 1  # bump when the way files are written changes, so old folders are redone
VAL_FRACTION = 0.1  # the last tenth of the token stream is held out for validation


def prepare(
    corpus: str,
    data_root: str | Path,
    num_proc: int | None = None,
    text_column: str = "text",
    log: Callable[[str], None] = print,
) -> Path:
    """Tokenize `corpus` once into `<data_root>/<name>/`, as train.bin, val.bin and meta.json;
    return that folder."""
    kind, folder_name, fingerprint = corpus_source(corpus)
    folder = Path(data_root) / folder_name
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        meta = {}  # not prepared yet, or cut short
    # the folder is reused while it was prepared the same way from the same source
    up_to_date = (
        meta.get("format") == FORMAT_VERSION
        and meta.get("val_fraction") == VAL_FRACTION
        # no fingerprint, no source to compare with: a folder prepared elsewhere is used as it is
        and (fingerprint is None or meta.get("fingerprint") == fingerprint)
    )
    # meta.json is written last, so the token files beside it are complete, unless someone has
    # deleted one since: then the folder is prepared again
    if up_to_date and (folder / "train.bin").exists() and (folder / "val.bin").exists():
        return folder

    log(f"preparing corpus {corpus!r} into {folder} (once; later runs reuse it)")
    texts = read_corpus(kind, corpus, text_column)
    if not any(texts):  # no documents, or only empty ones
        raise CourseError(f"corpus {corpus!r} contains no text")
    threads = num_proc or min(os.cpu_count() or 1, 8)
    tokenizer = get_tokenizer()
    docs = tokenizer.encode_ordinary_batch(texts, num_threads=threads)
    # every document ends with <|endoftext|>, so the model sees where one text stops
    eot = tokenizer.eot_token
    ids = np.concatenate([np.array(doc + [eot], dtype=np.uint16) for doc in docs])
    split = int(len(ids) * (1 - VAL_FRACTION))
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", ids[:split]), ("val.bin", ids[split:])):
        part.tofile(folder / f"{name}.tmp")
        os.replace(folder / f"{name}.tmp", folder / name)
    meta = {
        "corpus": corpus,
        "tokenizer": "gpt2",
        "dtype": "uint16",
        "documents": len(texts),
        "fingerprint": fingerprint,
        "val_fraction": VAL_FRACTION,
        "format": FORMAT_VERSION,
        "train_tokens": split,
        "val_tokens": len(ids) - split,
    }
    (folder / "meta.json.tmp").write_text(json.dumps(meta, indent=2) + "\n")
    # written last: its presence means the folder is complete
    os.replace(folder / "meta.json.tmp", meta_path)
    log(
        f"prepared {len(texts)} documents: "
        f"{split:,} training and {len(ids) - split:,} validation tokens"
    )
    return folder


class TokenWindows(Dataset):
    """Map-style dataset: item i is (x, y), window i of a token file, y shifted by one from x."""

    def __init__(self, bin_path: str | Path, block_size: int):
        self.path = Path(bin_path)  # tools/check/probe.py tells the training file by its name
        self.block_size = block_size
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
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
    train_set = TokenWindows(folder / "train.bin", block_size)
    val_set = TokenWindows(folder / "val.bin", block_size)
    return train_set, val_set


def batch_loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    skip_batches: int = 0,
    device: torch.device | None = None,
) -> DataLoader:
    """Batches in the sampler's order, starting `skip_batches` in, for `device`. An incomplete
    last batch is dropped."""
    # the sampler's window indices for this epoch, from where a resumed run starts
    windows = list(sampler)[skip_batches * batch_size :]
    # batches in pinned (page-locked) memory: their copy to a CUDA GPU need not wait
    pin_memory = device is not None and device.type == "cuda"
    return DataLoader(
        dataset,
        batch_size,
        sampler=windows,
        drop_last=True,
        pin_memory=pin_memory,
        # its own generator: building a loader must not draw from the global random state that
        # dropout uses, so a resumed run draws the same dropout masks as an unbroken one
        generator=torch.Generator(),
    )


def validation_windows(dataset: TokenWindows, batches: int, batch_size: int) -> list[int]:
    """The fixed windows every evaluation reads, evenly spread over the validation split: `batches`
    whole batches of `batch_size` (fewer where the split is short), so that no batch is ragged."""
    whole_batches = min(batches, len(dataset) // batch_size)
    if whole_batches == 0:
        raise CourseError(
            f"the validation split has {len(dataset)} windows, fewer than one batch of "
            f"{batch_size}; lower --batch-size or use a larger corpus"
        )
    count = whole_batches * batch_size
    return np.linspace(0, len(dataset) - 1, count).round().astype(int).tolist()


def count_steps_per_epoch(train_set: TokenWindows, global_batch: int) -> int:
    """Optimizer steps in one pass over the training windows: the incomplete last batch of an epoch
    is dropped. A corpus too small for one batch is refused."""
    steps = len(train_set) // global_batch
    if steps == 0:
        raise CourseError(
            f"the training split has {len(train_set)} windows, fewer than one batch of "
            f"{global_batch}; lower --batch-size or use a larger corpus"
        )
    return steps
