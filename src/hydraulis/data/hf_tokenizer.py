"""Hugging Face tokenizers: a `tokenizer.json` (or a model directory holding one) through `tokenizers`.

A fine-tuned model must see the ids of its own vocabulary, so the corpus
records WHICH tokenizer made its ids: `name` is `hf-` and the first 16 hex
digits of the sha256 over the tokenizer's files (`tokenizer.json`, and
`tokenizer_config.json` and `chat_template.jinja` when present: they name
the eos token and hold the chat template). Two corpora built with the same files share the name; a
different vocabulary, eos token or template is a different name.

- `encode` adds no special tokens (as the GPT-2 and byte tokenizers); the
  ids the tokenizer's post-processor puts before a text (LLaMA's `<s>`) are
  `prefix`, which the corpus builder puts before each document, as
  `AutoTokenizer(text)` does.
- The end-of-document token is the eos token of `tokenizer_config.json`
  (`eos_token`, a string or `{"content": ...}`), else the first of the usual
  end tokens the vocabulary holds.
- `vocab_size` is the largest id + 1 (added tokens included): what the
  model's embedding must hold.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.files import not_found

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
USUAL_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>")


@dataclass(frozen=True)
class HFTokenizer:
    """A `tokenizers.Tokenizer` with the identity, eos and template hydraulis needs."""

    backend: Any = field(repr=False, compare=False)
    name: str
    source: str  # the path it was loaded from (for people; `name` is the identity)
    vocab_size: int
    eod_id: int
    eos_token: str
    bos_token: str | None
    prefix: tuple[int, ...]
    chat_template: str | None = field(default=None, repr=False)
    sha256: tuple[tuple[str, str], ...] = ()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in out]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids and each token's [start, end) characters in `text` (a chat's targets are spans of it)."""
        e = self.backend.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        return self.backend.decode([int(t) for t in np.asarray(tokens).reshape(-1)], skip_special_tokens=False)


def tokenizer_files(spec: str | Path) -> tuple[Path, Path | None]:
    """`tokenizer.json` and `tokenizer_config.json` (None if absent) of a directory or a tokenizer.json path."""
    path = Path(spec)
    if path.is_dir():
        main = path / TOKENIZER_FILE
        if not main.is_file():
            raise HydraulisError(
                f"{path}: no {TOKENIZER_FILE} (not a Hugging Face tokenizer directory); "
                "give a directory with tokenizer.json, a tokenizer.json file, gpt2 or bytes"
            )
    elif path.is_file():
        main = path
    else:
        where = not_found(path, "no such file or directory")
        raise HydraulisError(
            f"unknown tokenizer {str(spec)!r}: not gpt2 or bytes, and {where}; "
            "give a Hugging Face tokenizer.json or the directory holding it"
        )
    config = main.parent / CONFIG_FILE
    return main, config if config.is_file() else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(spec: str | Path) -> HFTokenizer:
    """Load and check a Hugging Face tokenizer; one line naming the path if it is not one.

    Loaded once per process while its files stay the same (size and modification time).
    """
    main, config_path = tokenizer_files(spec)
    jinja = main.parent / TEMPLATE_FILE
    files = [p for p in (main, config_path, jinja if jinja.is_file() else None) if p is not None]
    try:
        stamp = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        return _load(str(spec), main, config_path, jinja if jinja.is_file() else None, stamp)
    except OSError as exc:
        raise HydraulisError(f"tokenizer {spec}: cannot read: {exc.strerror or exc}") from None


@functools.cache
def _load(spec: str, main: Path, config_path: Path | None, jinja: Path | None, stamp: tuple) -> HFTokenizer:
    from tokenizers import Tokenizer as Backend

    raw = main.read_bytes()
    try:
        backend = Backend.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises its own Exception for every malformed file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HydraulisError(f"{main}: not a Hugging Face tokenizer.json ({first[:120]})") from None
    hashes = [(TOKENIZER_FILE, hashlib.sha256(raw).hexdigest())]
    config: dict[str, Any] = {}
    if config_path is not None:
        config_raw = config_path.read_bytes()
        try:
            config = json.loads(config_raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HydraulisError(f"{config_path}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise HydraulisError(f"{config_path}: expected a JSON object")
        hashes.append((CONFIG_FILE, hashlib.sha256(config_raw).hexdigest()))
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:
        raise HydraulisError(f"{main}: the tokenizer has an empty vocabulary")
    eos = _token_text(config.get("eos_token"))
    if eos is None:
        eos = next((t for t in USUAL_EOS if t in vocab), None)
    if eos is None or eos not in vocab:
        usual = ", ".join(USUAL_EOS)
        what = f"its eos_token {eos!r} is not in the vocabulary" if eos else f"no eos_token and none of {usual}"
        raise HydraulisError(f"{main}: {what}; set eos_token in {CONFIG_FILE}")
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    prefix = tuple(with_special[: with_special.index(plain[0])]) if plain and plain[0] in with_special else ()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if jinja is not None:  # where transformers 4.43+ saves it: this file wins over the config's
        template_raw = jinja.read_bytes()
        template = template_raw.decode("utf-8", errors="replace")
        hashes.append((TEMPLATE_FILE, hashlib.sha256(template_raw).hexdigest()))
    identity = hashlib.sha256("".join(f"{n}:{h};" for n, h in hashes).encode()).hexdigest()
    return HFTokenizer(
        backend=backend,
        name=f"hf-{identity[:16]}",
        source=str(main.parent if Path(spec).is_dir() else main),
        vocab_size=max(vocab.values()) + 1,
        eod_id=vocab[eos],
        eos_token=eos,
        bos_token=_token_text(config.get("bos_token")),
        prefix=prefix,
        chat_template=template if isinstance(template, str) else None,
        sha256=tuple(hashes),
    )
