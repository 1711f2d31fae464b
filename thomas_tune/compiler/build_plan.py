"""The build plan: what a build with a tuning log compiles its graphs with, made once.

:meth:`BuildPlan.from_log` reads the tuning log's schedules
(:func:`thomas_tune.compiler.compile.tuned_build`: the applied records, the workloads whose record
is slower than their default schedule, each kernel's time as built), the Winograd choice those
times make per graph (:func:`thomas_tune.compiler.compile.winograd_choice`) and the tasks (kernels)
the build then has (:func:`thomas_tune.tasks.extract`). :mod:`thomas_tune.compiler.record_check`
checks the records a plan applies and returns the wrong ones; :meth:`BuildPlan.without` is
the plan made again without them (leaving a record out can change the Winograd choice, and
so the tasks), which :func:`check_plan` repeats until no new record fails. ``export`` and
``replay`` compile from the plan :func:`check_plan` returns; :func:`set_aside_wrong` moves a
log's wrong records out of it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import tvm
from tvm.s_tir import meta_schedule as ms

from .compile import tuned_build, winograd_choice
from ..logs import mean_run_seconds
from .record_check import (RecordChecks, check_records, local_device, move_aside, run_checks,
                           wrong_records)
from ..tasks import Task, extract, key


@dataclass
class BuildPlan:
    """What a build of ``graphs`` (graph name -> unfused Relax module) with tuning log ``log``
    (a :class:`thomas_tune.logs.TuningLog`) for ``target`` compiles with.

    ``database``: the records applied (a MetaSchedule database, the fastest valid record per
    workload, none slower than the default schedule); ``slower``: workloads left at their
    default schedule because their best record is slower on the device; ``kernel_ms``: each
    workload's time as built (ms per call, keyed by workload key); ``winograd``: graph name ->
    the set of :class:`thomas_tune.training_graph.winograd_form.Conv` computed in the Winograd form;
    ``wrong``: workload key -> reason, the records left out (:meth:`without`); ``left_out``:
    workload key -> reason, records left out for another reason than a check (a memory
    budget's, :func:`thomas_tune.memory_plan.trade_records`). ``tasks`` (made
    on first use, once): the kernels the build has, deduplicated by workload."""

    log: object
    target: tvm.target.Target
    graphs: dict[str, tvm.IRModule]
    database: ms.Database
    slower: int
    kernel_ms: dict[str, float]
    winograd: dict[str, set]
    wrong: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_log(cls, log, target: tvm.target.Target, graphs: dict[str, tvm.IRModule],
                 wrong: dict[str, str] | None = None, left_out: dict[str, str] | None = None
                 ) -> BuildPlan:
        """The plan of a build of ``graphs`` with ``log``, without the records of ``wrong``
        and ``left_out`` (workload key -> reason; those kernels keep their default schedule).
        Raises what :func:`thomas_tune.compiler.compile.tuned_build` raises for an unreadable
        log."""
        wrong, left_out = dict(wrong or {}), dict(left_out or {})
        database, slower, kernel_ms = tuned_build(log, target,
                                                  exclude=set(wrong) | set(left_out))
        chosen = {name: winograd_choice(mod, kernel_ms, log, target)
                  for name, mod in graphs.items()}
        return cls(log, target, graphs, database, slower, kernel_ms, chosen, wrong, left_out)

    @functools.cached_property
    def tasks(self) -> list[Task]:
        """The build's kernels (:func:`thomas_tune.tasks.extract` with the plan's Winograd
        choice)."""
        return extract(self.graphs, self.target, self.winograd)

    def without(self, wrong: dict[str, str]) -> BuildPlan:
        """This plan made again with the records of ``wrong`` (workload key -> reason) left out
        as well as those it left out already."""
        return BuildPlan.from_log(self.log, self.target, self.graphs, {**self.wrong, **wrong},
                                  self.left_out)


def check_plan(plan: BuildPlan, say=print, started: float | None = None
               ) -> tuple[BuildPlan, dict]:
    """Check every record ``plan`` applies on this machine's device
    (:func:`thomas_tune.compiler.record_check.wrong_records`); while some are wrong, make the plan
    again without them and check the records of its new tasks. Returns the plan whose applied
    records all passed, and the manifest's ``record_check``: ``{"checked": records checked, or
    None where they could not be; "wrong": workload key -> reason, the records left out;
    "unchecked": why none could be checked, or None}``. ``say`` gets one line per record left
    out; ``started``: when the checks began (``time.perf_counter()``; None: now)."""
    tally = RecordChecks()
    while True:
        wrong = wrong_records(plan, tally, say, started)
        started = None
        if not wrong:
            return plan, {"checked": tally.checked, "wrong": plan.wrong,
                          "unchecked": tally.unchecked}
        plan = plan.without(wrong)


def set_aside_wrong(log, target: tvm.target.Target, graphs: dict[str, tvm.IRModule], say=print,
                    batch: int = 8) -> int:
    """Check the records a build of ``graphs`` applies from ``log`` (an unpacked
    :class:`~thomas_tune.logs.TuningLog`) and move each wrong one to
    ``database_tuning_record.json.rejected`` with its reason. For a workload whose applied
    record is wrong, its next-fastest records are checked, ``batch`` at a time, until a right
    one is found (or none is left); then the build's tasks are taken again (leaving a record out
    can change the Winograd choice) until every applied record is right. Returns the number of
    records set aside. Raises ValueError for a packed log ('thomas-tune log unpack' first) and
    :class:`thomas_tune.compiler.record_check.CheckUnavailable` when no device here runs the
    target."""
    log.require_writable()
    dev, _ = local_device(target)
    total = 0
    while True:
        plan = BuildPlan.from_log(log, target, graphs)
        results = check_records(plan.tasks, plan.database, target)
        wrong_tasks = [t for t in plan.tasks if results.get(key(t)) is not None]
        if not wrong_tasks:
            return total
        aside: dict[str, list[tuple[list[float], str]]] = {}  # key -> (run times, reason)
        every = log.database(check=False)  # all records (the plan's holds the best ones)
        for t in wrong_tasks:
            workload = every.commit_workload(t.mod)
            recs = [r for r in every.get_top_k(workload, 1 << 20)
                    if math.isfinite(mean_run_seconds(r.run_secs or []))]
            found = []
            for start in range(0, len(recs), batch):
                chunk = recs[start:start + batch]
                whys = run_checks([(t, r) for r in chunk], target, dev)
                for r, why in zip(chunk, whys):
                    if why is None:
                        break
                    found.append(([float(x) for x in r.run_secs], why))
                else:
                    continue
                break
            aside[key(t)] = found
            right = "a right record remains" if len(found) < len(recs) else \
                "no right record: the kernel keeps its default schedule"
            say(f"{t.name}: {len(found)} wrong record(s) set aside, {right}; "
                f"{found[0][1] if found else ''}")
        total += move_aside(log, aside)
