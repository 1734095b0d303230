"""`hydraulis train`'s refusals name a fix that exists: the config key (and file) it came from, only ways the
config does not already take, and they come before anything is built."""

from __future__ import annotations

import re
import string
from pathlib import Path

import numpy as np
import pytest

from hydraulis.cost import PRESETS, load_cost_model
from hydraulis.data.build.corpus import build_corpus
from hydraulis.training.config import RunConfig, load_config
from hydraulis.training.job import crowded_ways
from hydraulis.training.job_config import DataChoice, ParallelChoice

pytest.importorskip("torch")

from train_helpers import write_config  # noqa: E402

# tiny@cpu-measured in fp32 at 26 MiB per rank on 2 GPUs: tp2pp1 holds 1,792 tokens alone, tp1pp2 1,920 alone
# (`hydraulis caps`), so two sequences of 1,920 in one batch fit only one tp1pp2 replica's lone micro-batch.
CROWDED = 'pool = "auto"\nprofile = "tiny@cpu-measured"\nmemory_per_rank = "26MiB"'


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(1)
    letters = list(string.ascii_lowercase + " ")
    docs = ["".join(rng.choice(letters, size=int(n))) for n in [*rng.integers(80, 700, size=20), *[1910] * 20]]
    out = tmp_path_factory.mktemp("long-docs") / "docs"
    build_corpus(docs, out, "bytes", "long documents", name="docs")
    return out


def refusal(cli, config: Path, tmp_path: Path) -> str:
    result = cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "out").exists()
    return result.stderr.strip()


def named_keys(line: str) -> set[str]:
    """The `section.key` names a message gives."""
    return set(re.findall(r"\b((?:data|model|parallel|optim|train|eval)\.[a-z_]+)\b", line))


def exists(key: str) -> bool:
    section, name = key.split(".")
    return name in type(getattr(RunConfig(), section)).model_fields


def test_sequences_only_a_lone_micro_batch_holds_name_the_config_keys_it_does_not_already_say(
    long_docs, tmp_path, cli
):
    data = f'corpus = "{long_docs}"\ntokens_per_batch = 4096\nmax_len = 1920\nseed = 2\ntokenizer = "bytes"'
    config = write_config(tmp_path / "run.toml", long_docs, data=data, parallel=CROWDED, train="steps = 2")
    line = refusal(cli, config, tmp_path)
    assert "only as a replica's lone micro-batch" in line and "--overlong" not in line, line  # no such flag
    keys = named_keys(line)
    assert keys and all(exists(k) for k in keys), keys
    assert {"data.max_len", "data.tokens_per_batch", "parallel.memory_per_rank", "parallel.recompute"} <= keys
    assert "(now 1920)" in line and "(now 26MiB)" in line and "--nproc" in line
    # with recompute = true (which trains this config: tp1pp2 then holds both) it is not named again
    values = load_config(config).resolved_values()
    recomputing = ParallelChoice.of({**values["parallel"], "recompute": True})
    assert not any("recompute" in way for way in crowded_ways(DataChoice.of(values["data"]), recomputing))


def test_a_missing_eval_corpus_names_its_key_before_the_training_corpus_is_built(tmp_path, cli):
    source = tmp_path / "mine.jsonl"
    source.write_text("".join(f'{{"text": "document {i} {"words " * i}"}}\n' for i in range(40)))
    config = write_config(tmp_path / "run.toml", source, eval='corpus = "no-such-eval.jsonl"')
    line = refusal(cli, config, tmp_path)
    assert line.startswith(f"error: {config}: eval.corpus = 'no-such-eval.jsonl': ") and exists("eval.corpus"), line
    cache = Path(__import__("os").environ["HYDRAULIS_CACHE"])
    assert not list(cache.glob("sources/mine-*")), "the training corpus was built before the refusal"


@pytest.mark.parametrize(("pool", "says"), [
    ("autp", "neither \"auto\", a pool file that exists, nor deployments"),
    ("2x(tp1,pq1)", "cannot parse deployment item '2x(tp1,pq1)';"),  # the item once, not repeated
])  # fmt: skip
def test_a_pool_typo_names_the_key_and_the_file(pool, says, tmp_path, cli, corpus):
    config = write_config(tmp_path / "run.toml", corpus, parallel=f'pool = "{pool}"\nprofile = "tiny@cpu"')
    line = refusal(cli, config, tmp_path)
    assert line.startswith(f"error: {config}: parallel.pool") and says in line, line
    if "auto" in line:  # the ways it names are ones the config takes
        ok = write_config(tmp_path / "ok.toml", corpus, parallel='pool = "auto"\nprofile = "tiny@cpu"')
        assert load_config(ok).parallel.pool == "auto"


def test_a_profile_typo_names_the_closest_preset_and_every_kind(tmp_path, cli, corpus):
    config = write_config(tmp_path / "run.toml", corpus, parallel='pool = "auto"\nprofile = "tiny@cpu-measure"')
    line = refusal(cli, config, tmp_path)
    assert line.startswith(f"error: {config}: parallel.profile: unknown profile 'tiny@cpu-measure'"), line
    assert "the closest preset is 'tiny@cpu-measured'" in line and all(p in line for p in PRESETS)
    load_cost_model("tiny@cpu-measured")  # the preset it names exists
    assert '"auto"' in line
