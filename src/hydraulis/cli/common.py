"""Helpers shared by the command modules: output, errors, common options."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from hydraulis.errors import HydraulisError
from hydraulis.limits import MAX_BATCHES, MAX_GPUS, MAX_SEED, MAX_TOKENS_PER_BATCH
from hydraulis.progress import console as _console
from hydraulis.progress import (
    say,
    table,  # noqa: F401 - the commands' tables
)

if TYPE_CHECKING:
    from hydraulis.cost import CostModel
    from hydraulis.data.workload import Workload
    from hydraulis.specs import ClusterSpec

console = _console()
err_console = _console(stderr=True)

ProfileOption = typer.Option(
    "llama-7b@a800-80g",
    "--profile",
    "-p",
    help="Profile file, preset (llama-7b@a800-80g, ...) or MODEL@DEVICE for the analytic model; "
    "append +cp for context-parallel configs (analytic: a/cp, b/cp plus the K/V all-gather).",
)


MemoryPerRankOption = typer.Option(
    None,
    "--memory-per-rank",
    help="What one rank's tensors may hold ('96MiB', '70GB'): the caps use it in place of the device's memory.",
)
DtypeOption = typer.Option("bf16", "--dtype", help="Compute dtype the caps are for: bf16 or fp32.")
InterleaveOption = typer.Option(
    False, "--interleave", help="Also weigh interleaved 1F1B for configs above pp 2 (one layer a chunk); "
    "`hydraulis train` runs a pool that names them."
)


def cost_model(profile: str, memory_per_rank: str | None = None, dtype: str = "bf16") -> CostModel:
    """The named cost model, its caps for this compute dtype and, when given, memory budget per rank."""
    from hydraulis.cost import load_cost_model
    from hydraulis.limits import parse_size
    from hydraulis.specs import DTYPE_BYTES

    if dtype not in DTYPE_BYTES:
        raise HydraulisError(f"--dtype {dtype!r} is not a compute dtype; use one of {', '.join(DTYPE_BYTES)}")
    budget = None if memory_per_rank is None else parse_size(memory_per_rank, "--memory-per-rank")
    return load_cost_model(profile).for_job(budget, DTYPE_BYTES[dtype])


GpusPerNodeOption = typer.Option(8, "--gpus-per-node", help="GPUs per node.", min=1, max=MAX_GPUS)
WorkloadOption = typer.Option(..., "--workload", "-w", help="A hydraulis.workload/1 file.")
TokensPerBatchOption = typer.Option(
    None, "--tokens-per-batch", help="Histogram workloads: token budget.", min=1, max=MAX_TOKENS_PER_BATCH
)
NumBatchesOption = typer.Option(
    None, "--num-batches", help="Histogram workloads: how many batches.", min=1, max=MAX_BATCHES
)
SeedOption = typer.Option(None, "--seed", help="Histogram workloads: sampling seed.", min=0, max=MAX_SEED)


def gpus_option(default: Any = ...) -> Any:
    """`--gpus/-n`, bounded: the planner's work grows with the GPU count."""
    return typer.Option(default, "--gpus", "-n", help="GPUs in the job.", min=1, max=MAX_GPUS)


def load_job(
    profile: str,
    gpus: int,
    gpus_per_node: int,
    workload: Path,
    tokens_per_batch: int | None,
    num_batches: int | None,
    seed: int | None,
    memory_per_rank: str | None = None,
    dtype: str = "bf16",
) -> tuple[CostModel, ClusterSpec, Workload]:
    """The cost model, cluster and workload that `plan` and `propose` start from, checked."""
    from hydraulis.data.workload import load_workload
    from hydraulis.specs import ClusterSpec

    if gpus < 1:
        raise HydraulisError(f"--gpus must be positive, got {gpus}")
    cluster = ClusterSpec(gpus, gpus_per_node)
    cost = cost_model(profile, memory_per_rank, dtype)
    return cost, cluster, load_workload(workload, tokens_per_batch, num_batches, seed)


def totals_line(iterations: int, tokens: int, seconds: float, how: str) -> str:
    """The last line of `plan` and `simulate`: the iterations' tokens and time (`how`: predicted, simulated)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"total: {iterations} iteration(s), {tokens:,} tokens in {seconds:.3f} s {how}, {rate:,.0f} tokens/s"


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2: the contract for bad input."""
    say(f"error: {' '.join(message.split())}", sys.stderr)  # in a run's transcript too
    sys.exit(2)


def run_app(app: typer.Typer) -> NoReturn:
    """Run the command; a process that joined a training job leaves without finalizing (launch.leave_process)."""
    try:
        _serve(app)
    except SystemExit as exc:
        launch = sys.modules.get("hydraulis.runtime.parallelism.launch")  # imported only where torch is
        if launch is not None and launch.joined_a_job() and isinstance(exc.code, int | None):
            launch.leave_process(exc.code or 0)
        raise


def _serve(app: typer.Typer) -> NoReturn:
    """The error boundary of every command.

    Bad input of any kind (our own errors, the file system's, numbers Python or
    numpy refuse, typer's argument errors) is one line and exit code 2;
    SIGINT/SIGTERM are one line and 128 + the signal, after every cleanup ran.
    Anything else is a bug and keeps its traceback.
    """
    from hydraulis.processes import interrupt

    interrupt.install()
    try:
        code = app(prog_name="hydraulis", standalone_mode=False)
    except interrupt.Interrupted as exc:
        say(f"interrupted ({exc}); {interrupt.left_behind()}", sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:  # typer's own KeyboardInterrupt handling
        say(f"interrupted (SIGINT); {interrupt.left_behind()}", sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # argument errors: one line, not a box
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            sys.exit(2)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        fail(exc.format_message() + _given(exc) + hint)
    except HydraulisError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(describe_os_error(exc))
    except (ValueError, OverflowError) as exc:
        fail(f"a value is out of range: {exc}; check the numbers in the input")
    except MemoryError:
        fail("out of memory; use smaller batches, a smaller token budget or fewer sequences")
    if code == 130:  # typer turns a KeyboardInterrupt (a second Ctrl-C while ranks run) into 130, silently
        say("interrupted (SIGINT); stopped at once", sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


def _given(exc: Exception) -> str:
    """`, got VALUE` for typer's refusal of a value (its pydantic message does not echo it), else ""."""
    errors = getattr(exc.__cause__, "errors", None)  # typer validates option values with pydantic
    if not callable(errors):
        return ""
    try:
        value = errors()[0]["input"]
    except (IndexError, KeyError, TypeError):
        return ""
    return f", got {_clip(value)}"


def _clip(name: object) -> str:
    text = "" if name is None else str(name)
    return text if len(text) <= 120 else text[:60] + "..." + text[-40:]


def describe_os_error(exc: OSError) -> str:
    """The file and the reason, and what to do about the common ones."""
    what = exc.strerror or str(exc)
    name = _clip(exc.filename)
    if exc.filename2 is not None:
        name = f"{name} -> {_clip(exc.filename2)}"
    advice = {
        "ENOSPC": "free some space or write elsewhere",
        "EACCES": "check the permissions or write elsewhere",
        "EROFS": "write elsewhere",
        "ENAMETOOLONG": "use a shorter name",
        "EISDIR": "give a file name",
        "ENOTDIR": "a part of the path is a file",
    }
    import errno

    hint = advice.get(errno.errorcode.get(exc.errno or 0, ""), "")
    return f"{name}: {what}" + (f"; {hint}" if hint else "") if name else what + (f"; {hint}" if hint else "")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=1) + "\n")
