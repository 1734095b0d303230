"""The manifest of an indexed corpus (`manifest.json`, schema `hydraulis.corpus/1`).

It says what a corpus holds and where it came from: the source, the
tokenizer (name, vocabulary, end-of-document id and, for a Hugging Face
tokenizer, its path and the sha256 of its files), counts, what the readers
skipped or repaired, the target tokens, and the sha256 of every file. Built
with `--max-len`, it also says what training at that max_len and over-long
policy cuts (`overlong`: records split, truncated or dropped, target tokens
lost and kept). Keys added since the first version (`tokenizer.source`,
`tokenizer.sha256`, `targets`, `mask`, `overlong`) are optional on reading,
so older corpora still open.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydraulis.data.readers import ReadReport
from hydraulis.data.sampler import POLICIES, Overlong
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields, load_json

CORPUS_SCHEMA = "hydraulis.corpus/1"
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.idx"
MASK_FILE = "mask.bin"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class CorpusManifest:
    """What a corpus holds and where it came from (manifest.json)."""

    name: str
    source: str
    tokenizer: str
    vocab_size: int
    eod_id: int
    dtype: str
    documents: int
    tokens: int
    max_length: int
    report: ReadReport
    checksums: dict[str, str]
    eod_appended: bool = True
    tokenizer_source: str | None = None  # a Hugging Face tokenizer's path (`tokenizer` is its identity)
    tokenizer_sha256: tuple[tuple[str, str], ...] = ()
    targets: int | None = None  # tokens that are targets (SFT: completions); None: every token but each first
    masked: bool = False  # mask.bin marks which tokens are targets
    overlong: Overlong | None = None  # what training at a max_len would cut (data build --max-len)

    @property
    def target_tokens(self) -> int:
        """Tokens the loss counts: a document's first token is never one (it has no context)."""
        return self.targets if self.targets is not None else self.tokens - self.documents

    def to_dict(self) -> dict[str, Any]:
        tokenizer: dict[str, Any] = {"name": self.tokenizer, "vocab_size": self.vocab_size, "eod_id": self.eod_id}
        if self.tokenizer_source is not None:
            tokenizer["source"] = self.tokenizer_source
            tokenizer["sha256"] = dict(self.tokenizer_sha256)
        extra = {"overlong": self.overlong.to_dict()} if self.overlong is not None else {}
        return {
            "schema": CORPUS_SCHEMA,
            "name": self.name,
            "source": self.source,
            "tokenizer": tokenizer,
            "dtype": self.dtype,
            "eod_appended": self.eod_appended,
            "documents": self.documents,
            "tokens": self.tokens,
            "targets": self.target_tokens,
            "mask": self.masked,
            "max_length": self.max_length,
            "input": self.report.to_dict(),
            "sha256": dict(self.checksums),
            **extra,
        }

    @classmethod
    def load(cls, path: Path) -> CorpusManifest:
        data = load_json(path, CORPUS_SCHEMA)
        f = Fields(data, str(path))
        tok = f.obj("tokenizer")
        inp = f.obj("input")
        sums = f.obj("sha256")
        report = ReadReport(**{k: inp.int(k, default=0, minimum=0) for k in ReadReport().to_dict()})
        dtype = f.str("dtype")
        if dtype not in ("uint16", "uint32"):
            raise HydraulisError(f"{path}.dtype: expected uint16 or uint32, got {dtype!r}")
        flags = {}
        for key, default in (("eod_appended", True), ("mask", False)):
            flags[key] = data.get(key, default)
            if not isinstance(flags[key], bool):
                raise HydraulisError(f"{path}.{key}: expected true or false, got {flags[key]!r}")
        files = [TOKENS_FILE, INDEX_FILE] + ([MASK_FILE] if flags["mask"] else [])
        tokens = f.int("tokens", minimum=1)
        hashes = data["tokenizer"].get("sha256", {})
        if not isinstance(hashes, dict) or not all(isinstance(v, str) for v in hashes.values()):
            raise HydraulisError(f"{path}.tokenizer.sha256: expected an object of file name -> hex digest")
        source = data["tokenizer"].get("source")
        return cls(
            name=f.str("name"),
            source=f.str("source"),
            tokenizer=tok.str("name"),
            vocab_size=tok.int("vocab_size", minimum=1),
            eod_id=tok.int("eod_id", minimum=0),
            dtype=dtype,
            documents=f.int("documents", minimum=1),
            tokens=tokens,
            max_length=f.int("max_length", minimum=1),
            report=report,
            checksums={name: sums.str(name) for name in files},
            eod_appended=flags["eod_appended"],
            tokenizer_source=source if isinstance(source, str) else None,
            tokenizer_sha256=tuple(sorted(hashes.items())),
            targets=f.int("targets", default=None, minimum=0, maximum=tokens) if "targets" in data else None,
            masked=flags["mask"],
            overlong=_overlong(f.obj("overlong")) if "overlong" in data else None,
        )


def _overlong(f: Fields) -> Overlong:
    policy = f.str("policy")
    if policy not in POLICIES:
        raise HydraulisError(f"{f.where}.policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    keys = ("max_len", "split", "truncated", "dropped", "pieces", "target_tokens_lost", "target_tokens_kept")
    return Overlong.from_dict({"policy": policy, **{k: f.int(k, minimum=0) for k in keys}})
