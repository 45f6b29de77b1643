"""The offline tokenizer gives exactly the ids of tiktoken's own GPT-2 encoding."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from common.tokenizer import decode, encode, get_tokenizer, gpt2_files

# The URLs tiktoken_ext.openai_public.gpt2() downloads; tiktoken caches each under sha1(url).
VOCAB_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
ENCODER_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"

SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n"
    "  It is the east,\tand Juliet is the sun.   \n\n\n"
    "Numbers: 0 7 42 1999 3.14159 -12,345 1e-3 2024-06-01\n"
    "Unicode: café naïve Ångström Straße こんにちは 你好 Привет 😀👍🏽 — “quoted” ‘single’ …\n"
    "Code: def f(x): return x**2  # comment\r\n"
    "Contractions: I'm, you're, it's, we'll, they've, don't, 'tis\n"
    "Spaces:      many\n\n\n\nblank lines and a special string <|endoftext|> as plain text.\n"
)

GENUINE = r"""
import json, sys
import tiktoken
enc = tiktoken.get_encoding("gpt2")
text = json.load(open(sys.argv[1], encoding="utf-8"))  # JSON: no newline translation
print(json.dumps({"ids": enc.encode_ordinary(text), "eot": enc.eot_token, "n_vocab": enc.n_vocab}))
"""


@pytest.mark.quick
def test_hello_world():
    assert encode("Hello world") == [15496, 995]
    assert decode([15496, 995]) == "Hello world"


def test_round_trip():
    assert decode(encode(SAMPLE)) == SAMPLE


def test_same_ids_as_genuine_tiktoken(tmp_path):
    """tiktoken.get_encoding("gpt2"), fed its two files through its own download cache, agrees."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    vocab_bpe, encoder_json = gpt2_files()
    for url, source in ((VOCAB_URL, vocab_bpe), (ENCODER_URL, encoder_json)):
        shutil.copyfile(source, cache / hashlib.sha1(url.encode()).hexdigest())
    # A fresh process: tiktoken's registry and our lru_cache start empty, and nothing reaches the
    # network (a cache miss would try to download and fail here).
    env = {
        "TIKTOKEN_CACHE_DIR": str(cache),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    sample_file = tmp_path / "sample.json"
    sample_file.write_text(json.dumps(SAMPLE), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-c", GENUINE, str(sample_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    genuine = json.loads(proc.stdout)
    assert genuine["eot"] == get_tokenizer().eot_token
    assert genuine["n_vocab"] == get_tokenizer().n_vocab
    ours = encode(SAMPLE)
    assert len(ours) > 100
    assert ours == genuine["ids"]
