"""Training-side hostile input through the real command: each is one line, exit 2 (or 130/143), nothing partial.

Bad configs, flags, damaged checkpoints, run directories given where a
checkpoint is expected, and signals. (More of them, with their own checks,
are in test_cli_train.py, test_cli_train_faults.py, test_cli_train_integrity.py,
test_cli_train_resume.py and test_cli_train_divergence.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cli_helpers import start_cli  # noqa: E402
from train_helpers import make_corpus, write_config  # noqa: E402

pytestmark = pytest.mark.dist

ONE = {"parallel": 'pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"'}
TWO = {"parallel": 'pool = "2x(tp1,pp1); 1x(tp2,pp1)"\nprofile = "tiny@cpu"'}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, session_cli) -> tuple[Path, Path, Path]:
    """A corpus, a config and a finished 2-step one-process run with checkpoints at steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("hostile")
    corpus = make_corpus(tmp / "docs")
    config = write_config(tmp / "run.toml", corpus, train="steps = 2\ncheckpoint_every = 1", **ONE)
    result = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "run"))
    assert result.returncode == 0, result.stderr
    return corpus, config, tmp / "run"


def snapshot(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}  # fmt: skip


def one_line(result, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# (config sections to change, extra arguments, what the one line must say)
CONFIGS = {
    "lr as a string": ({"optim": 'lr = "3e-3"'}, (), "optim.lr: expected a number, not a str"),
    "steps as a bool": ({"train": "steps = true"}, (), "train.steps: expected a number, not a bool"),
    "betas as strings": ({"optim": 'betas = ["0.9", "0.95"]'}, (), "optim.betas: expected a number"),
    "max_bad_steps zero": ({"train": "max_bad_steps = 0"}, (), "train.max_bad_steps"),
    "keep_checkpoints fractional": ({"train": "keep_checkpoints = 1.5"}, (), "train.keep_checkpoints"),
    "stop-at past the schedule": ({}, ("--stop-at", "3"), "--stop-at 3 is outside the schedule's 1..2"),
    "stop-at negative": ({}, ("--stop-at", "-1"), "--stop-at -1 is outside"),
    "change-schedule on a new run": ({}, ("--change-schedule",), "--change-schedule needs --resume"),
    "resume of an empty directory": ({}, ("--resume",), "holds no run to resume"),
    "steps zero": ({}, ("--steps", "0"), "--steps must be positive"),
    "nproc zero": ({}, ("--nproc", "0"), "--nproc must be positive"),
    "eval from two sources": ({"eval": 'holdout = 0.1\ncorpus = "x"'}, (), "give holdout or corpus, not both"),
    "eval holding out everything": ({"eval": "holdout = 1.0"}, (), "eval.holdout"),
    "eval corpus missing": ({"eval": 'corpus = "/nonexistent/corpus"'}, (), "/nonexistent/corpus"),
    "max-restarts negative": ({}, ("--max-restarts", "-1"), "--max-restarts must be non-negative"),
    "pool with an unclosed parenthesis": (
        {"parallel": 'pool = "1x(tp2,pp1 + 2x(tp1,pp1); 4x(tp1,pp1)"\nprofile = "tiny@cpu"'},
        ("--nproc", "4"),
        "parallel.pool: cannot parse deployment item '1x(tp2,pp1' in '1x(tp2,pp1 + 2x(tp1,pp1)' (unbalanced",
    ),
    "pool with trailing garbage": (
        {"parallel": 'pool = "4x(tp1,pp1) 2x"\nprofile = "tiny@cpu"'}, ("--nproc", "4"), "'4x(tp1,pp1) 2x'",
    ),
    "overlong with a proposed pool": (
        {"data": 'tokens_per_batch = 2000000\nmax_len = 1500000\ntokenizer = "bytes"',
         "parallel": 'pool = "auto"\nprofile = "tiny@cpu"'},
        ("--nproc", "2"),
        "lower [data] max_len ([data] overlong cuts longer documents)",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_configs_and_flags(case, base, tmp_path, cli):
    corpus, _, _ = base
    change, args, expected = CONFIGS[case]
    change = dict(ONE, **change)
    if "data" in change:
        change["data"] = f'corpus = "{corpus}"\n' + change["data"]
    config = write_config(tmp_path / "bad.toml", corpus, **{"train": "steps = 2", **change})
    out = tmp_path / "out"
    if "--resume" in args:
        out.mkdir()
    nproc = () if "--nproc" in args else ("--nproc", "1")
    line = one_line(cli("train", "--config", str(config), *nproc, "--out", str(out), *args))
    assert expected in line, line
    assert "--overlong" not in line
    assert snapshot(out) == ({} if "--resume" not in args else {})


@pytest.mark.parametrize("key", ["init_from", "corpus"])
def test_relative_paths_are_read_from_the_current_directory(key, base, tmp_path, cli):
    """Relative paths in a config are relative to the current directory (as in torchtitan, axolotl and
    LLaMA-Factory), not to the config's: run from elsewhere, the one line names the absolute path tried."""
    corpus, _, _ = base
    model = {"model": 'init_from = "models/tiny"'} if key == "init_from" else {}
    config = write_config(tmp_path / "run.toml", Path("data/docs") if key == "corpus" else corpus, **ONE, **model)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    line = one_line(cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "o"), cwd=elsewhere))
    tried = elsewhere / ("models/tiny/config.json" if key == "init_from" else "data/docs")
    given = f"{config}: data.corpus = 'data/docs': " if key == "corpus" else ""  # the key and file it came from
    assert line.startswith(f"error: {given}{tried}: no such file"), line
    assert line.endswith("a relative path is read from the current directory"), line


def damage_newest_manifest(run: Path) -> None:
    (run / "checkpoints" / "step-000002" / "manifest.json").write_text('{"schema": "hydraulis.checkpoint/1", "st')


def damage_all(run: Path) -> None:
    for step in ("step-000001", "step-000002"):
        (run / "checkpoints" / step / "rng-00000.json").write_text("{}")


def other_model(config: Path) -> Path:
    text = config.read_text().replace('preset = "tiny"', "layers = 1\nhidden = 64\nffn = 128\nheads = 4\nvocab = 512")
    text = text.replace('profile = "tiny@cpu"', 'profile = "@cpu"')  # the analytic model of this shape
    config.write_text(text)
    return config


# A run directory to damage, and what the resume must say (None: it falls back and succeeds).
RUNS = {
    "every checkpoint damaged": (damage_all, None, "none of its 2 checkpoint(s) verifies"),
    "checkpoints directory is a file": (
        lambda run: (shutil.rmtree(run / "checkpoints"), (run / "checkpoints").write_text("x")),
        None,
        "checkpoints: not a directory",
    ),
    "another model than the checkpoint": (None, other_model, "checkpoint of model"),
}


@pytest.mark.parametrize("case", list(RUNS))
def test_damaged_runs_are_refused_and_left_alone(case, base, tmp_path, cli):
    _, config, run = base
    damage, change_config, expected = RUNS[case]
    out = tmp_path / "run"
    shutil.copytree(run, out)
    config = Path(shutil.copy(config, tmp_path / "run.toml"))
    if damage:
        damage(out)
    meant = ()
    if change_config:
        change_config(config)
        # without --change-config the config's comparison refuses first (naming model.*); with it, the checkpoint
        line = one_line(cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume"))
        assert "would change model." in line and "--change-config" in line, line
        meant = ("--change-config",)
    before = snapshot(out)
    line = one_line(cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume", *meant))
    assert expected in line, line
    after = snapshot(out)
    if meant:  # refused by a rank, once the run had started: its log (train.log) says why, nothing else changed
        assert (out / "train.log").read_text().splitlines()[-1] == line
        before.pop("train.log"), after.pop("train.log")
    assert after == before


def test_a_damaged_newest_manifest_falls_back(base, tmp_path, cli):
    _, config, run = base
    out = tmp_path / "run"
    shutil.copytree(run, out)
    damage_newest_manifest(out)
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume")
    assert result.returncode == 0, result.stderr
    assert "skipping 1 damaged checkpoint(s)" in result.stdout and "resuming at step 1" in result.stdout


def test_export_of_a_run_directory_takes_its_newest_complete_checkpoint(base, tmp_path, cli):
    _, _, run = base
    for given in (run, run / "checkpoints"):
        done = cli("export", "--checkpoint", str(given), "--out", str(tmp_path / given.name))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"exporting {run / 'checkpoints' / 'step-000002'}, the newest complete"), done
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    damage_newest_manifest(damaged)
    before = snapshot(damaged)
    done = cli("export", "--checkpoint", str(damaged), "--out", str(tmp_path / "older"))
    assert done.returncode == 0 and f"exporting {damaged / 'checkpoints' / 'step-000001'}" in done.stdout, done
    assert snapshot(damaged) == before  # nothing swept or changed: an export only reads


def test_export_of_a_run_without_a_checkpoint_yet_says_so_and_what_to_do(base, tmp_path, cli):
    _, _, run = base
    young = tmp_path / "young"
    shutil.copytree(run, young)
    shutil.rmtree(young / "checkpoints")
    (young / "checkpoints").mkdir()
    line = one_line(cli("export", "--checkpoint", str(young), "--out", str(tmp_path / "hf")))
    assert line.startswith(f"error: {young}: the run has no checkpoint yet"), line
    assert "checkpoint_every" in (young / "config.toml").read_text()  # the key it names is the run's
    command = line.split("`")[1].split()  # the command it names, and its flags, exist
    assert command[:2] == ["hydraulis", "train"] and Path(command[command.index("--config") + 1]).is_file()
    flags = cli("train", "--help").stdout
    assert all(f in flags for f in ("--config", "--out", "--resume", "--stop-at"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("glob", ["/etc/*", "../*", "**a"])
def test_data_build_glob_outside_or_malformed(glob, tmp_path, cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello world")
    out = tmp_path / "corpus"
    line = one_line(cli("data", "build", str(tmp_path / "src"), "--glob", glob, "--out", str(out), "-t", "bytes"))
    assert f"--glob {glob!r}" in line and not out.exists()


@pytest.mark.parametrize(("event", "sig"), [("metrics.jsonl", signal.SIGINT), ("config.toml", signal.SIGTERM)])
def test_a_signal_stops_cleanly_and_is_named(event, sig, base, tmp_path):
    """Ctrl-C during training, or SIGTERM while the ranks start (rank 0 has begun its run directory): both
    stop at a step boundary, save, name the signal and exit 0."""
    corpus, _, _ = base
    config = write_config(tmp_path / "run.toml", corpus, train="steps = 400\nlog_every = 1", **TWO)
    out = tmp_path / "out"
    proc = start_cli("train", "--config", str(config), "--nproc", "2", "--out", str(out))
    deadline = time.monotonic() + 120
    while not (out / event).is_file() or not (out / event).read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    other = "SIGTERM" if sig == signal.SIGINT else "SIGINT"
    assert f"stopped by {sig.name} at step" in stdout and other not in stdout, stdout
    assert "Traceback" not in stderr and list((out / "checkpoints").iterdir()), stderr


def wait_for_line(proc, text: str, timeout: float = 120) -> list[str]:
    """Read the command's stdout until a line holds `text` (the lines so far)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return seen
        assert time.monotonic() < deadline, seen
    raise AssertionError(f"the command ended before saying {text!r}: {seen}")


@pytest.mark.parametrize("after", ["profiling tiny", "profiled in"])
def test_sigterm_while_profiling_says_what_it_leaves(after, base, tmp_path, monkeypatch):
    """SIGTERM once profiling has begun or ended: whenever it lands, what the command says is what is on disk.

    Profiling may finish before the signal arrives (a fast machine); then the finished profile stays, in the
    cache and in --out, and the line names both (in --out alone where it was measured under load: the cache
    keeps only quiet profiles). Otherwise nothing was written and the line says so.
    """
    corpus, _, _ = base
    cache = tmp_path / "cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    config = write_config(tmp_path / "run.toml", corpus, parallel='pool = "2x(tp1,pp1)"\nprofile = "auto"')
    out = tmp_path / "out"
    proc = start_cli("train", "--config", str(config), "--nproc", "2", "--out", str(out))
    seen = wait_for_line(proc, after)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    stdout = "".join(seen) + stdout  # what the command said before the signal too ("profiled in ... (kept ...)")
    if proc.returncode == 0:  # the ranks had started: they took the signal at their first step, saved, said so
        assert "stopped by SIGTERM at step 1; continue with --resume" in stdout, stdout
        assert (out / "checkpoints" / "step-000001").is_dir() and "Traceback" not in stderr, stderr
        return
    assert proc.returncode in (2, 143), (proc.returncode, stderr)
    # Profiling reports its progress as it goes (how far it got depends on the machine); then one error line.
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("profiling: ")]
    assert len(lines) == 1 and lines[0].startswith(("error: ", "interrupted")) and "Traceback" not in stderr, stderr
    assert "SIGTERM" in lines[0], lines
    profiles = sorted(cache.rglob("*.json"))
    if not out.exists() and not profiles:
        assert lines[0].endswith("nothing was written"), lines
        return
    kept_in_out = f"{out / 'profile.json'} (a run into the same --out uses it)"
    if out.exists() and not profiles:  # measured under load: the shared cache keeps only quiet profiles
        from hydraulis.cost.measured import measured_under_load

        assert "(kept for this run only: measured under load, the cache keeps only quiet profiles)" in stdout
        assert measured_under_load(json.loads((out / "profile.json").read_text())), lines
        assert kept_in_out in lines[0] and "cache" not in lines[0], lines
        return
    assert len(profiles) == 1 and f"kept the measured profile in {profiles[0]}" in lines[0], (profiles, lines)
    if out.exists():  # the job had copied it into --out too, and maybe begun the run's log there
        names = sorted(p.name for p in out.iterdir())
        assert names in (["profile.json"], ["profile.json", "train.log"]) and kept_in_out in lines[0], (names, lines)
        assert (f"{out / 'train.log'} (the run's log)" in lines[0]) == ("train.log" in names), (names, lines)
    else:
        assert str(out) not in lines[0], lines


def test_a_second_ctrl_c_stops_at_once_and_publishes_nothing_partial(base, tmp_path):
    corpus, _, _ = base
    config = write_config(tmp_path / "run.toml", corpus, train="steps = 400\ncheckpoint_every = 1", **TWO)
    out = tmp_path / "out"
    proc = start_cli("train", "--config", str(config), "--nproc", "2", "--out", str(out))
    wait_for_line(proc, "step    1")
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, "SIGINT passed on to the ranks")  # the first one was handled: this one is the second
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "SIGINT" in lines[0] and "Traceback" not in stderr, stderr
    from hydraulis.checkpoints.manifest import list_checkpoints, verify_checkpoint

    for _, path in list_checkpoints(out / "checkpoints"):  # every published checkpoint is whole
        verify_checkpoint(path)
