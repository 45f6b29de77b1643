"""The data pipeline: prepared once and deterministically, windows shifted by one (the order
chapter 01 reads them in: tests/test_epochs_and_divergence.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler

from common.data import (
    TokenWindows,
    batch_loader,
    load_splits,
    prepare,
)
from common.support.corpus import shakespeare_texts
from common.support.errors import CourseError
from common.tokenizer import encode, get_tokenizer

DOCS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n",
    "All the world's a stage,\nAnd all the men and women merely players;\n",
    "Once more unto the breach, dear friends, once more;\n"
    "Or close the wall up with our English dead.\n",
    "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;\n",
]


def quiet(*_):
    pass


def all_tokens(folder: Path) -> np.ndarray:
    return np.concatenate(
        [
            np.fromfile(folder / "train.bin", dtype=np.uint16),
            np.fromfile(folder / "val.bin", dtype=np.uint16),
        ]
    )


def expected_tokens(docs: list[str]) -> list[int]:
    eot = get_tokenizer().eot_token
    return [t for doc in docs for t in encode(doc) + [eot]]


# ---- the default corpus --------------------------------------------------------------------------


def test_shakespeare_is_clean_play_text():
    texts = shakespeare_texts()
    assert len(texts) == 38
    text = "\n".join(texts)
    for markup in ("**", "#", "_", "\\[", "\\]", "\\"):
        assert markup not in text, f"Markdown markup {markup!r} left in the play text"
    assert not any(line != line.rstrip() for line in text.splitlines()), "trailing spaces left"
    lines = text.splitlines()
    assert "HAMLET:" in lines
    assert "ROMEO:" in lines
    assert "IAGO:" in lines
    speakers = [line for line in lines if re.fullmatch(r"[A-Z][A-Z .'-]+:", line)]
    assert len(speakers) > 10_000  # speaker names on their own lines, then the verse
    assert "To be, or not to be" in text


@pytest.mark.quick
def test_shakespeare_prepared_files(data_dir):
    folder = data_dir / "shakespeare"
    meta = json.loads((folder / "meta.json").read_text())
    train = np.fromfile(folder / "train.bin", dtype=np.uint16)
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    assert meta["train_tokens"] == len(train) > 1_000_000
    assert meta["val_tokens"] == len(val)
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 0.001  # the last tenth is held out
    assert meta["documents"] == 38
    assert train.max() < 50257
    assert val.max() < 50257
    # one <|endoftext|> after each play
    assert (np.concatenate([train, val]) == get_tokenizer().eot_token).sum() == 38


def test_prepare_is_idempotent(data_dir):
    folder = data_dir / "shakespeare"
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
    messages = []
    assert prepare("shakespeare", data_dir, log=messages.append) == folder
    assert messages == [], "a second prepare must do no work"
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
    assert after == before


# ---- local files through `datasets` --------------------------------------------------------------


def test_local_text_file(tmp_path):
    path = tmp_path / "plays.txt"
    path.write_text("".join(DOCS), encoding="utf-8")
    messages = []
    folder = prepare(str(path), tmp_path / "data", log=messages.append)
    assert messages, "the first prepare says what it does"
    # a text file is one document: its tokens, then <|endoftext|>
    assert all_tokens(folder).tolist() == expected_tokens(["".join(DOCS)])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"] == 1
    assert meta["train_tokens"] == int(len(all_tokens(folder)) * 0.9)

    messages.clear()
    assert prepare(str(path), tmp_path / "data", log=messages.append) == folder
    assert messages == []
    # an edited file is prepared again
    path.write_text("".join(DOCS[:3]), encoding="utf-8")
    folder2 = prepare(str(path), tmp_path / "data", log=messages.append)
    assert messages
    assert all_tokens(folder2).tolist() == expected_tokens(["".join(DOCS[:3])])


def test_local_jsonl_file_with_processes(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text(
        "".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(DOCS)),
        encoding="utf-8",
    )
    # Dataset.map(num_proc=2)
    folder = prepare(str(path), tmp_path / "data", num_proc=2, text_column="body", log=quiet)
    # document order kept across processes
    assert all_tokens(folder).tolist() == expected_tokens(DOCS)
    single = prepare(str(path), tmp_path / "data1", num_proc=1, text_column="body", log=quiet)
    for name in ("train.bin", "val.bin"):
        assert (single / name).read_bytes() == (folder / name).read_bytes()


def test_local_parquet_file(tmp_path):
    import datasets

    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(path))
    folder = prepare(str(path), tmp_path / "data", log=quiet)
    assert all_tokens(folder).tolist() == expected_tokens(DOCS)


def test_missing_text_column(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(CourseError, match="no column 'text'"):
        prepare(str(path), tmp_path / "data", log=quiet)


# ---- windows -----------------------------------------------------------------------------------


@pytest.mark.quick
def test_inputs_and_targets_shifted_by_one(data_dir):
    block = 32
    train, val = load_splits(data_dir / "shakespeare", block)
    tokens = np.fromfile(data_dir / "shakespeare" / "train.bin", dtype=np.uint16).astype(np.int64)
    assert len(train) == (len(tokens) - 1) // block
    for i in (0, 1, 17, len(train) - 1):
        x, y = train[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (block,)
        assert torch.equal(x[1:], y[:-1])  # y is x moved one token on
        # window i starts at i*T
        assert x.tolist() == tokens[i * block : i * block + block].tolist()
        assert y.tolist() == tokens[i * block + 1 : i * block + block + 1].tolist()
    x, y = next(iter(batch_loader(train, RandomSampler(train, generator=torch.Generator()), 4)))
    assert x.shape == y.shape == (4, block)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_windows_need_block_size_plus_one_tokens(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(33, dtype=np.uint16).tofile(path)
    assert len(TokenWindows(path, 32)) == 1  # 33 tokens: exactly one window of 32 + 1
    np.arange(32, dtype=np.uint16).tofile(path)
    with pytest.raises(CourseError, match="fewer than one window"):
        TokenWindows(path, 32)
