"""`hydraulis check`: what this machine offers a run and whether the runtime works on it (runtime/check.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import MemoryPerRankOption
from hydraulis.errors import HydraulisError

if TYPE_CHECKING:
    from hydraulis.specs import ModelSpec

GiB = 1 << 30
DEFAULTS = {"cuda": ("small", 65536, 5), "cpu": ("tiny", 2048, 1)}  # (model, tokens per step, timed steps)


@app.command("check")
def check(
    device: str = typer.Option("auto", "--device", help="auto (a GPU when torch sees one), cuda or cpu."),
    model: str = typer.Option(None, "--model", help="Model preset of the training step (default: small; cpu tiny)."),
    tokens: int = typer.Option(
        None, "--tokens", help="Tokens per training step, within 10% (whole documents; default: 65536; cpu 2048)."
    ),
    steps: int = typer.Option(None, "--steps", help="Timed training steps after 2 warm-up ones (default: 5; cpu 1)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Compute dtype of the training step: bf16 or fp32."),
    memory_per_rank: str = MemoryPerRankOption,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of lines."),
    out: Path = typer.Option(None, "--out", "-o", help="Also write the report as JSON to this file."),
) -> None:
    """Check this machine: torch, CUDA, NCCL/gloo, devices, attention kernels and their correctness, one step."""
    from hydraulis.limits import parse_size
    from hydraulis.specs import DTYPE_BYTES

    if device not in ("auto", "cuda", "cpu"):
        raise HydraulisError(f"--device {device!r}: use auto, cuda or cpu")
    if dtype not in DTYPE_BYTES:
        raise HydraulisError(f"--dtype {dtype!r} is not a compute dtype; use one of {', '.join(DTYPE_BYTES)}")
    budget = None if memory_per_rank is None else parse_size(memory_per_rank, "--memory-per-rank")
    if out is not None and out.is_dir():
        raise HydraulisError(f"--out {out} is a directory; give a file name")
    # the defaults of a named device are known without torch: bad input fails fast, without it
    sizes = _sizes(device, model, tokens, steps) if device != "auto" else None
    from hydraulis.runtime.check import run_check
    from hydraulis.runtime.metering.machine import check_device

    where = check_device(device)
    spec, tokens, steps = sizes or _sizes(where.type, model, tokens, steps)
    report = run_check(where, spec, tokens=tokens, steps=steps, dtype=dtype, budget=budget)
    text = json.dumps(report, indent=1, default=float) + "\n"
    if out is not None:
        from hydraulis.files import write_text_atomic

        write_text_atomic(out, text)
    if as_json:
        typer.echo(text, nl=False)
    else:
        for line in lines(report):
            typer.echo(line)
    if not report["ok"]:
        raise typer.Exit(1)


def _sizes(kind: str, model: str | None, tokens: int | None, steps: int | None) -> tuple[ModelSpec, int, int]:
    """The step's model, tokens and timed steps on a device of `kind` (cpu or cuda): the flags, else DEFAULTS."""
    from hydraulis.specs import get_model

    name, default_tokens, default_steps = DEFAULTS[kind]
    tokens = default_tokens if tokens is None else tokens
    steps = default_steps if steps is None else steps
    if tokens < 1 or steps < 1:
        raise HydraulisError(f"--tokens and --steps must be positive, got {tokens} and {steps}")
    return get_model(model or name), tokens, steps


def _errors(check: dict[str, Any]) -> str:
    errs = ", ".join(f"{k} {x:.1e}" for k, x in check["rel_err"].items())
    return f"rel err {errs}: {'ok' if check['ok'] else 'FAILED'}"


def _backends(env: dict[str, Any], collectives: dict[str, Any]) -> str:
    said = []
    for name in ("nccl", "gloo"):
        if name in collectives:
            works = collectives[name]
            state = "works" if works["works"] else f"FAILED ({works.get('error', 'wrong sum')})"
        else:
            state = "available, not used on this device" if env[name]["available"] else "not available"
        version = env[name].get("version")
        said.append(f"{name}{' ' + version if version else ''} {state}")
    return "; ".join(said)


def lines(report: dict[str, Any]) -> list[str]:
    """The report in a few lines, for people."""
    env, step, v, c = report["environment"], report["step"], report["varlen"], report["cp"]
    devices = ", ".join(f"{d['index']}: {d['name']} {d['memory_bytes'] / GiB:.1f} GiB" for d in env["devices"])
    host = f"{env['cpu_cores']} CPU core(s), {env['host_memory_bytes'] / GiB:.0f} GiB host memory"
    out = [
        f"hydraulis check on {env['device']}: torch {env['torch']}, CUDA {env['cuda'] or 'none (a CPU build)'}; "
        f"{'GPUs ' + devices if devices else 'no GPU'}; {host}",
        f"  collectives: {_backends(env, step['collectives'])}",
        f"  attention kernels (head dim {report['head_dim']}): "
        + "; ".join(f"{d} varlen {k['varlen']}, CP {k['cp']}" for d, k in report["kernels"].items()),
        f"  varlen attention [{v['kernel']}], {v['documents']} documents, {v['tokens']} tokens, bf16 against an "
        f"fp32 reference: {_errors(v)}",
        f"  CP attention [{c['kernel']}], document {c['document']} as {len(c['chunks'])} chunks of "
        f"cp {len(c['chunks']) // 2}: {_errors(c)}",
    ]
    out += _step_lines(step)
    found = report["profiles"]
    listed = "; ".join(f"{p['name']} ({p['model']}, {','.join(p['configs'])}, {p['world_size']} ranks)" for p in found)
    out.append(f"  cached profiles for this machine: {listed}" if found
               else '  cached profiles for this machine: none (profile = "auto" measures one on the first run)')
    failed = [n for n, ok in (("varlen attention", v["ok"]), ("CP attention", c["ok"]), ("training step", step["ok"]))
              if not ok] + [f"{b} collective" for b, r in step["collectives"].items() if not r["works"]]  # fmt: skip
    out.append(f"  FAILED: {', '.join(failed)}" if failed else f"  ok: every check passed ({report['wall_s']:.1f} s)")
    return out


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def _step_lines(s: dict[str, Any]) -> list[str]:
    head = f"  training step {s['model']} 1x(tp1,pp1) {s['dtype']}"
    if "step_s" not in s:
        return [f"{head}: FAILED ({s['out_of_memory'] or 'no step ran'})"]
    import statistics

    tokens = statistics.mean(s["tokens_per_step"])
    mfu = (f"MFU {s['mfu']:.1%} of {s['peak_flops'] / 1e12:.3g} TFLOP/s, {s['peak_source']}" if s["mfu"] is not None
           else f"MFU unknown: peak {s['peak_source']}")  # fmt: skip
    loss = "" if s["ok"] or s["steps_over_budget"] else ", loss not finite: FAILED"
    memory = (f"  memory: peak {_size(s['memory_peak_bytes'])} measured, "
              f"{_size(s['memory_predicted_bytes'])} predicted by the memory model "
              f"({s['memory_measured_over_predicted']:.2f}x)")  # fmt: skip
    if s["budget_bytes"] is not None:
        over = s["steps_over_budget"]
        memory += f"; budget {_size(s['budget_bytes'])} " + (f"exceeded at steps {over}: FAILED" if over else "held")
    return [f"{head}: {statistics.median(s['step_s']) * 1e3:.1f} ms median, {s['tokens_per_s']:,.0f} tokens/s "
            f"({tokens:,.0f} tokens a step), {mfu}{loss}", memory]  # fmt: skip
