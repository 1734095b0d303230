"""A small byte-level corpus and run configs for the `hydraulis train` tests."""

from __future__ import annotations

import contextlib
import json
import string
from pathlib import Path

import numpy as np

from hydraulis.data.build.corpus import build_corpus

BASE = {
    "model": 'preset = "tiny"',
    "data": 'tokens_per_batch = 768\nmax_len = 256\nseed = 3\ntokenizer = "bytes"',
    "parallel": 'pool = "1x(tp2,pp1) + 2x(tp1,pp1); 2x(tp1,pp2); 4x(tp1,pp1)"\nprofile = "tiny@cpu"',
    "optim": "lr = 3e-3\nwarmup = 2",
    "train": "steps = 6\nlog_every = 2",
}


def make_corpus(out: Path) -> Path:
    """A small byte-level corpus of documents of very different lengths."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list(string.ascii_lowercase), size=int(n))) for n in rng.integers(2, 9, size=300)]
    docs = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(3, 90, size=120)]
    build_corpus(docs, out, "bytes", "test documents", name="docs")
    return out


def make_sft_records(out: Path) -> Path:
    """A jsonl file of 80 prompt/completion records (sums), another kind of source than make_corpus's: SFT,
    built by `hydraulis train` itself, whose targets are the completions only."""
    rng = np.random.default_rng(1)
    pairs = rng.integers(1, 999, size=(80, 2))
    out.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}? Think it over. ", "completion": f"{a + b}."})
                           + "\n" for a, b in pairs.tolist()))  # fmt: skip
    return out


def write_config(path: Path, corpus: Path, **overrides: str) -> Path:
    sections = dict(BASE)
    sections["data"] = f'corpus = "{corpus}"\n' + sections["data"]
    sections.update(overrides)
    path.write_text("\n".join(f"[{k}]\n{v}\n" for k, v in sections.items()))
    return path


def metric_rows(out: Path, running: bool = False) -> list[dict]:
    """A run's metrics.jsonl: one row per step, then `{"summary": ...}` once the run has finished.

    `running`: the run may still be writing, so no file yet means no rows, and a line being written is skipped.
    """
    path = out / "metrics.jsonl"
    if running and not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError) if running else contextlib.nullcontext():
            rows.append(json.loads(line))
    return rows


def step_rows(out: Path, running: bool = False) -> list[dict]:
    """The step rows of a run's metrics.jsonl (every row but the summary)."""
    return [r for r in metric_rows(out, running) if "step" in r]


def run_summary(out: Path) -> dict:
    """The summary row of a finished run's metrics.jsonl."""
    return metric_rows(out)[-1]["summary"]


def tensorboard_of(out: Path) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """A run's TensorBoard events (`tb/`): each scalar tag's values by step, and the deployment text by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("deployment/text_summary")}
    return scalars, texts


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(out) if "loss" in r]


def hf_loss(model, docs: list[np.ndarray]) -> float:
    """transformers on each document alone: summed token cross-entropy over all documents / their targets."""
    import torch
    import torch.nn.functional as F

    from hydraulis.runtime import count_targets

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for d in docs:
            ids = torch.from_numpy(np.asarray(d, dtype=np.int64))[None]
            logits = model(ids).logits[0]
            total += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").double()
    return float(total) / count_targets([len(d) for d in docs])
