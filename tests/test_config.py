"""The run config (config.py): defaults written once, one-line errors, a resolved config that round-trips."""

from __future__ import annotations

import tomllib

import pytest

from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings, OptimSettings
from hydraulis.specs import MODELS
from hydraulis.training.checkpoints import DEFAULT_KEEP
from hydraulis.training.config import RunConfig, load_config, parse_config


def test_defaults_come_from_the_settings_records():
    config = RunConfig()
    assert config.optim.settings() == OptimSettings()  # lr, warmup, schedule, min_lr_ratio and AdamW's settings
    assert config.optim.settings().adamw == AdamWSettings()
    assert config.train.keep_checkpoints == DEFAULT_KEEP


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


def test_a_mixture_round_trips_and_names_its_corpora():
    config = parse_config({"data": {"corpus": ["python-stdlib", "bbc-news"], "weights": [4, 1]}})
    assert config.data.corpora == ["python-stdlib", "bbc-news"]
    again = parse_config(tomllib.loads(config.with_absolute_paths().to_toml()))
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
