"""The one error type that users see.

Anything raised as `HydraulisError` is a problem with the user's input or
configuration; the CLI prints its message on one line and exits with code 2.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools


class HydraulisError(ValueError):
    """Bad input, named together with what to do about it."""


SHORTER_WORKLOAD = "a workload of shorter sequences (hydraulis workload --max-len)"  # the commands' way to cut them


class CrowdedError(HydraulisError):
    """Sequences the caps hold, but only each as its replica's lone micro-batch, and a batch has more of them
    than any deployment has such replicas beside room for the rest (an overlong refusal, worded truly). The
    message names the command line's ways out; the training job words them in its config keys (`worded`)."""

    def __init__(self, length: int, config: str, lone_cap: int, gpus: int, replicas: int) -> None:
        self.length = length
        self.config = config
        self.lone_cap = lone_cap
        self.gpus = gpus
        self.replicas = replicas
        super().__init__(self.worded((SHORTER_WORKLOAD,
                                      "more GPUs (--gpus)", "a larger --memory-per-rank")))

    def __reduce__(self) -> tuple:
        """Pickled by its fields: a planner's error in a child process comes back whole (runtime/plan_server.py)."""
        return CrowdedError, (self.length, self.config, self.lone_cap, self.gpus, self.replicas)

    def worded(self, ways: tuple[str, ...]) -> str:
        either = ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]
        return (f"a sequence of {self.length} tokens fits {self.config} only as a replica's lone micro-batch (lone "
                f"cap {self.lone_cap}), and {self.gpus} GPUs hold {self.replicas} such replica(s), too few for a "
                f"batch's long sequences beside the rest; use {either}")


class OverlongError(HydraulisError):
    """A sequence longer than every cap that could run it: the facts as fields, so that each front end names
    its own ways out. The message is the command line's (`--overlong`, `--profile`); the training job words
    the same facts for its config (`worded`)."""

    def __init__(self, length: int, cap: int, cap_name: str, *, where: str = "", scope: str = "",
                 policies: tuple[str, ...] = ("split", "truncate", "drop"), remedies: tuple[str, ...] = ("more GPUs",),
                 cp_profile: str | None = None) -> None:
        self.length = length
        self.cap = cap
        self.cap_name = cap_name
        self.where = where  # what was planned ("hotspa", "w.json: batch 3"), or nothing
        self.scope = scope  # whose caps ("in the pool", "on 16 GPUs"), or nothing
        self.policies = policies  # the overlong policies that would run it
        self.remedies = remedies  # other ways out, in words every front end shares
        self.cp_profile = cp_profile  # a profile whose "+cp" variant would hold it (it has no CP configs)
        super().__init__(self.worded(f"--overlong {'|'.join(policies)}", "--profile {}"))

    def __reduce__(self) -> tuple:
        """Pickled by its fields: a planner's error in a child process comes back whole (runtime/plan_server.py)."""
        return functools.partial(OverlongError, where=self.where, scope=self.scope, policies=self.policies,
                                 remedies=self.remedies, cp_profile=self.cp_profile), (self.length, self.cap,
                                                                                       self.cap_name)

    def worded(self, overlong: str, profile: str) -> str:
        """The message, `overlong` naming how to cut long sequences and `profile` (a format with one {}) how
        to choose a profile."""
        ways = [overlong, *self.remedies]
        if self.cp_profile is not None:
            ways.append(f"CP configs ({profile.format(self.cp_profile + '+cp')})")
        either = ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]
        head = f"{self.where}: " if self.where else ""
        scope = f", {self.scope}" if self.scope else ""
        return (f"{head}a sequence of {self.length} tokens is longer than the largest cap {self.cap} "
                f"({self.cap_name}{scope}); use {either}")
