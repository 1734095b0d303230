"""Checkpoint directories without torch: retention never rotates away what a newer save has not replaced,
and sweeping an unfinished replacement puts the only copy back."""

from __future__ import annotations

from pathlib import Path

from hydraulis.checkpoints.manifest import MANIFEST_FILE, list_checkpoints, prune, step_dir_name, sweep_temporary


def make(out: Path, step: int) -> Path:
    p = out / step_dir_name(step)
    p.mkdir(parents=True)
    (p / MANIFEST_FILE).write_text("{}")
    return p


def test_prune_keeps_the_newest_at_or_before_the_new_checkpoint(tmp_path):
    for step in (2, 4, 6, 8):  # 6 and 8: left by a run that a resume from step 4 abandoned
        make(tmp_path, step)
    new = tmp_path / step_dir_name(5)
    new.mkdir()
    (new / MANIFEST_FILE).write_text("{}")
    prune(tmp_path, keep=2, spare=new)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 6, 8]
    prune(tmp_path, keep=1, spare=new)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 6, 8]


def test_sweeping_an_unfinished_replacement_restores_the_only_copy(tmp_path):
    old = tmp_path / ".step-000004.x1y2.old"
    kept = make(old, 4)  # the save moved step-4 aside, then died before its new step-4 was in place
    (kept / "rng-00000.json").write_text("{}")
    tmp = tmp_path / ".step-000004.tmp"
    tmp.mkdir()
    lines: list[str] = []
    sweep_temporary(tmp_path, log=lines.append)
    assert (tmp_path / "step-000004" / "rng-00000.json").is_file()
    assert not old.exists() and not tmp.exists()
    assert any("restored" in line for line in lines)


def test_a_key_added_after_a_run_was_saved_is_no_change_at_its_default():
    """A run saved before `[parallel] interleave` existed resumes: its config.toml lacks the key, which reads as
    its default; a real change of it, or of a deciding key, is still named."""
    from hydraulis.checkpoints.resume import config_changes
    from hydraulis.training.config import RunConfig

    defaults = RunConfig().model_dump()
    new = {"parallel": {"interleave": True, "pool": "auto"}, "data": {"seed": 1}}
    old = {"parallel": {"pool": "auto"}, "data": {"seed": 1}}
    assert config_changes(old, new, defaults) == ([], [])
    assert config_changes(old, new) == (["parallel.interleave (unset -> True)"], [])
    turned_off = {"parallel": {"interleave": False, "pool": "auto"}, "data": {"seed": 2}}
    assert config_changes(old, turned_off, defaults) == (
        ["data.seed (1 -> 2)", "parallel.interleave (True -> False)"], [],
    )
