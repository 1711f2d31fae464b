"""The tuning driver: :func:`tune`, MetaSchedule's loop over tasks, set by :class:`TuneOptions`."""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from tvm.s_tir import meta_schedule as ms

from ..kernel_reference import build_references
from ..measure.builder import Builder
from ..measure.kept import keep_builder, take_builder
from ..measure.phases import Phases
from ..measure.runner import FarmRunner, error_line
from ..schedules import UNROLL_STEPS, unroll_steps
from ..tasks import Task
from ..tasks import key as workload_key
from ..logs import TrialErrors, TuningLog
from .pretrained import BOOSTER
from .pretrained import load as load_cost_model
from .refine import refine_padding, refine_transfer, refine_unroll, refinement_line
from .report import Progress, TaskProgress, TuneReport, convergence, cpu_jiffies
from .search import ResumingSearch, cost_model, search_context
from .seeding import open_seed_logs, refine_seeds
from .task_scheduler import PipelinedGradient


def rpc_runner(tracker: tuple[str, int], key: str, servers: int | None = None,
               trial_timeout_s: float = 20.0, compile_timeout_s: float = 30.0, repeat: int = 3,
               min_repeat_ms: float = 2.0, wait_s: float = 60.0, **kwargs) -> FarmRunner:
    """The runner over device servers of ``key`` on ``tracker`` (see
    :class:`thomas_tune.measure.runner.FarmRunner`): ``servers`` measure in parallel (default: those
    free at the start), each trial is ``repeat`` repeats of about ``min_repeat_ms`` ms, a trial
    whose timed runs take over ``trial_timeout_s`` s, or whose OpenCL build on the device takes over
    ``compile_timeout_s`` s, is recorded as an error, and trials wait at most ``wait_s`` s when no
    server of the key can be had."""
    return FarmRunner(tracker, key, lanes=servers, trial_timeout_s=trial_timeout_s,
                      compile_timeout_s=compile_timeout_s,
                      repeat=repeat, min_repeat_ms=min_repeat_ms, wait_s=wait_s, **kwargs)


@dataclass(frozen=True)
class TuneOptions:
    """How :func:`tune` searches: the settings of one run, checked once when made.

    ``trials``: measurements in all (MetaSchedule's ``max_trials_global``), at least one per
    task (:func:`tune` checks that against its tasks); ``trials_per_iter``: candidates per
    batch; ``builder_workers``: build processes (None: one per core); ``seed``: the search's
    random state (task ``i`` gets ``seed + i``); ``population`` and ``genetic_iters``: the
    evolutionary search's size and rounds of mutation per batch; ``show_progress``: the
    progress bar and refinement lines on stderr; ``stats_path``, ``stats_every_s``: where
    and how often the report is written while tuning; ``max_in_flight``: batches measured
    while the next is searched and built; ``max_unroll``: the largest unroll limit searched
    (:func:`thomas_tune.schedules.unroll_steps`; None: all); ``refine_top``: best records per
    task measured again in the refinement passes (0: none); ``check``: every candidate's outputs
    are compared on the device with its task's default schedule on the same inputs before its
    time enters the log (:mod:`thomas_tune.kernel_check`; a wrong one is a failed trial "wrong
    result: ..."), False only to measure what the check costs: unchecked candidates can put
    wrong kernels into the log; ``cost_model``: the folder of a trained cost model the
    session's model starts from (:mod:`.pretrained`; None: an untrained one); ``local_share``:
    the share of each batch given to the local search near each task's best records
    (:mod:`.local_search`; 0: evolutionary search only); ``seed_logs``: tuning-log folders
    whose ``seed_top`` best records of each matching workload are checked and measured here
    before the search (:func:`.seeding.refine_seeds`; the seed logs are only read). Raises
    ValueError naming the
    ``thomas-tune tune`` option and its fix for a value the search cannot run with.
    """

    trials: int
    trials_per_iter: int = 8
    builder_workers: int | None = None
    seed: int = 0
    population: int = 128
    show_progress: bool = True
    stats_path: str | None = None
    stats_every_s: float = 30.0
    max_in_flight: int = 3
    max_unroll: int | None = None
    refine_top: int = 2
    genetic_iters: int = 2
    check: bool = True
    cost_model: str | None = None
    local_share: float = 0.25
    seed_logs: tuple[str, ...] = ()
    seed_top: int = 4

    def __post_init__(self) -> None:
        try:
            unroll_steps(self.max_unroll)
        except ValueError:
            raise ValueError(f"--max-unroll {self.max_unroll} leaves the search fewer than two "
                             f"unroll limits; give {UNROLL_STEPS[1]} or more (e.g. 64), or "
                             "leave it out for all") from None
        if self.refine_top < 0:
            raise ValueError(f"--refine-top {self.refine_top} is negative; give 0 (no "
                             "refinement) or more")
        if self.genetic_iters < 1:
            raise ValueError(f"--genetic-iters {self.genetic_iters} leaves the search no "
                             "mutation; give 1 or more (default 2)")
        if self.seed_top < 1 and self.seed_logs:
            raise ValueError(f"--seed-top {self.seed_top} seeds nothing; give 1 or more "
                             "(default 4), or leave --seed-log out")
        if self.population < 2:
            raise ValueError(f"--population {self.population}: the search needs at least 2 "
                             "members")
        if not 0.0 <= self.local_share <= 1.0:
            raise ValueError(f"--local-share {self.local_share} is not a share; give 0 (no "
                             "local search) to 1")
        if self.cost_model is not None and not os.path.isfile(
                os.path.join(self.cost_model, BOOSTER)):
            raise ValueError(f"--cost-model {self.cost_model!r} holds no trained cost model "
                             f"({BOOSTER}); make one with 'thomas-tune log train-cost-model "
                             "LOG... --out DIR', or leave the option out")


def tune(tasks: list[Task], target, log: TuningLog, runner: ms.Runner,
         options: TuneOptions | None = None, *, default_s: dict[str, float] | None = None,
         **settings) -> TuneReport:
    """Tune ``tasks`` for ``target`` with ``options.trials`` measurements in all, appending to
    ``log``. ``options``: a :class:`TuneOptions`, or its fields given by name as ``settings``
    (``tune(..., trials=8, population=16)``); the names below are its fields.

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
    :class:`.task_scheduler.PipelinedGradient`, with up to ``max_in_flight`` batches
    measured while the next one is searched and built, and each task's gradient starting from
    its default-schedule time in ``default_s`` (``{workload key: seconds per call}``, from
    :func:`.defaults.measure_defaults`) where known, and from its best record where ``log`` has one
    (such a task gets no first-round batch). ``max_unroll`` limits the unrolled steps the
    search chooses among (:func:`thomas_tune.schedules.unroll_steps`; None: all of
    :data:`~thomas_tune.schedules.UNROLL_STEPS`): candidates build and compile faster. Where it
    leaves larger steps out, the ``refine_top`` best records of each task are measured again
    with each larger step after the search (:func:`.refine.refine_unroll`; these trials come on
    top of ``trials``). Raises ValueError for options the search cannot run with
    (:class:`TuneOptions`), an empty task list or a budget smaller than one round over the
    tasks, and :class:`thomas_tune.logs.LogInUse` when another tuner holds ``log``. Failed
    trials are appended with their reason to ``trial_errors.jsonl`` in the log folder.
    """
    options = _options(options, settings)
    if not tasks:
        raise ValueError("no task to tune")
    if options.trials < len(tasks):
        raise ValueError(f"--trials {options.trials} is below one trial per task ({len(tasks)} "
                         "tasks); raise --trials or tune fewer tasks (--top)")
    seeds = open_seed_logs(list(options.seed_logs), log)  # read, never written
    with log.lock("tuning"):  # one tuner per log: a second one is refused (LogInUse)
        log.claim_version("tune into it", "tune")  # only times of this code generation
        return _tune_locked(tasks, target, log, runner, options, default_s or {}, seeds)


def _options(options: TuneOptions | None, settings: dict) -> TuneOptions:
    """``options``, or the :class:`TuneOptions` made of ``settings`` (its fields by name).
    Raises TypeError when both are given, or ``options`` is not a :class:`TuneOptions`."""
    if options is not None and settings:
        raise TypeError(f"give tune() options or settings ({', '.join(settings)}), not both")
    if options is not None and not isinstance(options, TuneOptions):
        raise TypeError(f"tune()'s options are a TuneOptions, not {type(options).__name__}; "
                        "give trials and the other settings by name (trials=...)")
    return options if options is not None else TuneOptions(**settings)


@dataclass
class _SearchTasks:
    """The tasks that have a search space, side by side: their tuning contexts and search
    strategies (a strategy shares its state with its context's clone), weights (calls per
    step), progress rows, default-schedule and best tuned times (ms, None where unknown) and
    workload modules."""

    contexts: list = field(default_factory=list)
    strategies: list[ResumingSearch] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    progress: list[TaskProgress] = field(default_factory=list)
    default_ms: list[float | None] = field(default_factory=list)
    tuned_ms: list[float | None] = field(default_factory=list)
    mods: list = field(default_factory=list)

    def measured(self) -> list:
        """Per task, the workloads its strategy has measured (the refinement stages add to
        them)."""
        return [s.measured for s in self.strategies]


def _search_tasks(tasks: list[Task], target, log: TuningLog, database, opt: TuneOptions,
                  default_s: dict[str, float], phases: Phases,
                  report: TuneReport) -> _SearchTasks:
    """The search contexts of ``tasks`` (:func:`.search.search_context`), resuming from the
    records ``log`` already holds for each (counted in ``report.resumed_records``); a task
    whose search space cannot be generated is left out with a line on stderr and keeps its
    default schedule. ``default_s``: default-schedule seconds per call by workload key."""
    found = _SearchTasks()
    for i, task in enumerate(tasks):
        measured = log.measured(database, task.mod)
        report.resumed_records += len(measured)
        ctx, strategy = search_context(task, target, measured, opt.population,
                                       opt.genetic_iters, opt.max_unroll, opt.seed + i, phases,
                                       opt.local_share)
        ctx = ctx.clone()
        try:  # a rule that fails on this kernel would otherwise stop the whole run
            ctx.generate_design_space()
        except Exception as err:  # TVM's ScheduleError and friends
            print(f"task {task.name}: no search space ({error_line(err, 200)}); it keeps its "
                  "default schedule", file=sys.stderr, flush=True)
            continue
        found.contexts.append(ctx)
        found.strategies.append(strategy)
        found.weights.append(float(task.weight))
        d = default_s.get(workload_key(task))
        found.default_ms.append(d * 1e3 if d is not None and math.isfinite(d) else None)
        best = log.best_seconds(database, task.mod) if measured else None
        found.tuned_ms.append(best * 1e3 if best is not None else None)
        found.progress.append(TaskProgress(
            task.name, task.flops, default_s=d if d is not None and math.isfinite(d) else None))
        found.mods.append(task.mod)
    return found


class _TuningRun:
    """One tuning run after its start-up: the search tasks, the statistics written while it
    runs and at its end (``report``, ``phases``), the builder and the tasks' references
    (:meth:`start_builder`), and the refinement stages around MetaSchedule's loop."""

    def __init__(self, found: _SearchTasks, target, log: TuningLog, database,
                 runner: ms.Runner, opt: TuneOptions, report: TuneReport, phases: Phases,
                 errors: TrialErrors):
        self.found, self.target, self.log, self.database = found, target, log, database
        self.runner, self.opt, self.report, self.phases = runner, opt, report, phases
        self.errors = errors
        self.builder: Builder | None = None
        self.references: list = []
        self.ref_paths: list[str] = []
        self.t0 = self.last_write = time.perf_counter()
        self.cpu0 = cpu_jiffies()

    def cpu_share(self) -> float | None:
        """The share of the machine's CPU time that was busy since the run started (0..1), or
        None where it cannot be read."""
        now = cpu_jiffies()
        if self.cpu0 is None or now is None or now[1] <= self.cpu0[1]:
            return None
        return (now[0] - self.cpu0[0]) / (now[1] - self.cpu0[1])

    def statistics(self) -> None:
        """Bring ``report`` up to date (elapsed s, phases, CPU share, search totals)."""
        self.report.elapsed_s = time.perf_counter() - self.t0
        self.report.phases = self.phases.as_dict()
        self.report.cpu_busy = self.cpu_share()
        _search_totals(self.report, self.found.strategies)

    def tick(self) -> None:
        """After each measured batch: the statistics, written to ``stats_path`` every
        ``stats_every_s`` seconds."""
        self.statistics()
        now = time.perf_counter()
        if self.opt.stats_path and now - self.last_write >= self.opt.stats_every_s:
            convergence(self.found.progress, self.database, self.found.mods,
                        self.found.default_ms)
            self.report.write(self.opt.stats_path)
            self.last_write = now

    def write_last(self) -> None:
        """The last statistics, also for a run that a signal stopped."""
        self.statistics()
        convergence(self.found.progress, self.database, self.found.mods, self.found.default_ms)
        if self.opt.stats_path:
            self.report.write(self.opt.stats_path)

    def start_builder(self) -> None:
        """The candidates' builder, and each task's default schedule built once with it: the
        reference every candidate's outputs are compared with on the device before its time
        enters the log (:mod:`thomas_tune.kernel_check`); its builds count as ``build`` (the
        builder's), the rest as ``references``."""
        opt, phases = self.opt, self.phases
        self.builder = take_builder(opt.builder_workers or max(1, (os.cpu_count() or 2)),
                                    timeout_s=60, phases=phases)
        t_ref, b_ref = time.perf_counter(), phases.wall.get("build", 0.0)
        contexts = self.found.contexts
        self.references, self.ref_paths = (
            build_references([c.mod for c in contexts], self.target, self.builder, opt.seed)
            if opt.check else ([None] * len(contexts), []))
        built = phases.wall.get("build", 0.0) - b_ref
        phases.add("references", max(0.0, time.perf_counter() - t_ref - built), wall=True)

    def refining(self, stage, *args) -> dict:
        """Run one refinement stage on the run's tasks (``stage(contexts, progress, database,
        target, runner, builder, *args, errors, measured, references)``); its wall time less
        its builds goes to the phase ``refine``."""
        t, b = time.perf_counter(), self.phases.wall.get("build", 0.0)
        f = self.found
        try:
            return stage(f.contexts, f.progress, self.database, self.target, self.runner,
                         self.builder, *args, self.errors, f.measured(), self.references)
        finally:
            built = self.phases.wall.get("build", 0.0) - b
            self.phases.add("refine", max(0.0, time.perf_counter() - t - built), wall=True)

    def say(self, r: dict, what: str, always: bool = False) -> None:
        """A refinement stage's line on stderr (with ``show_progress``; only where the stage
        measured something unless ``always``)."""
        if self.opt.show_progress and (always or r["measured"]):
            print(refinement_line(r, what), file=sys.stderr, flush=True)

    def refine_first(self, seeds: list) -> None:
        """The refinement stages before the search: the seed logs' records, then (with
        ``refine_top``) schedules shared between twins and padding out of the inner loop."""
        report, opt = self.report, self.opt
        if seeds:
            r = report.seeded = self.refining(refine_seeds, seeds, opt.seed_top)
            self.say(r, f"seeds from {len(seeds)} log(s): {r['measured']} records measured on "
                        f"this device ({r['resized']} refitted from other shapes, "
                        f"{r['unusable']} did not apply here)", always=True)
        if opt.refine_top > 0:
            r = report.transferred = self.refining(refine_transfer, opt.refine_top,
                                                   self.log.workloads())
            self.say(r, "schedules shared between kernels of one contraction: "
                        f"{r['measured']} records of other workloads measured on their twins")
            r = report.padded = self.refining(refine_padding, opt.refine_top)
            self.say(r, f"padding out of the inner loop: {r['measured']} best records "
                        "measured with their padding in the shared fill")

    def refine_unroll(self) -> None:
        """After the search, where ``max_unroll`` left larger unroll steps out: the
        ``refine_top`` best records of each task measured again with each of them."""
        larger = [s for s in UNROLL_STEPS if s not in unroll_steps(self.opt.max_unroll)]
        if larger and self.opt.refine_top > 0:
            r = self.report.refined = self.refining(refine_unroll, larger, self.opt.refine_top)
            self.say(r, f"unroll refinement: {r['measured']} candidates with unroll steps "
                        f"{larger} measured", always=True)

    def close(self, callbacks: list) -> None:
        """Close the progress bar, the builder, the references' files and the runner; write
        the last statistics."""
        callbacks[-1].bar.close()
        if self.builder is not None and self.report.ended == "finished":
            keep_builder(self.builder)  # for the next run of this process (measure.kept)
        elif self.builder is not None:
            self.builder.shutdown()  # a build may still be running in it
        for path in self.ref_paths:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        self.write_last()


def _tune_locked(tasks: list[Task], target, log: TuningLog, runner: ms.Runner,
                 opt: TuneOptions, default_s: dict[str, float], seeds: list) -> TuneReport:
    """:func:`tune` once the log is locked and stamped: the search tasks, the refinement
    stages and MetaSchedule's loop, ended by its budget, a failure or a signal (the report's
    ``ended``); the report is written at the end in every case."""
    t_open = time.perf_counter()
    database = log.database()
    report = TuneReport()
    phases = getattr(runner, "phases", None) or Phases()
    errors = TrialErrors(log, [t.name for t in tasks])
    found = _search_tasks(tasks, target, log, database, opt, default_s, phases, report)
    # the next start replays only the records added after this
    report.replayed_records = log.save_hashes()
    report.startup_s = time.perf_counter() - t_open
    if not found.contexts:
        raise ValueError("no task has a search space for this target (see the lines above)")
    report.tasks = found.progress
    run = _TuningRun(found, target, log, database, runner, opt, report, phases, errors)
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), errors,
                 Progress(found.progress, opt.trials, disable=not opt.show_progress,
                          tick=run.tick)]
    model = cost_model(phases, pretrained=(load_cost_model(opt.cost_model)[0]
                                           if opt.cost_model else None))
    run.start_builder()
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
        run.refine_first(seeds)
        loop["scheduler"] = PipelinedGradient(
            found.default_ms, max_in_flight=opt.max_in_flight, seed=opt.seed, phases=phases,
            tuned_ms=found.tuned_ms, on_task=lambda i: runner.expect(run.references[i]))
        try:
            ms.tune_tasks(
                tasks=found.contexts, task_weights=found.weights, work_dir=log.path,
                max_trials_global=opt.trials, num_trials_per_iter=opt.trials_per_iter,
                builder=run.builder, runner=runner, database=database, cost_model=model,
                measure_callbacks=callbacks, task_scheduler=loop["scheduler"])
        finally:
            loop["scheduler"] = None
        if seen:  # the loop ended at a signal: the run stops here
            raise KeyboardInterrupt
        run.refine_unroll()
        report.ended = "finished"
    except BaseException as err:
        report.ended = _ended(seen, err)
        raise
    finally:
        restore_handlers()
        run.close(callbacks)
    return report


def _ended(seen: list[int], err: BaseException) -> str:
    """How a run that raised ``err`` ended, for the report's ``ended``: stopped by the first
    signal in ``seen`` (or SIGINT for a KeyboardInterrupt), else failed with ``err``. A
    signal's KeyboardInterrupt can come out of MetaSchedule's C++ loop as another error (a
    RuntimeError with no message): the signals seen tell a stop from a failure."""
    stop = seen[0] if seen else (signal.SIGINT if isinstance(err, KeyboardInterrupt) else None)
    return (f"stopped by {signal.Signals(stop).name}" if stop is not None
            else f"failed: {type(err).__name__}: {error_line(err, 300)}")


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
    measured, drawn at random, proposed by the local search, unroll limits clamped, searches
    that failed."""
    report.skipped = sum(s.skipped for s in strategies)
    report.drawn = sum(s.drawn for s in strategies)
    report.local = sum(s.local for s in strategies)
    report.clamped = sum(s.clamped for s in strategies)
    report.search_failed = {k: v for s in strategies for k, v in s.failed.items()}
