"""Tuning: MetaSchedule over an RPC tracker, with the XGBoost cost model and evolutionary search.

Each task's candidates are built locally (:class:`thomas_tune.runner.Builder`) and measured on the
device servers that the tracker hands out for the device key (:class:`thomas_tune.runner.FarmRunner`). Records go to the tuning log as they arrive (one line per trial, see
:mod:`thomas_tune.tuning_log`). A run on an existing log resumes: MetaSchedule's evolutionary
search only de-duplicates within one run, so :class:`ResumingSearch` drops every candidate whose
schedule is already in the log before it is built, and the new run measures only new ones.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tqdm import tqdm
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object

from .kernel_check import build_references, default_kernel
from .runner import Builder, FarmRunner, Phases, error_line
from .schedules import (UNROLL_STEPS, anchor_key, before_postproc, plain_json, postprocessed,
                         space_generator, transferred, unroll_steps, with_padding_in_fill,
                         with_unroll, within_unroll)
from .tasks import Task
from .tasks import key as workload_key
from .tuning_log import FAILED_RUN_S, TrialErrors, TuningLog, mean_run_seconds


@derived_object
class UnrollLimitedView(ms.database.PyDatabase):
    """The tuning log as the search of a run with ``--max-unroll`` reads it: each record that
    :meth:`get_top_k` hands out has its sampled unroll limit lowered to the largest of
    ``allowed`` where it is over it, and its choice narrowed to ``allowed``
    (:func:`~thomas_tune.schedules.within_unroll`). Everything else goes to ``inner`` unchanged.

    MetaSchedule's evolutionary search starts each round from the best records of the log;
    without this view the candidates it breeds from records tuned with limits of 512 and 1024
    keep those limits, and each had to be lowered and post-processed again one at a time
    (:meth:`ResumingSearch._clamp`): 45 of 46 candidates of a round on AlexNet's slowest
    convolution, 16-29% of a round's time on 2 cores. A record is changed once (the result is
    kept)."""

    def __init__(self, inner: ms.Database, allowed: list[int]):
        self.inner, self.allowed = inner, [int(a) for a in allowed]
        self.cache: dict[str, ms.database.TuningRecord] = {}
        self.lowered = 0  # records handed out whose limit was over the largest allowed

    def _limited(self, rec):
        try:
            trace = plain_json(rec.trace.as_json())
        except TypeError:  # an object with no JSON form: no sampled limit
            return rec
        key = json.dumps(trace)
        if key in self.cache:
            return self.cache[key]
        out = rec
        lowered, limit = within_unroll(trace, self.allowed)
        if lowered is not None:
            sch = tvm.s_tir.Schedule(rec.workload.mod)
            try:
                tvm.s_tir.schedule.Trace.apply_json_to_schedule(lowered, sch)
                out = ms.database.TuningRecord(sch.trace, rec.workload, rec.run_secs,
                                               rec.target, rec.args_info)
                self.lowered += limit > self.allowed[-1]
            except Exception:  # a trace that no longer applies: the search drops it too
                pass
        self.cache[key] = out
        return out

    def get_top_k(self, workload, top_k):
        return [self._limited(r) for r in self.inner.get_top_k(workload, top_k)]

    def has_workload(self, mod):
        return self.inner.has_workload(mod)

    def commit_workload(self, mod):
        return self.inner.commit_workload(mod)

    def commit_tuning_record(self, record):
        self.inner.commit_tuning_record(record)

    def get_all_tuning_records(self):
        return self.inner.get_all_tuning_records()

    def query_tuning_record(self, mod, target, workload_name):
        return self.inner.query_tuning_record(mod, target, workload_name)

    def query_schedule(self, mod, target, workload_name):
        return self.inner.query_schedule(mod, target, workload_name)

    def query_ir_module(self, mod, target, workload_name):
        return self.inner.query_ir_module(mod, target, workload_name)

    def __len__(self):
        return len(self.inner)


@derived_object
class OnceSpaces(ms.space_generator.PySpaceGenerator):
    """A task's design-space generator (``inner``) that generates its spaces once per module.

    The tuner generates each task's spaces before the run, to leave out a task whose rules
    fail on its kernel (MetaSchedule would end the whole run), and MetaSchedule's task
    scheduler generates them again when the run starts: on the H100, MobileNetV2's 120 tasks
    spent 24 s of the tuning thread in that second generation (a py-spy profile of the
    tuner; the README's nineteenth run). The spaces are kept from the first call and handed
    out again for the same module (clones share them)."""

    def __init__(self, inner: ms.SpaceGenerator, cache: dict | None = None):
        self.inner = inner
        self.sch_rules, self.postprocs = inner.sch_rules, inner.postprocs
        self.mutator_probs = inner.mutator_probs
        self.cache = cache if cache is not None else {}

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)

    def generate_design_space(self, mod):
        key = tvm_ffi.structural_hash(mod)
        if key not in self.cache:
            self.cache[key] = list(self.inner.generate_design_space(mod))
        return self.cache[key]

    def clone(self):
        return OnceSpaces(self.inner, self.cache)


def cost_model(phases: Phases, threads: int | None = None):
    """The tuner's cost model: MetaSchedule's XGBoost model (features: ``PerStoreFeature``;
    Chen et al. 2018, "Learning to Optimize Tensor Programs") training on ``threads`` threads
    (default a quarter of this machine's cores, at least 1). Its updates (feature extraction
    after each measured batch; a new booster trained from scratch on all the run's data
    whenever that has grown by a fifth) run on the tuning thread, and their wall seconds go to
    ``phases`` as ``cost_model``.

    MetaSchedule's default gives XGBoost every core, beside the build processes and the device
    servers' compilers: on the H100 (16 cores, 8 build processes, 12 servers) the updates took
    70 of 241 s of a MobileNetV2 run, and the same trainings took 9.8 s on 4 threads (README,
    nineteenth run). Training in a background thread instead made a SIGINT during the run end
    the process in ``std::terminate`` (``tests/test_faults.py::test_tuner_killed_and_restarted``),
    so the updates stay on the tuning thread."""
    threads = threads or max(1, (os.cpu_count() or 4) // 4)
    model = ms.cost_model.XGBModel(num_tuning_cores=threads)
    inst = model._inst  # the Python object behind MetaSchedule's cost model
    update = inst.update

    def timed_update(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return update(*args, **kwargs)
        finally:
            phases.add("cost_model", time.perf_counter() - t0, wall=True)

    inst.update = timed_update
    return model


@derived_object
class ResumingSearch(ms.search_strategy.PySearchStrategy):
    """Evolutionary search that never proposes a schedule measured before (in this run or in the
    tuning log it resumes). ``skipped`` counts the candidates dropped as already measured.

    When ``max_empty_rounds`` rounds running propose only measured schedules, the search
    draws fresh candidates at random from the task's design spaces (their traces replayed with
    new decisions, then the postprocessors) before it gives up: up to one batch, none measured
    before; ``drawn`` counts them. A task resumed from a long log needs this. On the H100
    (README's twenty-fourth run) such searches ended after 34-146 trials each, among them the
    first linear layer's forward pass of AlexNet (0.12 ms per step), and the rest of the run's
    budget went to a kernel of 0.006 ms.

    An error of the evolutionary search itself (a mutator or postprocessor that fails on a
    design space: on the H100, a space whose cooperative-fetch annotation was a constant made
    every later round of its task raise in MetaSchedule's thread pool, which ended the whole
    run) ends that task's search only: ``failed`` maps its name to the error, the tuner says so
    on stderr and in its report, and the other tasks go on."""

    #: draws tried per candidate wanted (a draw the postprocessors reject, or one measured
    #: before, is tried again)
    DRAW_TRIES = 8

    def __init__(self, measured: set[int] | None = None, max_empty_rounds: int = 8,
                 phases: Phases | None = None, max_unroll: int | None = None,
                 counts: dict[str, int] | None = None, failed: dict[str, str] | None = None,
                 **kwargs):
        self.inner = ms.search_strategy.EvolutionarySearch(**kwargs)
        self.kwargs = kwargs
        # MetaSchedule searches with a clone, whose Python object cannot be reached from the
        # tune context: the clone shares this set and these counts with the object made here
        self.measured = measured if isinstance(measured, set) else set(measured or ())
        self.max_empty_rounds = max_empty_rounds
        self.phases = phases
        self.max_unroll = max_unroll
        self.postprocs, self.mod = [], None
        #: ``skipped``: candidates dropped as already measured; ``clamped``: candidates whose
        #: unroll limit, inherited from a record of the tuning log, was over ``max_unroll`` and
        #: was lowered to the largest allowed
        self.counts = counts if counts is not None else {"skipped": 0, "clamped": 0,
                                                          "drawn": 0}
        self.failed = failed if failed is not None else {}
        self.task_name = None
        self.spaces: list = []  # the design spaces' traces, without decisions or postprocessing
        self.batch = 0
        self.rng = random.Random(0)  # (seeded from the tune context's random state)

    @property
    def skipped(self) -> int:
        return self.counts["skipped"]

    @property
    def clamped(self) -> int:
        return self.counts["clamped"]

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)
        self.postprocs = list(context.space_generator.postprocs or [])
        self.mod = context.mod
        self.task_name = context.task_name
        self.rng = random.Random(int(context.rand_state))

    def _clamp(self, cand):
        """``cand`` with its unroll limit lowered to ``max_unroll`` where it is over it (a
        candidate bred from a record tuned without the limit), or None if the postprocessors
        reject the result."""
        trace = cand.sch.trace
        if trace is None:
            return cand
        try:
            body = plain_json(trace.as_json())
        except TypeError:  # an object with no JSON form: no sampled limit
            return cand
        lowered, limit = within_unroll(body, unroll_steps(self.max_unroll))
        if limit is None or limit <= self.max_unroll:
            return cand
        sch = postprocessed(self.mod, lowered, self.postprocs)
        if sch is None:
            return None
        self.counts["clamped"] += 1
        return ms.MeasureCandidate(sch, cand.args_info)

    @property
    def drawn(self) -> int:
        return self.counts["drawn"]

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None,
                   cost_model=None) -> None:
        self.batch = int(num_trials_per_iter)
        self.spaces = []
        for space in design_spaces:
            try:
                insts, _ = before_postproc(*plain_json(space.trace.as_json()))
            except TypeError:  # an object with no JSON form: not drawn from
                continue
            self.spaces.append([insts, []])
        if self.max_unroll is not None and database is not None:
            database = UnrollLimitedView(database, unroll_steps(self.max_unroll))
        self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database,
                              cost_model)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def generate_measure_candidates(self):
        t0 = time.perf_counter()
        try:
            return self._fresh_candidates()
        finally:
            if self.phases is not None:
                self.phases.add("search", time.perf_counter() - t0, wall=True)

    def _fresh_candidates(self):
        for _ in range(self.max_empty_rounds):
            try:
                cands = self.inner.generate_measure_candidates()
            except Exception as err:  # noqa: BLE001 (TVM raises RuntimeError, TypeError, ...)
                reason = error_line(err, 300)
                self.failed[str(self.task_name)] = reason
                print(f"task {self.task_name}: its search failed ({reason}); it keeps the "
                      "records it has, the other tasks go on", file=sys.stderr, flush=True)
                return None  # MetaSchedule ends the task
            if cands is None:
                return None
            fresh = []
            for c in cands:
                if self.max_unroll is not None:
                    c = self._clamp(c)
                    if c is None:
                        continue
                h = tvm_ffi.structural_hash(c.sch.mod)
                if h in self.measured:
                    self.counts["skipped"] += 1
                else:
                    self.measured.add(h)
                    fresh.append(c)
            if fresh:
                return fresh
        return self._drawn_candidates() or None

    def _drawn_candidates(self) -> list:
        """Up to one batch of candidates drawn at random from the design spaces, none measured
        before (see the class docstring)."""
        if not self.spaces or self.mod is None:
            return []
        args_info = ms.arg_info.ArgInfo.from_prim_func(self.mod["main"])
        want, out = max(1, self.batch), []
        for _ in range(self.DRAW_TRIES * want):
            if len(out) >= want:
                break
            sch = postprocessed(self.mod, self.rng.choice(self.spaces), self.postprocs,
                                seed=self.rng.randrange(1, 1 << 30))
            if sch is None:
                continue
            h = tvm_ffi.structural_hash(sch.mod)
            if h in self.measured:
                self.counts["skipped"] += 1
                continue
            self.measured.add(h)
            out.append(ms.MeasureCandidate(sch, args_info))
        self.counts["drawn"] += len(out)
        return out

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.inner.notify_runner_results(measure_candidates, results)

    def clone(self):
        return ResumingSearch(self.measured, self.max_empty_rounds, self.phases,
                              self.max_unroll, self.counts, self.failed, **self.kwargs)


@dataclass
class TaskProgress:
    name: str
    flops: float
    trials: int = 0
    errors: int = 0
    best_s: float = math.inf
    last_error: str = ""

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
#: (building each task's default schedule, the reference its candidates are checked against)
OWN_PHASES = ("refine", "cost_model", "references")


@dataclass
class TuneReport:
    """Per task: trials measured now, failures, best time; ``skipped``: duplicates not re-run."""

    tasks: list[TaskProgress] = field(default_factory=list)
    skipped: int = 0
    #: candidates drawn at random from a task's design spaces when its search proposed only
    #: measured schedules (:class:`ResumingSearch`)
    drawn: int = 0
    resumed_records: int = 0
    #: of ``resumed_records``, those replayed at the start (the others' schedule hashes were
    #: kept in the log folder: :meth:`thomas_tune.tuning_log.TuningLog.measured`)
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
    #: tasks whose evolutionary search raised (name -> the error): their search ended there
    search_failed: dict = field(default_factory=dict)
    #: how the run ended: "running" (a write while it runs), "finished", "stopped by SIGINT" or
    #: "stopped by SIGTERM" (the figures are those up to the stop), or "failed: " and the error
    ended: str = "running"

    @property
    def trials(self) -> int:
        return sum(t.trials for t in self.tasks)

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
        run while the host searches and builds (:class:`thomas_tune.scheduler.PipelinedGradient`),
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
                "search_failed": self.search_failed,
                "resumed_records": self.resumed_records,
                "replayed_records": self.replayed_records, "startup_s": self.startup_s,
                "clamped": self.clamped,
                "skipped": self.skipped, "drawn": self.drawn, "ended": self.ended,
                "wrong": self.wrong,
                "tasks": [{"name": t.name, "trials": t.trials, "errors": t.errors,
                           "best_ms": t.best_s * 1e3 if t.best_s < math.inf else None,
                           "gflops": t.gflops} for t in self.tasks]}

    def write(self, path: str) -> None:
        """Write :meth:`as_dict` as JSON to ``path`` (atomically: a reader never sees half)."""
        import json
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
        os.replace(tmp, path)

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


def rpc_runner(tracker: tuple[str, int], key: str, servers: int | None = None,
               trial_timeout_s: float = 20.0, compile_timeout_s: float = 30.0, repeat: int = 3,
               min_repeat_ms: float = 2.0, wait_s: float = 60.0, **kwargs) -> FarmRunner:
    """The runner over device servers of ``key`` on ``tracker`` (see
    :class:`thomas_tune.runner.FarmRunner`): ``servers`` measure in parallel (default: those
    free at the start), each trial is ``repeat`` repeats of about ``min_repeat_ms`` ms, a trial
    whose timed runs take over ``trial_timeout_s`` s, or whose OpenCL build on the device takes
    over ``compile_timeout_s`` s, is recorded as an error, and trials wait at most ``wait_s`` s
    when no server of the key can be had."""
    return FarmRunner(tracker, key, lanes=servers, trial_timeout_s=trial_timeout_s,
                      compile_timeout_s=compile_timeout_s,
                      repeat=repeat, min_repeat_ms=min_repeat_ms, wait_s=wait_s, **kwargs)


def tune(tasks: list[Task], target, log: TuningLog, runner: ms.Runner, trials: int,
         trials_per_iter: int = 8, builder_workers: int | None = None, seed: int = 0,
         population: int = 128, show_progress: bool = True, stats_path: str | None = None,
         stats_every_s: float = 30.0, default_s: dict[str, float] | None = None,
         max_in_flight: int = 3, max_unroll: int | None = None,
         refine_top: int = 2, genetic_iters: int = 2, check: bool = True) -> TuneReport:
    """Tune ``tasks`` for ``target`` with ``trials`` measurements in all, appending to ``log``.

    The gradient task scheduler (Zheng et al. 2020, "Ansor", section 6) spends the budget where
    it shortens the graph's total time most (weights are the call counts). ``population``: the
    evolutionary search's population per round (MetaSchedule's default is 512, sized for large
    hosts; each member is scored by the cost model on this machine) and ``genetic_iters`` its
    rounds of mutation per batch (MetaSchedule's default is 4): the search's host time per
    batch grows with their product (on AlexNet's slowest convolution with population 96 and 2
    iterations, 2/3 of a round's time went to mutations and their cost-model scores, and a
    round took 12 s on 2 cores for 48 candidates). With ``stats_path``, the
    report (:meth:`TuneReport.as_dict`: trials/s, time split) is written there every
    ``stats_every_s`` seconds while tuning and once at the end, also where SIGINT or SIGTERM
    stopped the run (its ``ended`` says how the run ended). Task choice and pipelining:
    :class:`thomas_tune.scheduler.PipelinedGradient`, with up to ``max_in_flight`` batches
    measured while the next one is searched and built, and each task's gradient starting from
    its default-schedule time in ``default_s`` (``{workload key: seconds per call}``, from
    :func:`measure_defaults`) where known, and from its best record where ``log`` has one
    (such a task gets no first-round batch). ``max_unroll`` limits the unrolled steps the
    search chooses among (:func:`thomas_tune.schedules.unroll_steps`; None: all of
    :data:`~thomas_tune.schedules.UNROLL_STEPS`): candidates build and compile faster. Where it
    leaves larger steps out, the ``refine_top`` best records of each task are measured again
    with each larger step after the search (:func:`refine_unroll`; these trials come on top of
    ``trials``). Raises ValueError for
    an empty task list or a budget smaller than one round over the tasks, and
    :class:`thomas_tune.tuning_log.LogInUse` when another tuner holds ``log``. Failed trials
    are appended with their reason to ``trial_errors.jsonl`` in the log folder.

    ``check``: every candidate's outputs are compared on the device with its task's default
    schedule on the same inputs before its time enters the log (:mod:`thomas_tune.kernel_check`;
    a wrong one is a failed trial "wrong result: ..."). False only to measure what the check
    costs: unchecked candidates can put wrong kernels into the log.
    """
    if not tasks:
        raise ValueError("no task to tune")
    unroll_steps(max_unroll)  # a limit below 16 fails here, before the log is locked
    if refine_top < 0:
        raise ValueError(f"refine_top {refine_top} is negative; give 0 (no refinement) or more")
    if genetic_iters < 1 or population < 2:
        raise ValueError(f"genetic_iters {genetic_iters} and population {population}: the "
                         "search needs at least 1 round of mutation and 2 members")
    if trials < len(tasks):
        raise ValueError(f"--trials {trials} is below one trial per task ({len(tasks)} tasks); "
                         "raise --trials or tune fewer tasks (--top)")
    with log.lock("tuning"):  # one tuner per log: a second one is refused (LogInUse)
        return _tune_locked(tasks, target, log, runner, trials, trials_per_iter,
                            builder_workers, seed, population, show_progress, stats_path,
                            stats_every_s, default_s or {}, max_in_flight, max_unroll,
                            refine_top, genetic_iters, check)


def search_context(task: Task, target, measured: set[int], population: int,
                   genetic_iters: int, max_unroll: int | None, seed: int,
                   phases: Phases | None = None):
    """The tune context and search strategy (:class:`ResumingSearch`) of one task as
    :func:`tune` searches it: ``measured``, the structural hashes of its schedules already in
    the tuning log; ``population`` and ``genetic_iters``, the evolutionary search's size (a
    quarter of the population, at least 8, is drawn fresh each round); ``max_unroll``, the
    unroll limit (:func:`thomas_tune.schedules.unroll_steps`); ``seed``, the context's random
    state. The search runs on every core. Returns ``(context, strategy)``."""
    strategy = ResumingSearch(measured, phases=phases, max_unroll=max_unroll,
                              population_size=population,
                              init_min_unmeasured=max(8, population // 4),
                              genetic_num_iters=genetic_iters)
    ctx = ms.TuneContext(
        mod=task.mod, target=target,
        space_generator=OnceSpaces(space_generator(target, max_unroll)),
        search_strategy=strategy, task_name=task.name, rand_state=seed,
        num_threads=max(1, os.cpu_count() or 1))
    return ctx, strategy


def _tune_locked(tasks, target, log, runner, trials, trials_per_iter, builder_workers, seed,
                 population, show_progress, stats_path, stats_every_s, default_s,
                 max_in_flight, max_unroll, refine_top, genetic_iters, check) -> TuneReport:
    from .scheduler import PipelinedGradient

    t_open = time.perf_counter()
    database = log.database()
    report = TuneReport()
    phases = getattr(runner, "phases", None) or Phases()
    contexts, weights, progress, default_ms, tuned_ms = [], [], [], [], []
    strategies = []  # per context: the search strategy made here (shares state with its clone)
    errors = TrialErrors(log, [t.name for t in tasks])
    for i, task in enumerate(tasks):
        measured = log.measured(database, task.mod)
        report.resumed_records += len(measured)
        ctx, strategy = search_context(task, target, measured, population, genetic_iters,
                                       max_unroll, seed + i, phases)
        ctx = ctx.clone()
        try:  # a rule that fails on this kernel would otherwise stop the whole run
            ctx.generate_design_space()
        except Exception as err:  # TVM's ScheduleError and friends
            print(f"task {task.name}: no search space ({error_line(err, 200)}); it keeps its "
                  "default schedule", file=sys.stderr, flush=True)
            continue
        contexts.append(ctx)
        strategies.append(strategy)
        weights.append(float(task.weight))
        d = default_s.get(workload_key(task))
        default_ms.append(d * 1e3 if d is not None and math.isfinite(d) else None)
        best = log.best_seconds(database, task.mod) if measured else None
        tuned_ms.append(best * 1e3 if best is not None else None)
        progress.append(TaskProgress(task.name, task.flops))
    replayed = log.save_hashes()  # the next start replays only the records added after this
    report.replayed_records = replayed
    report.startup_s = time.perf_counter() - t_open
    if not contexts:
        raise ValueError("no task has a search space for this target (see the lines above)")
    report.tasks = progress
    t0 = time.perf_counter()
    last_write = [t0]
    cpu0 = cpu_jiffies()

    def cpu_share() -> float | None:
        now = cpu_jiffies()
        if cpu0 is None or now is None or now[1] <= cpu0[1]:
            return None
        return (now[0] - cpu0[0]) / (now[1] - cpu0[1])

    def tick() -> None:
        now = time.perf_counter()
        report.elapsed_s, report.phases = now - t0, phases.as_dict()
        report.cpu_busy = cpu_share()
        _search_totals(report, strategies)
        if stats_path and now - last_write[0] >= stats_every_s:
            report.write(stats_path)
            last_write[0] = now

    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), errors,
                 Progress(progress, trials, disable=not show_progress, tick=tick)]
    model = cost_model(phases)
    builder = Builder(max_workers=builder_workers or max(1, (os.cpu_count() or 2)),
                      timeout_s=60, phases=phases)
    # each task's default schedule, built once: the reference every candidate's outputs
    # are compared with on the device before its time enters the log (kernel_check)
    t_ref = time.perf_counter()
    references, ref_paths = (build_references([c.mod for c in contexts], target, builder, seed)
                             if check else ([None] * len(contexts), []))
    phases.add("references", time.perf_counter() - t_ref, wall=True)

    def refining(stage, *args, **kwargs) -> dict:
        """Run one refinement stage; its wall time less its builds goes to ``refine``."""
        t, b = time.perf_counter(), phases.wall.get("build", 0.0)
        try:
            return stage(*args, **kwargs)
        finally:
            built = phases.wall.get("build", 0.0) - b
            phases.add("refine", max(0.0, time.perf_counter() - t - built), wall=True)

    seen: list[int] = []
    # While MetaSchedule's loop runs, the first SIGINT/SIGTERM stops it from the task
    # scheduler (no new batch; those in flight are joined and logged), never by an exception
    # raised into its C++ frames: on the H100 such an exception ended 3 of 4 stops in
    # std::terminate, with no last statistics. A second signal, or one outside the loop, stops
    # as before (KeyboardInterrupt); the CLI's grace timer ends a stop that hangs.
    loop: dict = {"scheduler": None}

    def stop_softly(signum: int) -> bool:
        sched = loop["scheduler"]
        if sched is None or len(seen) > 1:
            return False
        sched.stopping = True
        return True

    restore_handlers = note_signals(seen, stop_softly)
    try:
        if refine_top > 0:
            report.transferred = refining(refine_transfer, contexts, progress, database,
                                          target, runner, builder, refine_top,
                                          log.workloads(), errors,
                                          [s.measured for s in strategies], references)
            r = report.transferred
            if show_progress and r["measured"]:
                print(_refinement_line(r, "schedules shared between kernels of one "
                                          f"contraction: {r['measured']} records of other "
                                          "workloads measured on their twins"),
                      file=sys.stderr, flush=True)
            report.padded = refining(refine_padding, contexts, progress, database, target,
                                     runner, builder, refine_top, errors,
                                     [s.measured for s in strategies], references)
            r = report.padded
            if show_progress and r["measured"]:
                print(_refinement_line(r, f"padding out of the inner loop: {r['measured']} "
                                          "best records measured with their padding in the "
                                          "shared fill"), file=sys.stderr, flush=True)
        loop["scheduler"] = PipelinedGradient(default_ms, max_in_flight=max_in_flight,
                                              seed=seed, phases=phases, tuned_ms=tuned_ms,
                                              on_task=lambda i: runner.expect(references[i]))
        try:
            ms.tune_tasks(
                tasks=contexts, task_weights=weights, work_dir=log.path,
                max_trials_global=trials, num_trials_per_iter=trials_per_iter,
                builder=builder, runner=runner, database=database, cost_model=model,
                measure_callbacks=callbacks, task_scheduler=loop["scheduler"])
        finally:
            loop["scheduler"] = None
        if seen:  # the loop ended at a signal: the run stops here
            raise KeyboardInterrupt
        larger = [s for s in UNROLL_STEPS if s not in unroll_steps(max_unroll)]
        if larger and refine_top > 0:
            report.refined = refining(refine_unroll, contexts, progress, database, target,
                                      runner, builder, larger, refine_top, errors,
                                      [s.measured for s in strategies], references)
            if show_progress:
                r = report.refined
                print(_refinement_line(r, f"unroll refinement: {r['measured']} candidates "
                                          f"with unroll steps {larger} measured"),
                      file=sys.stderr, flush=True)
        report.ended = "finished"
    except BaseException as err:
        # a signal's KeyboardInterrupt can come out of MetaSchedule's C++ loop as another
        # error (a RuntimeError with no message): the signals seen tell a stop from a failure
        stop = seen[0] if seen else (signal.SIGINT if isinstance(err, KeyboardInterrupt)
                                     else None)
        report.ended = (f"stopped by {signal.Signals(stop).name}" if stop is not None
                        else f"failed: {type(err).__name__}: {error_line(err, 300)}")
        raise
    finally:
        restore_handlers()
        callbacks[-1].bar.close()
        builder.shutdown()
        for path in ref_paths:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        if hasattr(runner, "shutdown"):
            runner.shutdown()
        # the last statistics, also for a run that a signal stopped
        report.elapsed_s = time.perf_counter() - t0
        report.phases = phases.as_dict()
        report.cpu_busy = cpu_share()
        _search_totals(report, strategies)
        if stats_path:
            report.write(stats_path)
    return report


def note_signals(seen: list[int], soft=None):
    """From now on, append to ``seen`` each SIGINT or SIGTERM that reaches this process's
    Python handler for it; the handler then runs as before, except that the KeyboardInterrupt
    it raises is dropped where ``soft(signum)`` (called first) returns True: the caller stops
    by other means. Returns the function that puts the handlers back. Signals whose handler is
    not a Python function (SIGTERM's default ends the process) are left alone, as is every
    signal when called off the main thread (only that thread can set handlers)."""
    kept = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if callable(prev):
                def noting(signum, frame, prev=prev):
                    seen.append(signum)
                    quiet = soft is not None and soft(signum)
                    try:
                        return prev(signum, frame)
                    except KeyboardInterrupt:
                        if not quiet:
                            raise
                kept[sig] = prev
                signal.signal(sig, noting)

    def restore() -> None:
        for sig, prev in kept.items():
            signal.signal(sig, prev)
    return restore


def _search_totals(report: TuneReport, strategies: list[ResumingSearch]) -> None:
    """Copy what the tasks' search strategies counted into ``report``: candidates skipped as
    measured, drawn at random, unroll limits clamped, searches that failed."""
    report.skipped = sum(s.skipped for s in strategies)
    report.drawn = sum(s.drawn for s in strategies)
    report.clamped = sum(s.clamped for s in strategies)
    report.search_failed = {k: v for s in strategies for k, v in s.failed.items()}


def _refinement_line(result: dict, what: str) -> str:
    """One line on a refinement's result (:func:`_measure_variants`'s dict) after ``what``
    (what was measured): its wall seconds, failures and tasks that got faster."""
    return (f"{what} in {result['seconds']:.0f} s ({result['failed']} failed); "
            f"{result['better']} task(s) got a faster best record")


def refine_unroll(contexts, progress: list[TaskProgress], database: ms.Database, target,
                  runner, builder: Builder, steps: list[int], top_k: int,
                  errors: TrialErrors | None = None,
                  measured: list[set[int]] | None = None, references=None) -> dict:
    """Measure the ``top_k`` best records of each task of ``contexts`` again with each unroll
    limit of ``steps`` (:func:`thomas_tune.schedules.with_unroll`; the task's postprocessors
    are applied, a candidate they reject is left out), and add the results to ``database``.

    The search may run with small unroll limits, whose candidates build and compile several
    times faster; this gives the best schedules it found the larger limits that often make a
    kernel faster still (``experiments/compile_cost.py``). Candidates already measured (in the log
    or this run: ``measured``, per context, the structural hashes of its measured schedules,
    which gets the new ones) are skipped. Failed ones are committed as MetaSchedule commits a
    failed trial (run time :data:`~thomas_tune.tuning_log.FAILED_RUN_S`) and their reasons go
    to ``errors``. ``references`` (per context, its
    :class:`~thomas_tune.kernel_check.Reference`): each candidate's outputs are checked
    against its task's before it is timed (:func:`measure_kernels`).
    ``progress`` (per context) gets the trials, errors and best times. Returns ``{"measured",
    "failed", "better", "seconds"}``: candidates measured, failed, tasks whose best record
    got faster, wall seconds."""
    def variants(ctx, body):
        return [t for t in (with_unroll(body, step) for step in steps) if t is not None]

    return _measure_variants(contexts, progress, database, target, runner, builder,
                             _own_variants(database, top_k, variants), errors, measured,
                             references)


def refine_padding(contexts, progress: list[TaskProgress], database: ms.Database, target,
                   runner, builder: Builder, top_k: int, errors: TrialErrors | None = None,
                   measured: list[set[int]] | None = None, references=None) -> dict:
    """Measure the ``top_k`` best records of each task of ``contexts`` again with their padding
    moved out of the innermost loop into the copy that stages the padded operand in shared
    memory, or kept as a kernel of its own where nothing is staged
    (:func:`thomas_tune.schedules.with_padding_in_fill`: every other decision kept), and add
    the results to ``database``; tasks without padding fed into a contraction get nothing.
    Run before the search, so that a variant that wins seeds the evolutionary search from the
    database like any record. Arguments and result as :func:`refine_unroll`'s."""
    def variants(ctx, body):
        t = with_padding_in_fill(ctx.mod, body)
        return [] if t is None else [t]

    return _measure_variants(contexts, progress, database, target, runner, builder,
                             _own_variants(database, top_k, variants), errors, measured,
                             references)


def refine_transfer(contexts, progress: list[TaskProgress], database: ms.Database, target,
                    runner, builder: Builder, top_k: int, workloads: list[tvm.IRModule],
                    errors: TrialErrors | None = None,
                    measured: list[set[int]] | None = None, references=None) -> dict:
    """Measure the ``top_k`` best records of every other workload of ``workloads`` (the tuning
    log's, :meth:`~thomas_tune.tuning_log.TuningLog.workloads`) that shares a task's
    contraction (:func:`thomas_tune.schedules.anchor_key`) on that task, rewritten for its
    blocks (:func:`thomas_tune.schedules.transferred`), and add the results to ``database``.

    The same convolution or linear layer is a kernel with ReLU fused in the inference graph
    and in a graph whose layer is frozen, and one without it where the training step keeps the
    pre-activation for the backward pass; each is a workload of its own, tuned apart, and the
    searches end apart: on the H100 the best AlexNet record of ``conv1`` with ReLU took 0.225
    ms and the best without it 0.399 ms, with the same 7-loop nest to tile. Run before the
    search, so that a transfer that wins seeds the evolutionary search like any record. Only
    a twin's records faster on the twin than the task's best record on the task are tried
    (the twins' kernels differ by an element-wise epilogue). Arguments and result as
    :func:`refine_unroll`'s."""
    keys = {}
    for mod in workloads:
        key = anchor_key(mod)
        if key is not None:
            keys.setdefault(key, []).append(mod)

    def candidates(c, ctx, workload, best_s):
        key = anchor_key(ctx.mod)
        own = tvm_ffi.structural_hash(ctx.mod)
        for donor in keys.get(key, []) if key is not None else []:
            if tvm_ffi.structural_hash(donor) == own:
                continue
            for rec in database.get_top_k(database.commit_workload(donor), top_k):
                if mean_run_seconds(rec.run_secs) >= best_s:
                    break  # best first: no faster record of this twin left to try
                try:
                    trace_json = transferred(rec.trace.as_json(), donor, ctx.mod)
                except TypeError:  # an object with no JSON form: no transfer
                    continue
                if trace_json is not None:
                    yield trace_json

    return _measure_variants(contexts, progress, database, target, runner, builder,
                             candidates, errors, measured, references)


def _own_variants(database: ms.Database, top_k: int, variants):
    """Candidates for :func:`_measure_variants`: ``variants(context, plain trace)`` of each of
    the ``top_k`` best records of the context's own workload."""
    def candidates(c, ctx, workload, best_s):
        for rec in database.get_top_k(workload, top_k):  # best first
            try:
                body = plain_json(rec.trace.as_json())
            except TypeError:  # an object with no JSON form: no variant
                continue
            yield from variants(ctx, body)

    return candidates


def _measure_variants(contexts, progress, database, target, runner, builder, candidates,
                      errors, measured, references=None) -> dict:
    """Candidates (``candidates(context index, context, workload, mean run time of its best
    record so far in s)`` -> traces without postprocessing) for each task, postprocessed,
    measured and committed: the body of :func:`refine_unroll`, :func:`refine_padding` and
    :func:`refine_transfer`."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    t0 = time.perf_counter()
    mods, owners = [], []
    before = []  # per context: the mean run time of its best record so far (s)
    for c, ctx in enumerate(contexts):
        workload = database.commit_workload(ctx.mod)
        seen = measured[c] if measured is not None else None
        top = database.get_top_k(workload, 1)
        before.append(mean_run_seconds(top[0].run_secs) if top else math.inf)
        for trace_json in candidates(c, ctx, workload, before[c]):
            sch = postprocessed(ctx.mod, trace_json, ctx.space_generator.postprocs)
            if sch is None:
                continue
            h = tvm_ffi.structural_hash(sch.mod)
            if seen is not None:
                if h in seen:
                    continue
                seen.add(h)
            mods.append(sch.mod)
            owners.append((c, workload, sch.trace))
    out = {"measured": 0, "failed": 0, "better": 0, "seconds": 0.0}
    if not mods:
        return out
    after = list(before)
    for (c, workload, trace), mod, (secs, why) in zip(
            owners, mods, measure_kernels(
                mods, target, runner, builder,
                [references[c] for c, _, _ in owners] if references else None)):
        p = progress[c]
        p.trials += 1
        out["measured"] += 1
        if secs is None:
            p.errors += 1
            p.last_error = why or ""
            out["failed"] += 1
            if errors is not None:
                errors.add(p.name, "run", why or "no run time")
            secs = [FAILED_RUN_S]
        else:
            p.best_s = min(p.best_s, sum(secs) / len(secs))
            after[c] = min(after[c], sum(secs) / len(secs))
        database.commit_tuning_record(ms.database.TuningRecord(
            trace, workload, [float(x) for x in secs], target,
            ArgInfo.from_prim_func(mod["main"])))
    out["better"] = sum(1 for b, a in zip(before, after) if a < b)
    out["seconds"] = time.perf_counter() - t0
    return out


DEFAULT_LATENCY = "default_latency.json"


def measure_defaults(tasks: list[Task], target, runner, log: TuningLog | None = None,
                     builder_workers: int | None = None, refresh: bool = False
                     ) -> dict[str, float]:
    """Time every task's kernel with its default schedule (no tuning) on the runner's device.

    Returns ``{workload key: seconds per call}`` (key: :func:`thomas_tune.tasks.key`); a
    kernel whose build or run fails gets ``inf``. With ``log``, results are cached in the tuning-log folder
    (``default_latency.json``, written atomically) and only missing tasks are measured; the
    cache is stamped with :func:`defaults_stamp` (TVM version and target), and each time is kept
    with the key of the kernel it timed (:func:`default_schedule_key`): a cache of another
    stamp, or a kernel that the rules now make differently, is measured again, not reused. These
    times x call counts say where an untuned training step spends its time, which is what
    ``select_by_time`` ranks tasks by. On CPU targets the default is MetaSchedule's unscheduled
    kernel, compiled as is. ``refresh``: measure every task again and replace its cached time
    (``thomas-tune remeasure --defaults``, for times measured under a noisy load).
    """
    import json
    import tempfile

    cache_path = os.path.join(log.path, DEFAULT_LATENCY) if log is not None else None
    keys = [workload_key(t) for t in tasks]
    wanted = dict(zip(keys, (t.mod for t in tasks)))
    cache = _read_cache(log.path, target) if log is not None else None
    if cache is None and cache_path and os.path.exists(cache_path):
        print(f"default schedules: the times in {cache_path} were measured with another TVM "
              "or another target (or by an older thomas_tune); measuring again",
              file=sys.stderr)
    known = _valid_times(cache, wanted, target) if cache is not None and not refresh else {}
    stale = 0 if refresh else sum(1 for k in wanted if cache is not None
                                  and k in cache["seconds"] and k not in known)
    if stale:
        print(f"default schedules: {stale} kernel(s) of {cache_path} are no longer what "
              "the default-schedule rules make; measuring them again", file=sys.stderr)
    schedules = {k: cache["schedules"][k] for k in known}  # keys of still-valid times
    todo = [(k, t) for k, t in zip(keys, tasks) if k not in known]
    if todo:
        mods = []
        for k, t in todo:
            mods.append(default_kernel(t.mod, target))
            schedules[k] = str(tvm_ffi.structural_hash(mods[-1]["main"]))
        builder = Builder(max_workers=builder_workers, timeout_s=120)
        try:
            results = measure_kernels(mods, target, runner, builder)
        finally:
            builder.shutdown()
        errors = collections.Counter()
        for (k, _), (secs, why) in zip(todo, results):
            known[k] = math.inf if secs is None else sum(secs) / len(secs)
            if why is not None:
                errors[why] += 1
        for why, n in errors.most_common(5):
            print(f"default schedules: {n} kernel(s) failed: {why}", file=sys.stderr)
        if cache_path:
            # entries of workloads not asked about now stay as they were
            seconds = {}
            for k, v in (cache["seconds"] if cache is not None else {}).items():
                if k not in wanted and k in cache["schedules"]:
                    seconds[k], schedules[k] = v, cache["schedules"][k]
            seconds.update({k: (v if math.isfinite(v) else None) for k, v in known.items()})
            os.makedirs(log.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=log.path)
            with os.fdopen(fd, "w") as f:
                json.dump({"stamp": defaults_stamp(target), "seconds": seconds,
                           "schedules": schedules}, f, indent=0)
            os.replace(tmp, cache_path)
    return {k: (math.inf if v is None else v) for k, v in known.items()}


def measure_kernels(mods: list[tvm.IRModule], target, runner, builder: Builder,
                    references: list | None = None
                    ) -> list[tuple[list[float] | None, str | None]]:
    """Build each module of ``mods`` (one kernel, function ``main``) for ``target`` with
    ``builder`` and time it on ``runner``'s device. Per module, in order: (run seconds, one
    per repeat; None) or (None; the error of the build or the run, one line). Build artifacts
    are removed. ``references``: per module, the
    :class:`~thomas_tune.kernel_check.Reference` of its task, whose outputs it must reproduce
    before it is timed (:meth:`thomas_tune.runner.FarmRunner.expect`; "wrong result: ..."
    otherwise), or None for a module timed unchecked (a default schedule)."""
    import shutil

    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from .target import device_kind

    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    out: list = [None] * len(mods)
    inputs, owners = [], []
    for i, (m, b) in enumerate(zip(mods, built)):
        if b.error_msg is not None:
            out[i] = (None, error_line(b.error_msg, 160))
            continue
        inputs.append(ms.runner.RunnerInput(b.artifact_path, device_kind(target),
                                            ArgInfo.from_prim_func(m["main"])))
        owners.append(i)
    refs = references or [None] * len(mods)
    futures: dict[int, object] = {}
    groups: dict[int, list[int]] = {}  # one runner call per reference (per task)
    for n, i in enumerate(owners):
        groups.setdefault(id(refs[i]), []).append(n)
    try:
        for members in groups.values():
            if hasattr(runner, "expect"):
                runner.expect(refs[owners[members[0]]])
            for n, fut in zip(members, runner.run([inputs[n] for n in members])):
                futures[n] = fut
        for n, i in enumerate(owners):
            r = futures[n].result()
            secs = [float(x) for x in (r.run_secs or [])]
            if r.error_msg is None and secs and max(secs) < FAILED_RUN_S:
                out[i] = (secs, None)
            else:
                out[i] = (None, error_line(str(r.error_msg), 160) if r.error_msg is not None
                          else "the run returned no valid time")
    finally:
        for inp in inputs:
            shutil.rmtree(os.path.dirname(str(inp.artifact_path)), ignore_errors=True)
    return out


def kernel_time_s(tasks: list[Task], seconds: dict[str, float]) -> float:
    """Seconds per run of every graph once: each task's time in ``seconds`` (``{workload key:
    seconds per call}``) x its calls, over the tasks with a finite time there."""
    total = 0.0
    for t in tasks:
        s = seconds.get(workload_key(t), math.inf)
        if math.isfinite(s):
            total += s * t.weight
    return total


def _read_cache(log_path: str, target) -> dict | None:
    """The cache of :func:`measure_defaults` in ``log_path`` as ``{"seconds": {key: s or
    None}, "schedules": {key: default_schedule_key}}``, or None when there is none or it was
    written under another :func:`defaults_stamp` (or by an older thomas_tune)."""
    import json
    path = os.path.join(log_path, DEFAULT_LATENCY)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        cached = json.load(f)
    if (not isinstance(cached, dict) or cached.get("stamp") != defaults_stamp(target)
            or not isinstance(cached.get("schedules"), dict)):
        return None
    return {"seconds": cached.get("seconds") or {}, "schedules": cached["schedules"]}


def _valid_times(cache: dict, workloads: dict, target) -> dict[str, float]:
    """The cached times of ``workloads`` whose timed kernel is the one the default rules make
    today (seconds; ``inf``: failed to run)."""
    seconds, schedules = cache["seconds"], cache["schedules"]
    out = {}
    for key, mod in workloads.items():
        if key in seconds and key in schedules and \
                schedules[key] == default_schedule_key(mod, target):
            v = seconds[key]
            out[key] = math.inf if v is None else float(v)  # null: failed to run
    return out


def read_default_times(log_path: str, target,
                       workloads: dict[str, tvm.IRModule]) -> dict[str, float] | None:
    """The default-schedule times cached in the tuning-log folder ``log_path`` by
    :func:`measure_defaults` for ``workloads`` (``{workload key: IRModule}``):
    ``{workload key: seconds per call}`` (``inf``: failed to run), or None when there is no
    cache or it was measured under another :func:`defaults_stamp`.

    A time is returned only where the kernel that the default-schedule rules make of the
    workload today is the one that was timed (:func:`default_schedule_key`, cached beside each
    time): an edit of the rules that changes some kernels invalidates their times only."""
    cache = _read_cache(log_path, target)
    return None if cache is None else _valid_times(cache, workloads, target)


def default_schedule_key(mod: tvm.IRModule, target) -> str:
    """What a default-schedule time was measured on: the structural hash (decimal) of the
    kernel that :func:`~thomas_tune.kernel_check.default_kernel` makes of workload ``mod`` for
    ``target``."""
    return str(tvm_ffi.structural_hash(default_kernel(mod, target)["main"]))


def defaults_stamp(target) -> str:
    """What every default-schedule time depends on besides its kernel: sha256 (hex) of the
    TVM version (its code generators and dlight rules) and the target's JSON. Times measured
    under another stamp are not reused."""
    import hashlib

    h = hashlib.sha256()
    h.update(b"default-latency-v2")
    h.update(tvm.__version__.encode())
    h.update(str(target).encode())  # the target's JSON
    return h.hexdigest()


def select_by_time(tasks: list[Task], latency: dict[str, float], time_share: float) -> list[Task]:
    """The fewest tasks whose default-schedule time x calls covers ``time_share`` (0..1] of the
    untuned step's kernel time, slowest first. Tasks that failed to run by default (``inf``)
    are taken first: they must be tuned. Raises ValueError for a share outside (0, 1]."""
    if not 0 < time_share <= 1:
        raise ValueError(f"--time-share must be in (0, 1], got {time_share}")
    cost = {id(t): latency.get(workload_key(t), 0.0) * t.weight for t in tasks}
    ranked = sorted(tasks, key=lambda t: -cost[id(t)])
    finite = sum(c for c in cost.values() if math.isfinite(c))
    out, acc = [], 0.0
    for t in ranked:
        c = cost[id(t)]
        if math.isfinite(c) and acc >= time_share * finite:
            break
        out.append(t)
        acc += c if math.isfinite(c) else 0.0
    return out
