"""`hydraulis data build|stats` and `hydraulis workload`: real corpora in, length distributions out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import console, print_json, table
from hydraulis.errors import HydraulisError
from hydraulis.limits import MAX_BATCHES, MAX_LENGTH, MAX_SEED, MAX_TOKENS_PER_BATCH

data_app = typer.Typer(help="Tokenize corpora into indexed form and describe their length distributions.")
app.add_typer(data_app, name="data")

TokenizerOption = typer.Option(
    "gpt2",
    "--tokenizer",
    "-t",
    help="gpt2 (BPE, needs tiktoken), bytes, or a Hugging Face tokenizer.json or model directory.",
)


MaxLenOption = typer.Option(
    None,
    "--max-len",
    help="Count what training at this max_len cuts (records, target tokens); with build: into the manifest, and "
    "a corpus left without targets is refused. The tokens are not cut.",
    min=2,
    max=MAX_LENGTH,
)
OverlongOption = typer.Option("split", "--overlong", help="With --max-len: split, truncate or drop ([data] overlong).")


def check_policy(policy: str) -> Any:
    """An --overlong value (a sampler Policy), or one line naming it."""
    from hydraulis.data.sampler import POLICIES

    if policy not in POLICIES:
        raise HydraulisError(f"--overlong {policy!r}: choose one of {', '.join(POLICIES)}")
    return policy


@data_app.command("build")
def build(
    source: str = typer.Argument(
        ...,
        help="A jsonl, parquet, arrow or text file, a directory (datasets.save_to_disk too), or a built-in name.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Corpus directory to create."),
    tokenizer: str = TokenizerOption,
    field: str = typer.Option(
        "text", "--field", help="jsonl, parquet, arrow: the field that holds each document's text."
    ),
    skip_missing: bool = typer.Option(False, "--skip-missing", help="Records: skip those without the field."),
    fmt: str = typer.Option(
        "auto", "--format", help="Records: auto (by their keys), text (the field), sft (prompt/completion, messages)."
    ),
    skip_bad: bool = typer.Option(
        False, "--skip-bad", help="SFT: skip (and count) records with nothing to train on, e.g. an empty completion."
    ),
    glob: str = typer.Option("**/*", "--glob", help="Directory: which files to read (.jsonl files as jsonl)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    max_len: int = MaxLenOption,
    overlong: str = OverlongOption,
    workers: int = typer.Option(
        None, "--workers", "-j", help="Processes that tokenize (default: the cores available).", min=1, max=4096
    ),
) -> None:
    """Tokenize a source into an indexed corpus (tokens.bin + index.idx + manifest.json), on every core;
    a build interrupted or killed leaves no corpus, and the next one reuses what it finished."""
    import time

    from hydraulis.data.build.corpus import build_corpus
    from hydraulis.data.builtin import BUILTINS, build_builtin, get_builtin
    from hydraulis.data.readers import InputOptions, ReadCounts
    from hydraulis.data.records import check_format
    from hydraulis.data.sources import read_source, source_bytes, source_files, source_key
    from hydraulis.data.tokenizer import get_tokenizer
    from hydraulis.progress import byte_progress

    tok = get_tokenizer(tokenizer)  # a bad tokenizer fails here, before anything is read or written
    if_exists = "replace" if force else "error"
    path = Path(source)
    cut = (max_len, check_policy(overlong)) if max_len is not None else None
    start = time.perf_counter()
    if not path.exists() and source in BUILTINS:
        total = sum(p.stat().st_size for p in get_builtin(source).find_files())
        corpus = build_builtin(
            source, out, tokenizer, progress=True, if_exists=if_exists, overlong=cut, workers=workers
        )
    else:
        options = InputOptions(field=field, skip_missing=skip_missing, glob=glob, format=check_format(fmt))
        total = source_bytes(path, options)
        counts = ReadCounts()
        with byte_progress(total, f"tokenizing {path.name} ({tok.name})") as advance:
            docs = read_source(path, counts, options, advance)
            corpus = build_corpus(
                docs, out, tok, str(path.resolve()), counts, if_exists=if_exists, skip_bad=skip_bad, overlong=cut,
                workers=workers, resume=source_key(path, source_files(path, options)) + f"\n{options}",
            )
    _print_built(out, corpus.manifest, time.perf_counter() - start, total, as_json)


def _print_built(out: Path, m: Any, seconds: float, total: int, as_json: bool) -> None:
    """The manifest (--json), or what was built, how fast, and what the readers did."""
    if as_json:
        print_json(m.to_dict())
        return
    console.print(
        f"built {out}: {m.documents:,} documents, {m.tokens:,} tokens, {m.target_tokens:,} targets "
        f"({m.tokenizer}, {m.dtype}), longest {m.max_length:,}"
    )
    console.print(f"in {seconds:.1f} s: {total / 1e6 / seconds:.1f} MB/s of input, {m.tokens / seconds:,.0f} tokens/s")
    if m.overlong is not None:
        console.print(f"overlong: {m.overlong.describe()}")
    rows = [[k.replace("_", " "), v] for k, v in m.report.to_dict().items()]
    console.print(table("input", ["", "count"], rows))


@data_app.command("stats")
def stats(
    corpora: list[str] = typer.Argument(
        ..., help="A built corpus directory or a built-in name (python-stdlib, ...); several with --weights: a mixture."
    ),
    weights: str = typer.Option(None, "--weights", help="A mixture's weights, one per corpus: 0.8,0.2"),
    tokenizer: str = TokenizerOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Path = typer.Option(None, "--plot", help="Write a length histogram (log x-axis) to this .png/.svg/.pdf."),
    max_len: int = MaxLenOption,
    overlong: str = OverlongOption,
) -> None:
    """Length distribution of a corpus: tokens and target tokens (SFT: the completions), percentiles,
    long-tail shares, quadratic share of the top 1%; what a max_len cuts (--max-len, or the manifest's).
    A mixture (several corpora and --weights): each source, and the documents one mixture epoch draws."""
    from hydraulis.data.indexed import corpus_sampler
    from hydraulis.data.indexed import overlong as overlong_of
    from hydraulis.data.stats import length_stats, plot_histogram

    if plot is not None:
        from hydraulis.plots import check_plot_path

        check_plot_path(plot, "--plot")
    policy = check_policy(overlong)
    c, sources = _stats_corpus(corpora, weights, tokenizer)
    lengths, targets = c.lengths, c.manifest.target_tokens
    if sources:  # the mixture's own distribution: the documents an epoch draws, each source at its weight
        import numpy as np

        docs = corpus_sampler(c, int(c.lengths.max()), None, 0, mixture=c.mixture).order(0)
        lengths, targets = c.lengths[docs], c.piece_targets(docs, np.zeros_like(docs), c.lengths[docs])
    st = length_stats(lengths)
    cut = getattr(c.manifest, "overlong", None)
    if max_len is not None:
        cut = overlong_of(c, corpus_sampler(c, max_len, max_len, 0, policy))
    if plot is not None:
        plot_histogram(lengths, plot, title=f"{c.name} ({c.manifest.tokenizer}): {st.count:,} documents",
                       max_len=max_len if max_len is not None else cut.max_len if cut is not None else None)
    if as_json:
        extra = {"sources": [{"corpus": s.name, "weight": w, **length_stats(s.lengths).to_dict(),
                              "target_tokens": s.manifest.target_tokens} for s, w in sources]} if sources else {}
        print_json({"corpus": c.name, "path": str(c.path), "tokenizer": c.manifest.tokenizer, **st.to_dict(),
                    "target_tokens": targets, "masked": c.manifest.masked,
                    "overlong": cut.to_dict() if cut is not None else None, **extra})  # fmt: skip
        return
    rows = [_stats_row(f"{s.name} ({w:.1%})", length_stats(s.lengths), s.manifest.target_tokens) for s, w in sources]
    rows.append(_stats_row("mixture (one epoch)" if sources else c.name, st, targets))
    console.print(table(f"{c.path} ({c.manifest.tokenizer})", _stats_columns(), rows))
    if cut is not None:
        console.print(f"overlong: {cut.describe()}")
    if plot is not None:
        console.print(f"wrote {plot}")


def _stats_corpus(corpora: list[str], weights: str | None, tokenizer: str) -> tuple[Any, list[tuple[Any, float]]]:
    """The corpus of `data stats`, or the mixture of several and its (source, weight) pairs."""
    from hydraulis.data.builtin import resolve_corpus

    if len(corpora) == 1 and weights is None:
        return resolve_corpus(corpora[0], tokenizer, progress=True), []
    try:
        given = [float(w) for w in (weights or "").split(",")]
    except ValueError:
        given = []
    if len(given) != len(corpora) or not all(0 < w < float("inf") for w in given):
        given_as = f"--weights {weights!r}" if weights is not None else "several corpora are a mixture"
        raise HydraulisError(f"{given_as}: give --weights, one positive weight per corpus ({len(corpora)}), e.g. "
                             + ",".join(["1"] * len(corpora)))  # fmt: skip
    from hydraulis.training.mixture import MixedCorpus, source_names

    opened = tuple(resolve_corpus(name, tokenizer, progress=True) for name in corpora)
    mixed = MixedCorpus(opened, source_names(opened), tuple(given))
    return mixed, list(zip(opened, mixed.mixture.weights, strict=True))


def _stats_columns() -> list[str]:
    from hydraulis.data.stats import THRESHOLDS

    return ["corpus", "docs", "tokens", "targets", "p50", "p90", "p99", "max"] + [
        f">{t // 1024}K" for t in THRESHOLDS] + ["top1% s²"]  # fmt: skip


def _stats_row(name: str, st: Any, targets: int) -> list[Any]:
    from hydraulis.data.stats import THRESHOLDS

    row = [name, f"{st.count:,}", f"{st.tokens:,}", f"{targets:,}", st.p50, st.p90, st.p99, st.max]
    return row + [f"{st.share_above[t]:.1%}" for t in THRESHOLDS] + [f"{st.top1_sq_share:.1%}"]


@app.command()
def workload(
    corpus: str = typer.Option(..., "--corpus", "-c", help="A built corpus directory or a built-in name."),
    out: Path = typer.Option(..., "--out", "-o", help="Workload file to write (hydraulis.workload/1)."),
    tokens_per_batch: int = typer.Option(
        262144, "--tokens-per-batch", "-T", help="Token budget of a global batch.", min=1, max=MAX_TOKENS_PER_BATCH
    ),
    batches: int = typer.Option(8, "--batches", "-k", help="Global batches to write.", min=1, max=MAX_BATCHES),
    max_len: int = typer.Option(
        32768, "--max-len", "-L", help="Longest sequence; longer documents follow --overlong.", min=1, max=MAX_LENGTH
    ),
    seed: int = typer.Option(0, "--seed", "-s", help="Shuffle seed.", min=0, max=MAX_SEED),
    overlong: str = typer.Option(
        "split", "--overlong", help="Documents longer than --max-len: split, truncate or drop ([data] overlong)."
    ),
    tokenizer: str = TokenizerOption,
    name: str = typer.Option(None, "--name", help="Workload name (default: CORPUS-T-L-sSEED)."),
) -> None:
    """Sample global batches of a real corpus with the token-budget sampler and write their lengths."""
    from hydraulis.data.builtin import resolve_corpus
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.data.workload import Workload, save_workload
    from hydraulis.files import check_output

    check_output(out, "--out")
    c = resolve_corpus(corpus, tokenizer, progress=True)
    sampler = TokenBudgetSampler(c.lengths, tokens_per_batch, max_len=max_len, seed=seed, policy=check_policy(overlong))
    drawn = sampler.batches(batches)
    label = name or f"{c.name}-{tokens_per_batch}-{max_len}-s{seed}"
    save_workload(out, Workload(label, tuple(b.lengths for b in drawn)))
    sizes = [len(b) for b in drawn]
    console.print(
        f"wrote {out}: {batches} batches of about {tokens_per_batch:,} tokens from {c.name} "
        f"({min(sizes)}-{max(sizes)} sequences each, ends at epoch {sampler.state.epoch} "
        f"position {sampler.state.position})"
    )
