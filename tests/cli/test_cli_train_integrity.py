"""`hydraulis train --resume` over damaged checkpoints, through the real command: one rule for every damage."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from train_helpers import losses, make_corpus, step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

ONE = {"parallel": 'pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"'}
SAVED = {"train": "steps = 4\ncheckpoint_every = 2\nlog_every = 2"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, session_cli) -> tuple[Path, Path]:
    """A finished 4-step run with checkpoints at steps 2 and 4 (one process: no spawn)."""
    tmp = tmp_path_factory.mktemp("integrity")
    corpus = make_corpus(tmp / "docs")
    config = write_config(tmp / "run.toml", corpus, **ONE, **SAVED)
    result = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "out"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp / "out" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return config, tmp / "out"


def copy_run(saved: tuple[Path, Path], to: Path) -> Path:
    shutil.copytree(saved[1], to)
    return to


def flip_byte(path: Path) -> None:
    """Same size, one byte changed: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under root with its size and sha256 (and every directory): to prove nothing changed."""
    out: dict[str, tuple[int, str]] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) if p.is_file() else (-1, "dir")
    return out


def steps_in(out: Path) -> list[int]:
    return [r["step"] for r in step_rows(out)]


def test_newest_byte_flipped_falls_back_without_a_duplicate_step(saved, tmp_path, cli):
    config, whole = saved
    out = copy_run(saved, tmp_path / "out")
    flip_byte(out / "checkpoints" / "step-000004" / "optimizer" / "__0_0.distcp")
    more = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume")
    assert more.returncode == 0, more.stderr
    skipped = [line for line in more.stdout.splitlines() if "damaged checkpoint" in line]
    assert len(skipped) == 1 and "step-000004" in skipped[0] and "checksum" in skipped[0], more.stdout
    assert "resuming at step 2" in more.stdout
    assert steps_in(out) == [0, 1, 2, 3]  # steps 2 and 3 were redone, not appended again
    assert losses(out) == losses(whole)  # and redone bit for bit
    old = out / "metrics.jsonl.before-step-2"
    assert old.read_text() == (whole / "metrics.jsonl").read_text()  # the cut file is kept
    # The damaged step-4 was replaced by a newly saved, verifying one.
    assert (out / "checkpoints" / "step-000004" / "manifest.json").is_file()
    again = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume")
    assert again.returncode == 0 and "resuming at step 4" in again.stdout, again.stderr
    assert "damaged" not in again.stdout


@pytest.mark.parametrize("damage", ["flip+truncate", "missing+no-manifest"])
def test_all_checkpoints_damaged_is_refused_and_nothing_changes(saved, tmp_path, cli, damage):
    config, _ = saved
    out = copy_run(saved, tmp_path / "out")
    ckpt = out / "checkpoints"
    (ckpt / ".step-000006.tmp" / "optimizer").mkdir(parents=True)  # an unfinished save is not swept either
    if damage == "flip+truncate":
        flip_byte(ckpt / "step-000004" / "rng-00000.json")
        with (ckpt / "step-000002" / "optimizer" / "__0_0.distcp").open("r+b") as fh:
            fh.truncate(100)
    else:
        (ckpt / "step-000004" / "optimizer" / "__0_0.distcp").unlink()
        (ckpt / "step-000002" / "manifest.json").unlink()
    before = snapshot(out)
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "none of its 2 checkpoint(s) verifies" in lines[0] and "step-000002" in lines[0], lines[0]
    assert "step-000004" in lines[0] and "Traceback" not in result.stderr
    assert snapshot(out) == before
