"""Rank 0's record of a run: metrics.jsonl, TensorBoard, the terminal, summary.json and report.png.

One object per step goes to `metrics.jsonl` as it happens (flushed, so a
failed run keeps what it measured), then a last `{"summary": ...}` line; the
run directory also gets `config.toml` (the resolved config), `pool.json`,
`summary.json` and, at the end, `report.png` (report.training_plot).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydraulis.cost.policies import LIGHTEST_FIRST
from hydraulis.files import read_jsonl, write_json_atomic, write_text_atomic
from hydraulis.planner.pool import Pool, save_pool
from hydraulis.planner.schedule import phase_runs, phases_text
from hydraulis.progress import console, note
from hydraulis.report import iteration_errors, training_plot
from hydraulis.specs import ClusterSpec
from hydraulis.training.mixture import source_shares
from hydraulis.training.settings import RunSettings

if TYPE_CHECKING:
    from hydraulis.planner.planner import Planner
    from hydraulis.runtime.metering.step_meter import StepMetrics


# The prediction is a steady step's; a process's first also allocates, runs kernels for the first time and opens
# its connections.
FIRST_STEP = "  (first step here: one-time setup too)"


class RunLog:
    """Rank 0's view of the run: metrics file, TensorBoard, terminal progress, summary and report."""

    def __init__(self, settings: RunSettings, start_step: int = 0, tensorboard: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.settings = settings
        self.start_step = start_step  # this process's first step: it also pays what later steps reuse
        parallel = settings.trainer.parallel
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        save_pool(self.out / "pool.json", Pool(parallel.cost.name, ClusterSpec(settings.world, settings.world),
                                               parallel.pool))
        write_text_atomic(self.out / "config.toml", settings.config_toml)
        # On resume, keep the steps before the checkpoint; later ones (and old summaries) are redone. The file a
        # resume at step K cuts is copied aside first (`metrics.jsonl.before-step-K`).
        metrics = self.out / "metrics.jsonl"
        self.rows = [r for r in read_jsonl(metrics) if "step" in r and r["step"] < start_step] if start_step else []
        self.switches = sum(1 for r in self.rows if r.get("switched"))  # deployment switches so far (TensorBoard)
        if metrics.is_file() and metrics.stat().st_size:
            shutil.copy2(metrics, metrics.with_name(f"{metrics.name}.before-step-{start_step}"))
        write_text_atomic(metrics, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.metrics_file = open(metrics, "a", encoding="utf-8")  # noqa: SIM115
        self.tb = tensorboard  # a SummaryWriter, or None
        self.console = console()
        self.progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=settings.steps, completed=start_step, info="")
        self.comparison: dict[str, Any] | None = None
        self.warned_budget = False  # one line per run for a peak over [parallel] memory_per_rank
        self.progress.start()
        spec = settings.trainer.model
        self._print(
            f"training {spec.name} ({spec.num_params / 1e6:.2f}M parameters) on {settings.world} rank(s); pool: "
            + "; ".join(str(d) for d in parallel.pool)
        )

    def _print(self, text: str, **options: Any) -> None:
        """A line on the terminal (above the progress bar) and in the run's transcript (progress.transcribe)."""
        note(text)
        self.console.print(text, **options)

    def step(self, m: StepMetrics, extra: dict[str, Any] | None = None) -> None:
        """One step's row; `extra` adds what rank 0 measured beside the trainer (run_fidelity.py: the load)."""
        row = {**m.to_dict(), **(extra or {})}
        self.rows.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.tb is not None:
            self._tensorboard(m, row)
        info = f"loss {m.loss:.3f}"
        self.progress.update(self.task, advance=1, info=info)
        if m.memory_over_budget and not self.warned_budget:
            self.warned_budget = True
            MiB, budget = 2**20, self.settings.trainer.parallel
            self._print(  # one line per run; metrics.jsonl marks every step over it
                f"warning: step {m.step}: a rank peaked at {m.memory_peak_bytes / MiB:.1f} MiB, over parallel."
                f"memory_per_rank {budget.memory_per_rank} ({budget.memory_budget_bytes / MiB:.1f} MiB; predicted "
                f"{m.memory_predicted_bytes / MiB:.1f} MiB)",
                highlight=False,
                soft_wrap=True,
            )
        if m.step % self.settings.trainer.train.log_every == 0 or m.step == self.settings.steps - 1:
            measured = ", ".join(f"{t:.3f}" for t in m.replica_s)
            predicted = ", ".join(f"{t:.3f}" for t in m.replica_predicted_s)
            self._print(
                f"step {m.step:>4}  loss {m.loss:6.3f}  {m.tokens_per_s:>7,.0f} tok/s  {deployment_text(m)}"
                f"  {m.iteration_s:.2f} s (predicted {m.predicted_s:.2f})" + ("  switched" if m.switched else "")
                + (FIRST_STEP if m.step == self.start_step else ""),
                highlight=False,
            )
            self._print(f"      replicas measured [{measured}] s, predicted [{predicted}] s{policy_text(m)}",
                        highlight=False)
        if "eval_loss" in row:  # [eval] ran after this step (run.Run._evaluate)
            self._print(
                f"eval after {m.step + 1} steps: loss {row['eval_loss']:.4f} (perplexity {row['eval_perplexity']:.2f})"
                f" on {row['eval_tokens']:,} held-out tokens",
                highlight=False,
            )

    def _tensorboard(self, m: StepMetrics, row: dict[str, Any]) -> None:
        """One step in TensorBoard: the training scalars; the deployment by name, as text (a phased step's
        phases separated by ` | `); switches and phases; memory in MiB: predicted, the measured peak where it was
        measured, and the budget (`memory_per_rank`) when there is one; micro-batches per memory policy."""
        tb, step, mib = self.tb, m.step, float(1 << 20)
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "iteration_s", "predicted_s", "planning_s"):
            tb.add_scalar(f"train/{key}", row[key], step)
        tb.add_text("deployment", m.deployment, step)
        self.switches += int(m.switched)
        tb.add_scalar("deployment/switched", int(m.switched), step)
        tb.add_scalar("deployment/switches", self.switches, step)
        tb.add_scalar("deployment/switch_s", m.switch_s if m.switched else 0.0, step)
        tb.add_scalar("deployment/phases", m.phases, step)
        tb.add_scalar("deployment/phase_switch_s", m.phase_switch_s, step)
        totals = m.memory_choices.totals  # micro-batches per memory policy, and those that fit only alone
        for policy in LIGHTEST_FIRST:
            tb.add_scalar(f"memory/policy_{policy.label}", totals.get(policy.label, 0), step)
        tb.add_scalar("memory/alone", m.memory_choices.alone, step)
        tb.add_scalar("memory/predicted_mib", m.memory_predicted_bytes / mib, step)
        if m.memory_peak_bytes:  # measured on this step (CPU measures a sample of them; null otherwise)
            tb.add_scalar("memory/peak_mib", m.memory_peak_bytes / mib, step)
            tb.add_scalar("memory/exchange_peak_mib", (m.exchange_peak_bytes or 0) / mib, step)
        budget = self.settings.trainer.parallel.memory_budget_bytes
        if budget is not None:
            tb.add_scalar("memory/budget_mib", budget / mib, step)
        if "eval_loss" in row:  # [eval] ran after this step
            tb.add_scalar("eval/loss", row["eval_loss"], step)
            tb.add_scalar("eval/perplexity", row["eval_perplexity"], step)

    def compared(self, comparison: dict[str, Any]) -> None:
        """The measured comparison (`Trainer.compare`) goes into the summary and the closing lines."""
        self.comparison = comparison

    def close(self) -> None:
        self.progress.stop()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if not self.metrics_file.closed:
            self.metrics_file.close()

    def finish(self, planner: Planner | None = None) -> dict[str, Any]:
        """The summary (summary.json, the metrics' last line, report.png and the closing lines); `planner`,
        rank 0's, says what the pool's other deployments were predicted to cost (`kept_one`)."""
        summary = summarize(self.rows)
        budget = self.settings.trainer.parallel.memory_budget_bytes
        summary["memory_budget_bytes"] = budget
        kept = kept_one(self.settings, self.rows, planner)
        if kept is not None:
            summary["never_switched"] = kept
        if self.comparison is not None:
            summary["comparison"] = self.comparison
        overlong = self.settings.data.overlong
        if overlong is not None:  # what max_len cut of the corpus (records, target tokens)
            summary["overlong"] = overlong.to_dict()
        mix = self.settings.data.mixture
        if mix is not None:  # each source's tokens and targets over the run's steps, beside its weight
            summary["sources"] = source_shares(self.rows, mix.shares())
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"summary": summary}) + "\n")
        write_json_atomic(self.out / "summary.json", summary)
        if self.rows:
            training_plot(self.rows, self.out / "report.png", report_title(self.settings), budget)
        shares = ", ".join(f"{k}: {v:.0%}" for k, v in summary["deployment_share"].items())
        self._print(
            f"done: {summary['steps']} steps, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
            f"mean {summary['tokens_per_s']:,.0f} tokens/s; steps per deployment: {shares}; "
            f"{summary['switches']} switch(es) costing {summary['switch_s']:.3f} s; "
            f"planning not hidden {summary['planning_unhidden_s']:.3f} s of {summary['planning_s']:.3f} s; "
            f"iteration time predicted/measured median error {summary['iteration_error_median']:.0%}"
        )
        if summary.get("eval"):
            e = summary["eval"]
            self._print(
                f"eval: loss {e['loss_first']:.4f} -> {e['loss']:.4f} (perplexity {e['perplexity']:.2f}) "
                f"in {e['evaluations']} evaluation(s) of {e['tokens']:,} held-out tokens",
                highlight=False,
            )
        if kept is not None:
            self._print(kept_line(kept, self.settings.trainer.parallel.memory_per_rank), highlight=False)
        if summary.get("sources"):
            self._print("sources: " + "; ".join(
                f"{n} {v['token_share']:.1%} of tokens (weight {v['weight']:.1%}), {v['target_share']:.1%} of targets"
                for n, v in summary["sources"].items()), highlight=False, soft_wrap=True)  # fmt: skip
        if (line := choices_line(summary)) is not None:
            self._print(line, highlight=False)
        if overlong is not None and overlong.records:
            self._print(f"overlong: {overlong.describe()}", highlight=False)
        if self.comparison is not None:
            self._print(comparison_lines(self.comparison), highlight=False)
        self._print(f"run directory: {self.out} (metrics.jsonl, report.png, train.log, tb/, config.toml, "
                    "pool.json)")
        return summary


def memory_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest peak, prediction, exchange peak and error over the measured steps; None where none was."""
    measured = [r for r in rows if r.get("memory_peak_bytes")]  # null (or 0, before 2026-12-05): not measured

    def most(key: str) -> Any:
        return max((r[key] for r in measured if r.get(key) is not None), default=None)

    return {"memory_peak_bytes": most("memory_peak_bytes"), "memory_predicted_bytes": most("memory_predicted_bytes"),
            "exchange_peak_bytes": most("exchange_peak_bytes"), "memory_error_max": most("memory_error")}


def report_title(settings: RunSettings) -> str:
    """report.png's title: the run (its directory), its model and ranks, and its pool."""
    spec, pool = settings.trainer.model, "; ".join(str(d) for d in settings.trainer.parallel.pool)
    return (f"run {settings.out}: {spec.name} ({spec.num_params / 1e6:.2f}M parameters), {settings.steps} steps on "
            f"{settings.world} rank(s)\npool {pool}")


def comparison_lines(c: dict[str, Any]) -> str:
    """The headline: measured speedup over the best homogeneous deployment beside the predicted one."""
    tps = {name: c["tokens"] / s for name, s in c["median_s"].items()}
    rows = [f"measured here, the same {c['tokens']:,} tokens, {c['repeats']} repeats interleaved batch by batch "
            "(tokens/s; per batch the median over the repeats):"]
    rows += [f"  {name:<32} {v:>9,.0f}" for name, v in tps.items()]
    spread = c["measured_speedup_per_repeat"]
    rows.append(
        f"  planned / best homogeneous ({c['best_homogeneous']}): {c['measured_speedup']:.2f}x measured "
        f"({min(spread):.2f}-{max(spread):.2f}x over the repeats), {c['predicted_speedup']:.2f}x predicted"
    )
    if "cpu_speedup" in c:  # the work, which other processes' load does not stretch (runtime/metering/compare.py)
        rows.append(f"  CPU time of the ranks, planned / best homogeneous: {c['cpu_speedup']:.2f}x")
    return "\n".join(rows)


def kept_one(settings: RunSettings, rows: list[dict[str, Any]], planner: Planner | None) -> dict[str, Any] | None:
    """Why a run on a pool of several deployments ran one of them on every step (None: it did not): each
    other one's predicted time over the chosen one's (the median over the batches it held), how many batches
    it could not hold, and the longest sequence each holds within the memory (`memory_per_rank`, if set)."""
    pool = settings.trainer.parallel.pool
    if planner is None or len(pool) < 2 or not rows or len({r["deployment"] for r in rows}) > 1:
        return None
    if rows[0].get("phases", 1) > 1:  # one phased schedule on every step still switches inside it
        return None
    steps = {r["step"] for r in rows}
    seen = [ratios for step, ratios in sorted(planner.outlook.items()) if step in steps]
    chosen, caps = rows[0]["deployment_index"], planner.caps()
    others = []
    for k, deployment in enumerate(pool):
        if k != chosen:
            held = [v[k] for v in seen if math.isfinite(v[k])]
            others.append({"deployment": str(deployment), "holds_tokens": caps[k],
                           "batches_not_held": len(seen) - len(held),
                           "predicted_vs_chosen": statistics.median(held) if held else None})
    return {"deployment": str(pool[chosen]), "holds_tokens": caps[chosen], "max_len": settings.data.max_len,
            "memory_budget_bytes": settings.trainer.parallel.memory_budget_bytes, "batches": len(seen),
            "others": others}


def kept_line(kept: dict[str, Any], budget: str | int | None) -> str:
    """The closing line of `kept_one`."""
    n = kept["batches"]
    memory = f"within memory_per_rank {budget}" if budget is not None else "without a memory budget"
    def other(o: dict[str, Any]) -> str:
        ratio = f"{o['predicted_vs_chosen']:.2f}x" if o["predicted_vs_chosen"] is not None else "-"
        missed = o["batches_not_held"]
        held = f" (holds {o['holds_tokens']:,} tokens: not {missed} of them)" if missed else ""
        return f"{o['deployment']} {ratio}{held}"

    others = "; ".join(other(o) for o in kept["others"])
    if any(o["batches_not_held"] for o in kept["others"]):
        bound = f"it holds {kept['holds_tokens']:,} tokens {memory}"
    else:
        bound = f"every deployment held every batch of max_len {kept['max_len']:,} {memory}"
    return (
        f"never switched: {kept['deployment']} was predicted fastest for all {n} batches planned here ({bound}); "
        f"the others' predicted time against it, median: {others}"
    )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"steps": 0}
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["iteration_s"] for r in rows)
    counts = Counter(r["deployment"] for r in rows)
    errors = iteration_errors(rows)
    loads = [r["foreign_cores"] for r in rows if r.get("foreign_cores") is not None]
    return {
        "steps": len(rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "deployment_share": {k: v / len(rows) for k, v in counts.most_common()},
        "switches": sum(1 for r in rows if r["switched"]),
        "switch_s": sum(r["switch_s"] for r in rows if r["switched"]),
        "planning_s": sum(r["planning_s"] for r in rows),
        "planning_unhidden_s": sum(r["planning_unhidden_s"] for r in rows),
        "iteration_error_median": statistics.median(errors) if errors else 0.0,
        "iteration_error_max": max(errors) if errors else 0.0,
        # The largest over steps of each rank-wise maximum (runtime/metering/step_memory.py); the prediction over the
        # measured steps only (CPU measures a sample of them), so the two describe the same iterations; None where
        # no step was measured.
        **memory_summary(rows),
        # Other processes' CPU load (cores) during the steps, where measured (run_fidelity.py).
        "foreign_cores_median": statistics.median(loads) if loads else None,
        # steps on which a rank's measured peak exceeded [parallel] memory_per_rank
        "steps_over_budget": sum(1 for r in rows if r.get("memory_over_budget")),
        "eval": _last_eval(rows),
        "memory_choices": memory_choices_summary(rows),
    }


def deployment_text(m: StepMetrics) -> str:
    """The step's deployments for the terminal, repeated phases merged and explained (`phases_text`)."""
    return phases_text(m.deployment.split(" | "), m.memory_choices.alone)


def policy_text(m: StepMetrics) -> str:
    """The step's micro-batches per memory policy, where any ran another than none ('' otherwise)."""
    totals = m.memory_choices.totals
    if set(totals) <= {"none"}:
        return ""
    return "; micro-batches by memory policy: " + ", ".join(f"{n} {label}" for label, n in totals.items())


def memory_choices_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the steps: micro-batches per memory policy, the steps that ran more than one policy, the micro-batches
    that fit only as their replica's only one, and the steps that ran one deployment in consecutive phases."""
    totals: Counter[str] = Counter()
    mixed = alone = repeated = 0
    for r in rows:
        choices = r.get("memory_choices") or {"policies": {}, "alone": 0}  # absent in rows before 2026-12-06
        step = Counter({label: sum(row) for label, row in choices["policies"].items()})
        totals += step
        mixed += len(+step) > 1
        alone += choices["alone"]
        names = r["deployment"].split(" | ")
        repeated += len(phase_runs(names)) < len(names)
    return {"micro_batches": {p.label: totals[p.label] for p in LIGHTEST_FIRST if totals[p.label]},
            "steps_mixed": mixed, "alone": alone, "steps_repeated_phases": repeated}


def choices_line(summary: dict[str, Any]) -> str | None:
    """The closing line on memory policies and repeated phases; None where every micro-batch ran none and no
    step ran one deployment in consecutive phases."""
    c = summary.get("memory_choices")
    parts = []
    if c and not set(c["micro_batches"]) <= {"none"}:
        policies = ", ".join(f"{n:,} {label}" for label, n in c["micro_batches"].items())
        parts.append(f"micro-batches by policy {policies} ({c['steps_mixed']} of {summary['steps']} steps mixed them)")
    if c and c["steps_repeated_phases"]:
        parts.append(f"{c['steps_repeated_phases']} step(s) ran one deployment in several phases")
    if not parts:
        return None
    return f"memory: {'; '.join(parts)}; {c['alone']:,} micro-batch(es) fit only as their replica's only one"


def _last_eval(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's last evaluation ([eval]): after how many steps, its loss and perplexity; None without one."""
    done = [r for r in rows if "eval_loss" in r]
    if not done:
        return None
    last = done[-1]
    return {"after_step": last["step"] + 1, "loss": last["eval_loss"], "perplexity": last["eval_perplexity"],
            "tokens": last["eval_tokens"], "targets": last["eval_targets"], "evaluations": len(done),
            "loss_first": done[0]["eval_loss"]}  # fmt: skip
