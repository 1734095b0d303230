"""The run config (config.py): defaults written once, one-line errors, a resolved config that round-trips."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings, OptimSettings
from hydraulis.settings import DEFAULT_KEEP
from hydraulis.specs import MODELS
from hydraulis.training.config import RunConfig, default_text, load_config, parse_config, start_notes, toml_text


def test_defaults_come_from_the_settings_records():
    config = RunConfig()
    assert config.optim.settings() == OptimSettings()  # lr, warmup, schedule, min_lr_ratio and AdamW's settings
    assert config.optim.settings().adamw == AdamWSettings()
    assert config.train.keep_checkpoints == DEFAULT_KEEP


def test_max_pool_has_one_default_for_a_config_and_propose(cli):
    import inspect

    from hydraulis.cli.propose import propose as command
    from hydraulis.planner.proposal.propose import propose

    default = RunConfig().parallel.max_pool
    assert default == inspect.signature(propose).parameters["max_pool"].default
    assert default == inspect.signature(command).parameters["max_pool"].default.default  # typer's OptionInfo
    assert f"Most deployments in the pool.  [default: {default};" in cli("propose", "--help").stdout


def test_optim_section_builds_its_settings():
    config = parse_config({"optim": {"lr": 1e-3, "warmup": 3, "schedule": "linear", "betas": [0.8, 0.9], "eps": 1e-6}})
    settings = config.optim.settings()
    assert (settings.lr, settings.warmup, settings.schedule) == (1e-3, 3, "linear")
    assert settings.adamw.betas == (0.8, 0.9) and settings.adamw.eps == 1e-6


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"optim": {"lr": 0}}, "optim.lr"),
        ({"optim": {"schedule": "step"}}, "optim.schedule"),
        ({"train": {"dtype": "fp16"}}, "train.dtype"),
        ({"optim": {"betas": [0.9, 1.0]}}, "each beta must lie in [0, 1)"),
        ({"data": {"max_len": 4096, "tokens_per_batch": 1024}}, "max_len 4096 is above tokens_per_batch"),
        ({"model": {"preset": "nope"}}, "unknown model preset"),
        ({"trian": {}}, "unknown key 'trian'"),
        ({"train": {"stpes": 3}}, "unknown key 'train.stpes'"),
        ({"data": {"corpus": ["a", "b"], "weights": [0.8]}}, "give data.weights, one per corpus"),
        ({"data": {"corpus": ["a", "b"]}}, "give data.weights, one per corpus"),
        ({"data": {"corpus": "a", "weights": [1.0]}}, "weights are for a mixture"),
        ({"data": {"corpus": ["a", "b"], "weights": [0.8, 0]}}, "data.weights must be positive"),
        ({"data": {"corpus": ["a", "a"], "weights": [1, 1]}}, "different corpora"),
        ({"data": {"corpus": ["a", "b"], "weights": ["0.8", 1]}}, "expected a number"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(data, needle):
    with pytest.raises(HydraulisError) as info:
        parse_config(data, "run.toml")
    message = str(info.value)
    assert message.startswith("run.toml: ") and needle in message and "\n" not in message


def test_model_section_fills_a_preset_and_needs_every_field_without_one():
    assert parse_config({"model": {"preset": "tiny"}}).model.spec() == MODELS["tiny"]
    custom = parse_config({"model": {"preset": "tiny", "layers": 3}}).model.spec()
    assert custom.name == "custom" and custom.layers == 3 and custom.same_shape(MODELS["tiny"]) is False
    with pytest.raises(HydraulisError, match="without a preset, give"):
        parse_config({"model": {"preset": None, "hidden": 64}}).model.spec()


def test_to_toml_round_trips(tmp_path):
    config = parse_config({"model": {"preset": "tiny"}, "optim": {"lr": 2e-3}, "parallel": {"recompute": ["tp1pp1"]}})
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config
    assert tomllib.loads(config.to_toml())["optim"]["lr"] == 2e-3


def test_every_key_is_written_even_unset_ones(tmp_path):
    """config.toml names every key: an unset one as a comment saying what unset means (TOML has no null)."""
    text = RunConfig().to_toml()
    for field in RunConfig.model_fields.values():
        for key in field.annotation.model_fields:
            assert re.search(rf"^(# )?{key}[ :]", text, re.M), key
    assert "# memory_per_rank: unset, the device's own memory" in text
    assert "# gpus_per_node: unset, torchrun's LOCAL_WORLD_SIZE" in text
    assert "memory_per_rank" not in tomllib.loads(text)["parallel"]


def test_the_reference_gives_every_key_with_its_default():
    """The reference's key table (docs/reference.md) against config.py, where each default is written once."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    rows = {}
    for line in readme.splitlines():
        row = re.match(r"\| `\[(\w+)\] (\w+)`((?:, `\w+`)*) \| ([^|]+) \|", line)
        if row:
            for key in [row[2], *re.findall(r"`(\w+)`", row[3])]:
                rows[(row[1], key)] = row[4].strip()
    keys = {(s, k) for s, f in RunConfig.model_fields.items() for k in f.annotation.model_fields}
    assert set(rows) == keys
    for section, key in keys:
        text = default_text(section, key)
        assert rows[section, key] == (text if text.startswith("unset") else f"`{text}`"), (section, key)


def test_a_run_starts_with_a_line_where_a_default_matters():
    notes = start_notes(RunConfig(), 100)  # profile "tiny@cpu" by default: analytic
    assert len(notes) == 1 and '"tiny@cpu" (the default) is the analytic model' in notes[0] and '"auto"' in notes[0]
    given = parse_config({"parallel": {"profile": "@cpu"}, "optim": {"warmup": 10, "lr": 1e-3}})
    notes = start_notes(given, 2)
    assert "(the default)" not in notes[0]
    assert notes[1].startswith("warning: [optim] warmup = 10 is longer than the run's 2 steps") and "0.0002" in notes[1]
    measured = parse_config({"parallel": {"profile": "tiny@cpu-measured"}})
    assert start_notes(measured, 10) == []  # a measured preset, warmup 10 within 10 steps: nothing to say


def test_a_mixture_round_trips_and_names_its_corpora():
    config = parse_config({"data": {"corpus": ["python-stdlib", "bbc-news"], "weights": [4, 1]}})
    assert config.data.corpora == ["python-stdlib", "bbc-news"]
    again = parse_config(tomllib.loads(toml_text(config.resolved_values())))
    assert again.data.corpus == ["python-stdlib", "bbc-news"] and again.data.weights == [4.0, 1.0]
    assert parse_config({}).data.corpora == ["python-stdlib"]


def test_the_mixture_example_is_a_valid_config_of_built_in_corpora():
    from pathlib import Path

    from hydraulis.data.builtin import BUILTINS

    config = load_config(Path(__file__).resolve().parents[1] / "examples" / "mixture.toml")
    assert len(config.data.corpora) == 2 and set(config.data.corpora) <= set(BUILTINS)
    assert config.data.weights == [0.7, 0.3] and config.eval.holdout > 0


def test_load_config_names_the_file(tmp_path):
    with pytest.raises(HydraulisError, match="no such config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(HydraulisError, match="not valid TOML"):
        load_config(bad)
