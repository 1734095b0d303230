"""Hostile input through the real command: one line and exit 2, nothing left behind, bounded work.

Each class of the tracker's hostile-input run has cases here: output paths,
numbers beyond range, input that must be refused, unbounded work, interruption,
partial output on error, and typer's own argument errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import one_line_error, start_cli, wait_for_handlers

from hydraulis.planner.plan import load_plan

PROFILE = Path(__file__).resolve().parents[2] / "src" / "hydraulis" / "cost" / "profiles" / "llama-7b-a800.json"


def tree(root: Path) -> set[str]:
    """Every entry under root, hidden ones included."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}



def workload(path: Path, **data) -> Path:
    path.write_text(json.dumps({"schema": "hydraulis.workload/1", **data}))
    return path


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return workload(tmp_path / "w.json", batches=[[100, 200, 3000, 400] * 4])


# -- output paths ---------------------------------------------------------------------------------


def _out_cases(tmp: Path, work: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "adir").mkdir()
    (tmp / "afile").write_text("x")
    long = "n" * 300 + ".json"
    return {
        "plan-out-dir": (["plan", "-n", "8", "-w", str(work), "-o", str(tmp / "adir")], "is a directory"),
        "plan-out-under-file": (["plan", "-n", "8", "-w", str(work), "-o", str(tmp / "afile" / "p.json")], "is a file"),
        "plan-out-too-long": (["plan", "-n", "8", "-w", str(work), "-o", str(tmp / long)], "305 bytes"),
        "propose-out-dir": (["propose", "-n", "8", "-w", str(work), "-o", str(tmp / "adir")], "is a directory"),
        "propose-out-too-long": (["propose", "-n", "8", "-w", str(work), "-o", str(tmp / "x" / long)], "bytes"),
        "workload-out-dir": (["workload", "-c", "python-stdlib", "-o", str(tmp / "adir")], "is a directory"),
        "workload-out-under-file": (["workload", "-c", "python-stdlib", "-o", str(tmp / "afile" / "w")], "is a file"),
        "bench-out-file": (["bench", "-s", "7b-16g-bbc-256k-8k", "-o", str(tmp / "afile")], "not a directory"),
        "bench-out-too-long": (["bench", "-s", "7b-16g-bbc-256k-8k", "-o", str(tmp / long)], "bytes"),
        "demo-out-file": (["demo", "-o", str(tmp / "afile")], "not a directory"),
        "demo-out-under-file": (["demo", "-o", str(tmp / "afile" / "d")], "is a file"),
        "simulate-timeline-dir": (["simulate", "--plan", str(work), "--timeline", str(tmp / "adir")], "is a directory"),
        "simulate-timeline-gif": (["simulate", "--plan", str(work), "--timeline", str(tmp / "t.gif")], "must end in"),
        "stats-plot-dir": (["data", "stats", "python-stdlib", "--plot", str(tmp / "adir")], "is a directory"),
        "stats-plot-txt": (["data", "stats", "python-stdlib", "--plot", str(tmp / "h.txt")], "must end in"),
    }


CASES = [
    "plan-out-dir",
    "plan-out-under-file",
    "plan-out-too-long",
    "propose-out-dir",
    "propose-out-too-long",
    "workload-out-dir",
    "workload-out-under-file",
    "bench-out-file",
    "bench-out-too-long",
    "demo-out-file",
    "demo-out-under-file",
    "simulate-timeline-dir",
    "simulate-timeline-gif",
    "stats-plot-dir",
    "stats-plot-txt",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_output_paths_are_refused_before_any_work(cli, tmp_path, work, case):
    args, needle = _out_cases(tmp_path, work)[case]
    before = tree(tmp_path)
    one_line_error(cli(*args), needle)
    assert tree(tmp_path) == before


def test_a_plot_path_that_is_a_directory_inside_the_bench_output(cli, tmp_path):
    out = tmp_path / "b"
    (out / "bench.png").mkdir(parents=True)
    one_line_error(cli("bench", "-s", "7b-16g-bbc-256k-8k", "-o", str(out)), "bench.png", "is a directory")
    assert tree(tmp_path) == {"b", "b/bench.png"}


def test_an_unwritable_directory_is_one_line(cli, tmp_path, work):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        one_line_error(cli("plan", "-n", "8", "-w", str(work), "-o", str(locked / "p.json")), "permission")
    finally:
        locked.chmod(0o700)


# -- numbers beyond range -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (dict(batches=[[100, 10**30]]), "between 1 and 2147483647"),
        (dict(batches=[[100, 2**31]]), "between 1 and 2147483647"),
        (dict(batches=[[100, 2**63 - 1]]), "between 1 and 2147483647"),
        (dict(batches=[[100, 1.5]]), "must be an integer"),
        (dict(lengths=[100, 200], counts=[1, float("nan")]), "NaN is not a number JSON allows"),
        (dict(lengths=[100, 200], counts=[1, float("inf")]), "Infinity is not a number JSON allows"),
        (dict(lengths=[100, 200], counts=[1, 1e308, 1e308]), "2 lengths but 3 counts"),
        (dict(lengths=[100, 200], counts=[1, 1], tokens_per_batch=10**20), "at most 4294967296"),
        (dict(lengths=[100, 200], counts=[1, 1], tokens_per_batch=2**70), "at most 4294967296"),
        (dict(lengths=[100, 200], counts=[1, 1], seed=-1), "at least 0"),
        (dict(lengths=[1], counts=[1], tokens_per_batch=2**32), "more than the 4,194,304 allowed"),
        (dict(lengths=[100, 200], counts=[1, 1], num_batches=1e30), "expected an integer"),
    ],
)
def test_workload_numbers_beyond_range(cli, tmp_path, data, needle):
    w = workload(tmp_path / "w.json", **data)
    before = tree(tmp_path)
    one_line_error(cli("plan", "-n", "8", "-w", str(w), "-o", str(tmp_path / "p.json")), needle)
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seed", "-1"], "--seed"),
        (["--tokens-per-batch", str(2**70)], "--tokens-per-batch"),
        (["--tokens-per-batch", "0"], "--tokens-per-batch"),
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        (["-n", "1000000"], "--gpus"),
        (["-n", "1e30"], "--gpus"),
        (["-n", "0"], "--gpus"),
    ],
)
def test_option_numbers_beyond_range(cli, tmp_path, args, needle):
    w = workload(tmp_path / "w.json", lengths=[100, 200], counts=[1, 1])
    base = ["plan", "-n", "8", "-w", str(w), "-o", str(tmp_path / "p.json")]
    one_line_error(cli(*base, *args), needle)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    ("where", "value", "needle"),
    [
        (("model", "layers"), 10**12, "at most 4096"),
        (("model", "hidden"), 10**30, "at most"),
        (("model", "vocab"), -3, "at least 1"),
        (("device", "memory_bytes"), 1e30, "expected an integer"),
        (("time_ms", 0, "a"), float("nan"), "NaN"),
    ],
)
def test_profile_numbers_beyond_range(cli, tmp_path, work, where, value, needle):
    profile = json.loads(PROFILE.read_text())
    obj = profile
    for key in where[:-1]:
        obj = obj[key]
    obj[where[-1]] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    one_line_error(cli("caps", "-p", str(path)), needle)
    one_line_error(cli("plan", "-p", str(path), "-n", "8", "-w", str(work), "-o", str(tmp_path / "p.json")), needle)


# -- accepted when it should be refused -------------------------------------------------------------


def _plan_file(tmp_path: Path, cli, work: Path) -> Path:
    out = tmp_path / "plan.json"
    assert cli("plan", "-n", "8", "-w", str(work), "--pool", "4x(tp2,pp1)", "-o", str(out)).returncode == 0
    return out


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d["iterations"][0]["lengths"].__setitem__(0, 2**63 - 1), "at most 2147483647"),
        (lambda d: d["iterations"][0]["lengths"].__setitem__(0, 10**40), "at most 2147483647"),
        (lambda d: d.__setitem__("num_gpus", 1e30), "expected an integer"),
        (lambda d: d.__setitem__("num_gpus", 10**30), "at most 16384"),
        (lambda d: d["iterations"][0].__setitem__("predicted_time_s", 10**400), "finite number"),
    ],
)
def test_simulate_refuses_a_corrupt_plan(cli, tmp_path, work, mutate, needle):
    path = _plan_file(tmp_path, cli, work)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    one_line_error(cli("simulate", "--plan", str(path)), needle)


def test_plan_with_a_policy_of_its_own_configs_says_so_and_writes_nothing(cli, tmp_path, work):
    """megatron-dcp's CP groups are sizes the profile does not hold: a plan file of the profile cannot hold them."""
    out = tmp_path / "p.json"
    res = cli("plan", "-n", "8", "-w", str(work), "--policy", "megatron-dcp", "-o", str(out))
    one_line_error(res, "megatron-dcp", "bench")
    assert tree(tmp_path) == {"w.json"}


# -- long or unbounded work --------------------------------------------------------------------------


def test_unbounded_budgets_and_sizes_are_refused(cli, tmp_path, work):
    one_line_error(cli("workload", "-c", "python-stdlib", "-T", str(10**18), "-o", str(tmp_path / "x.json")), "-T")
    one_line_error(cli("propose", "-n", "1000000", "-w", str(work), "-o", str(tmp_path / "p.json")), "--gpus")
    one_line_error(cli("demo", "-T", str(10**20), "-o", str(tmp_path / "d")), "--tokens-per-batch")
    assert tree(tmp_path) == {"w.json"}


def test_sampler_refuses_a_batch_spanning_too_many_epochs(tmp_path):
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.errors import HydraulisError

    with pytest.raises(HydraulisError, match="epochs"):
        TokenBudgetSampler([3, 4], 2**32)


def test_100k_sequences_of_length_one_plan_and_validate(cli, tmp_path):
    w = workload(tmp_path / "w.json", batches=[[1] * 100_000])
    out = tmp_path / "p.json"
    res = cli("plan", "-n", "8", "-w", str(w), "-o", str(out), timeout=120)
    assert res.returncode == 0, res.stderr
    (it,) = load_plan(out).iterations
    assert it.num_tokens == 100_000 and len(it.lengths) == 100_000  # validated sequence by sequence on load


# -- interruption ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_plan_with_one_line_and_nothing_written(tmp_path, sig, code):
    w = workload(
        tmp_path / "w.json", lengths=list(range(50, 401)), counts=[1] * 351, tokens_per_batch=2**24, num_batches=400
    )
    proc = start_cli("plan", "-n", "64", "--pool", "32x(tp2,pp1)", "-w", str(w), "-o", str(tmp_path / "o" / "p.json"))
    try:
        wait_for_handlers(proc)  # then interrupt: before it, the signal would meet Python's defaults
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err
    assert "Traceback" not in err
    assert tree(tmp_path) == {"w.json"}


def test_sigterm_during_demo_leaves_no_partial_set(tmp_path):
    out = tmp_path / "demo"
    proc = start_cli("demo", "-o", str(out))
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # the workload is written (staged) before step 2 begins
            seen.append(line)
            if "2. deployment pool" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, "".join(seen) + err
    assert err.strip().splitlines()[-1].startswith("interrupted (SIGTERM)")
    assert not out.exists()
    assert tree(tmp_path) == set()


def test_data_build_sweeps_what_a_killed_build_left(cli, tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("some text to tokenize\n" * 100)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / ".corpus.k1ll3d.tmp"
    stale.mkdir()
    (stale / ".owner").write_text(dead.stdout.strip())
    (stale / "tokens.bin").write_bytes(b"half")
    unmarked = tmp_path / ".corpus.n0p1d.tmp"  # died before marking it
    unmarked.mkdir()
    alive = tmp_path / ".corpus.bu5y.tmp"  # another build still running
    alive.mkdir()
    (alive / ".owner").write_text(str(os.getpid()))
    other = tmp_path / ".other.k1ll3d.tmp"  # a killed build of another corpus in the same directory
    other.mkdir()
    (other / ".owner").write_text(dead.stdout.strip())
    named = tmp_path / f".other.{dead.stdout.strip()}-x7.tmp"  # another corpus's, killed before its .owner
    named.mkdir()
    foreign = tmp_path / ".notes.tmp"  # not a build's (no mark): left alone
    foreign.mkdir()
    res = cli("data", "build", str(src), "-o", str(tmp_path / "corpus"), "-t", "bytes")
    assert res.returncode == 0, res.stderr
    assert "removed 4 temporary directories left by an interrupted build" in res.stderr
    assert tree(tmp_path) >= {"corpus", ".corpus.bu5y.tmp", ".notes.tmp"}
    assert not stale.exists() and not unmarked.exists() and not other.exists() and not named.exists()


def test_sigkill_during_a_real_build_then_the_next_build_sweeps(cli, tmp_path):
    src = tmp_path / "big.txt"
    src.write_text(("a line of text for the byte tokenizer " * 50 + "\n\n") * 40_000)
    proc = start_cli("data", "build", str(src), "-o", str(tmp_path / "corpus"), "-t", "bytes")
    import time

    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".corpus.*.tmp")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.communicate()
    if not list(tmp_path.glob(".corpus.*.tmp")):
        pytest.skip("the build finished before it could be killed")
    # The next build in that directory, of another corpus, removes what the killed one left.
    res = cli("data", "build", str(src), "-o", str(tmp_path / "other"), "-t", "bytes")
    assert res.returncode == 0, res.stderr
    assert f"removed 1 temporary directory left by an interrupted build in {tmp_path}" in res.stderr
    assert not list(tmp_path.glob(".corpus.*.tmp")) and not (tmp_path / "corpus").exists()
    # What stays is the killed build's finished parts, for the next build of that corpus to reuse (or remove).
    assert [p.name for p in tmp_path.glob(".corpus.*")] in ([], [".corpus.parts"])


# -- partial output on error -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-n", "3"], "3 GPUs"),
        (["-n", "16", "-p", "llama-32b@a800-80g"], "only as a replica's lone micro-batch"),
    ],
)
def test_demo_that_fails_leaves_no_output_directory(cli, tmp_path, args, needle):
    out = tmp_path / "new" / "demo"
    one_line_error(cli("demo", *args, "-o", str(out)), needle)
    assert tree(tmp_path) == set()


# -- typer's argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan"], "Missing option '--gpus'"),
        (["plan", "--gpus", "x"], "valid integer"),
        (["caps", "--nope"], "No such option: --nope"),
        (["nocommand"], "No such command"),
        (["data"], "Missing command"),
    ],
)
def test_argument_errors_are_one_line_not_a_box(cli, args, needle):
    res = cli(*args)
    one_line_error(res, needle)
    assert "╭" not in res.stderr + res.stdout


# -- every refused value is echoed -------------------------------------------------------------------


def _out_of_bounds() -> list[tuple[str, ...]]:
    """Every bounded option of every command, given just past each bound and as a non-number."""
    import typer

    from hydraulis.cli import app

    cases: list[tuple[str, ...]] = []

    def walk(command, path: tuple[str, ...]) -> None:  # noqa: ANN001
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*path, name))
        for p in getattr(command, "params", []):
            low, high = getattr(p, "min", None), getattr(p, "max", None)
            values = ([] if low is None else [str(low - 1)]) + ([] if high is None else [str(high + 1)])
            cases.extend((*path, p.opts[0], v) for v in values + ["x"] * bool(values))

    walk(typer.main.get_command(app), ())
    return cases


OUT_OF_BOUNDS = _out_of_bounds()
RUN_ALL = """
import contextlib, io, json, sys
from hydraulis.cli import app
from hydraulis.cli.common import run_app  # what the `hydraulis` command runs, less its leaving the process
results = []
for args in json.loads(sys.argv[1]):
    sys.argv, err = ["hydraulis", *args], io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            run_app(app)
        except SystemExit as exc:
            results.append([exc.code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def refusals() -> dict[tuple[str, ...], tuple[int, str]]:
    """Each case through the command's error boundary (`common.run_app`), all in one child process."""
    from cli_helpers import _env

    done = subprocess.run([sys.executable, "-c", RUN_ALL, json.dumps(OUT_OF_BOUNDS)], capture_output=True,
                          text=True, env=_env(), timeout=120, check=True)  # fmt: skip
    return {args: (code, err) for args, (code, err) in zip(OUT_OF_BOUNDS, json.loads(done.stdout), strict=True)}


@pytest.mark.parametrize("args", OUT_OF_BOUNDS, ids=" ".join)
def test_a_refused_value_is_named_in_the_line(args, refusals):
    """`caps --gpus 0`, `workload -T 0`, `propose --max-pool 0`, `demo --batches 0`, ...: one line that names
    the option and the value it refused."""
    code, err = refusals[args]
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: Invalid value for '{args[-2]}'"), err
    assert f"got {args[-1]} " in lines[0], lines[0]
