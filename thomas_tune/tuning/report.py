"""What a tuning run reports: per-task progress, throughput and where its time went."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tqdm import tqdm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..files import write_json_atomically


@dataclass
class TaskProgress:
    name: str
    flops: float
    trials: int = 0
    errors: int = 0
    best_s: float = math.inf
    last_error: str = ""
    #: the first failure's reason, kept beside the last one
    first_error: str = ""
    #: records of the task's workload in the tuning log (all runs), and the trials among them,
    #: in log order, until its best time was within 95% of its final best time (the best
    #: record's speed) and, where its default schedule's time is known, until 95% of the gain
    #: over it (:func:`trials_to_95`)
    records: int = 0
    to95: int | None = None
    to95_gain: int | None = None
    #: the default schedule's time (s per call) where it was timed: an export keeps the default
    #: where no record beats it
    default_s: float | None = None

    @property
    def gflops(self) -> float:
        return self.flops / self.best_s / 1e9 if self.best_s < math.inf else 0.0


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """A tqdm bar over all trials: per measured batch, the task's best time (ms) and GFLOP/s;
    tqdm's own estimate gives the time left."""

    def __init__(self, tasks: list[TaskProgress], total: int, disable: bool = False,
                 tick=None):
        self.tasks = tasks
        self.tick = tick
        self.bar = tqdm(total=total, unit="trial", disable=disable, dynamic_ncols=True)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        t = self.tasks[task_id]
        for b, r in zip(builder_results, runner_results):
            t.trials += 1
            if b.error_msg is not None or r.error_msg is not None or not r.run_secs:
                t.errors += 1
                t.last_error = str(b.error_msg or r.error_msg or "no run time")
                t.first_error = t.first_error or t.last_error
                continue
            secs = sum(float(s) for s in r.run_secs) / len(r.run_secs)
            t.best_s = min(t.best_s, secs)
        self.bar.update(len(runner_results))
        self.bar.set_postfix_str(f"{t.name[:28]} best {t.best_s * 1e3:.3f} ms "
                                 f"{t.gflops:.2f} GFLOP/s")
        if self.tick is not None:
            self.tick()


#: the tuning thread's phases outside search, builds and waiting for the device, in the order
#: of :meth:`TuneReport.time_split`: ``refine`` (the refinement stages before and after the
#: search, less their builds), ``cost_model`` (the XGBoost model's update after each batch:
#: feature extraction, and its training where that runs on the tuning thread), ``references``
#: (scheduling each task's default kernel, the reference its candidates are checked against,
#: less its build)
OWN_PHASES = ("refine", "cost_model", "references")


@dataclass
class TuneReport:
    """Per task: trials measured now, failures, best time; ``skipped``: duplicates not re-run."""

    tasks: list[TaskProgress] = field(default_factory=list)
    skipped: int = 0
    #: candidates drawn at random from a task's design spaces when its search proposed only
    #: measured schedules (:class:`ResumingSearch`)
    drawn: int = 0
    #: candidates proposed by the local search near the tasks' best records
    local: int = 0
    resumed_records: int = 0
    #: of ``resumed_records``, those replayed at the start (the others' schedule hashes were
    #: kept in the log folder: :meth:`thomas_tune.logs.TuningLog.measured`)
    replayed_records: int = 0
    #: seconds from the log's opening to the first search: records read and replayed, spaces
    startup_s: float = 0.0
    #: candidates whose unroll limit was lowered to ``max_unroll`` (bred from records over it)
    clamped: int = 0
    elapsed_s: float = 0.0
    phases: dict = field(default_factory=dict)
    #: share (0..1) of this machine's CPU time (all cores, all processes) that was busy during
    #: the run, from ``/proc/stat``; None where the system does not have it
    cpu_busy: float | None = None
    #: the unroll refinement after the search (:func:`refine_unroll`): candidates measured,
    #: failed, better than their task's best before it, and its wall seconds
    refined: dict = field(default_factory=dict)
    #: :func:`refine_padding`'s result (before the search)
    padded: dict = field(default_factory=dict)
    #: :func:`refine_transfer`'s result (before the search, before :func:`refine_padding`)
    transferred: dict = field(default_factory=dict)
    #: :func:`.seeding.refine_seeds`'s result (``tune --seed-log``; first, before the search)
    seeded: dict = field(default_factory=dict)
    #: tasks whose evolutionary search raised (name -> the error): their search ended there
    search_failed: dict = field(default_factory=dict)
    #: how the run ended: "running" (a write while it runs), "finished", "stopped by SIGINT" or
    #: "stopped by SIGTERM" (the figures are those up to the stop), or "failed: " and the error
    ended: str = "running"

    @property
    def trials(self) -> int:
        return sum(t.trials for t in self.tasks)

    @property
    def errors(self) -> int:
        """Trials of this run that failed (build, run, or wrong result)."""
        return sum(t.errors for t in self.tasks)

    def failure(self, max_share: float) -> str | None:
        """None when at most ``max_share`` (0..1) of this run's trials failed; else what
        failed: the count, the share, and the first reasons of up to three tasks. A run that
        measured no trial has not failed."""
        if not self.trials or self.errors <= max_share * self.trials:
            return None
        firsts = [f"{t.name}: {t.first_error}" for t in self.tasks if t.first_error][:3]
        return (f"{self.errors} of {self.trials} trials failed ({self.errors / self.trials:.0%}, "
                f"more than {max_share:.0%}); first errors: " + " | ".join(firsts))

    @property
    def wrong(self) -> int:
        """Trials whose outputs differed from their task's reference (not timed)."""
        return int(self.phases.get("counts", {}).get("run.wrong", 0))

    @property
    def trials_per_s(self) -> float:
        return self.trials / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        """Wall seconds of the run on the host's tuning thread, by phase: ``search``
        (evolutionary search), ``build`` (candidate builds), ``wait_device`` (waiting for
        measurements), ``refine``, ``cost_model`` (:data:`OWN_PHASES`), ``other`` (the rest:
        records to the tuning log, the task scheduler, Python's and MetaSchedule's glue); and
        ``lanes_busy``: the share (0..1) of the device servers' time spent on trials, which
        run while the host searches and builds (:class:`.task_scheduler.PipelinedGradient`),
        and ``lanes_idle``: the share they waited with no trial queued for them (the rest is
        opening sessions)."""
        wall = self.phases.get("wall_s", {})
        busy = self.phases.get("busy_s", {})
        search, build = wall.get("search", 0.0), wall.get("build", 0.0)
        wait = wall.get("wait_device", 0.0)
        own = {k: wall.get(k, 0.0) for k in OWN_PHASES}
        lanes = max(1, int(self.phases.get("lanes", 1)))
        return {"total": self.elapsed_s, "search": search, "build": build,
                "wait_device": wait, **own,
                "other": max(0.0, self.elapsed_s - search - build - wait
                             - sum(own.values())),
                "lanes_busy": (busy.get("run.trial", 0.0) / (lanes * self.elapsed_s)
                               if self.elapsed_s > 0 else 0.0),
                "lanes_idle": (busy.get("run.idle", 0.0) / (lanes * self.elapsed_s)
                               if self.elapsed_s > 0 else 0.0)}

    def as_dict(self) -> dict:
        """The report as JSON-ready data: trials, trials/s, time split (s), phase counters
        and per task trials, failures, best time (ms) and GFLOP/s."""
        return {"trials": self.trials, "elapsed_s": self.elapsed_s,
                "trials_per_s": self.trials_per_s, "split_s": self.time_split(),
                "phases": self.phases, "cpu_busy": self.cpu_busy, "refined": self.refined,
                "padded": self.padded, "transferred": self.transferred,
                "seeded": self.seeded,
                "search_failed": self.search_failed,
                "resumed_records": self.resumed_records,
                "replayed_records": self.replayed_records, "startup_s": self.startup_s,
                "clamped": self.clamped,
                "skipped": self.skipped, "drawn": self.drawn, "local": self.local,
                "ended": self.ended,
                "wrong": self.wrong,
                "tasks": [{"name": t.name, "trials": t.trials, "errors": t.errors,
                           "best_ms": t.best_s * 1e3 if t.best_s < math.inf else None,
                           "default_ms": (t.default_s * 1e3 if t.default_s is not None
                                          else None),
                           "gflops": t.gflops, "records": t.records,
                           "trials_to_95pct": t.to95, "trials_to_95pct_gain": t.to95_gain}
                          for t in self.tasks]}

    def write(self, path: str) -> None:
        """Write :meth:`as_dict` as JSON to ``path`` (atomically: a reader never sees half)."""
        write_json_atomically(path, self.as_dict())

    def throughput_line(self) -> str:
        """One line: trials/s and where the time went (s and share)."""
        split = self.time_split()
        total = split["total"] or 1.0
        busy = self.phases.get("busy_s", {})
        parts = ", ".join(f"{k} {v:.0f} s ({100 * v / total:.0f}%)" for k, v in split.items()
                          if k not in ("total", "lanes_busy", "lanes_idle"))
        parts += (f"; device servers busy {100 * split['lanes_busy']:.0f}% of the time, idle "
                  f"with no trial queued {100 * split['lanes_idle']:.0f}%")
        if self.cpu_busy is not None:
            parts += f"; this machine's CPUs busy {100 * self.cpu_busy:.0f}%"
        inner = ", ".join(f"{k.split('.', 1)[1]} {v:.1f}" for k, v in sorted(busy.items())
                          if k.startswith("run.") and k not in ("run.trial", "run.idle"))
        return (f"{self.trials} trials in {split['total']:.0f} s = {self.trials_per_s:.2f} "
                f"trials/s, {self.wrong} with a wrong result (not timed); {parts}; "
                f"per-trial device-side seconds summed: {inner}")


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of this machine since boot, all cores together, in clock ticks
    (``/proc/stat``'s first line; idle and iowait count as not busy; proc(5)); None where the
    file cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:8]]  # user nice system idle iowait irq softirq
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def trials_to_95(times_s: list[float], default_s: float | None = None
                 ) -> tuple[int | None, int | None]:
    """Trials until a task converged, from its records' mean run times ``times_s`` (s; in the
    order they were measured, a failed trial as ``inf``): ``(n, g)`` where ``n`` is the first
    count of trials whose best time is within 95% of the final best (best <= final / 0.95: 95%
    of the final speed) and ``g``, with ``default_s`` (the default schedule's time, s), the
    first count whose gain over it is 95% of the final gain (default - best >= 0.95 x
    (default - final), as the tuning curve of ``thomas-tune bench`` counts it for a step).
    Each is None where it does not apply: no valid record; no gain over the default."""
    finite = [t for t in times_s if math.isfinite(t)]
    if not finite:
        return None, None
    final = min(finite)
    n = g = None
    best = math.inf
    gain = (default_s - final) if default_s is not None and math.isfinite(default_s) else 0.0
    for i, t in enumerate(times_s, 1):
        best = min(best, t)
        if n is None and best <= final / 0.95:
            n = i
        if g is None and gain > 0 and default_s - best >= 0.95 * gain:
            g = i
    return n, g


def convergence(tasks: list[TaskProgress], database, mods: list, default_ms: list) -> None:
    """Set each task's ``records``, ``to95`` and ``to95_gain`` (:func:`trials_to_95`) from its
    workload's records in ``database`` (a :class:`thomas_tune.logs.LogDatabase`), in log order;
    ``mods[i]`` and ``default_ms[i]`` (ms or None) are task ``i``'s workload and default time."""
    for t, mod, d in zip(tasks, mods, default_ms):
        times = database.times_in_order(mod)
        t.records = len(times)
        t.to95, t.to95_gain = trials_to_95(times, d / 1e3 if d is not None else None)
