"""The search strategy: evolutionary search that resumes a tuning log, and its database view."""

from __future__ import annotations

import json
import os
import random
import sys
import time

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..measure.phases import Phases
from ..measure.runner import error_line
from ..schedules import (before_postproc, plain_json, postprocessed, space_generator, unroll_steps,
                         within_unroll)
from ..tasks import Task
from .local_search import LocalSearch


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
    tuner). The spaces are kept from the first call and handed
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


def cost_model(phases: Phases, threads: int | None = None, pretrained=None):
    """The tuner's cost model: MetaSchedule's XGBoost model (features: ``PerStoreFeature``;
    Chen et al. 2018, "Learning to Optimize Tensor Programs") training on ``threads`` threads
    (default a quarter of this machine's cores, at least 1). Its updates (feature extraction
    after each measured batch; a new booster trained from scratch on all the run's data
    whenever that has grown by a fifth) run on the tuning thread, and their wall seconds go to
    ``phases`` as ``cost_model``.

    MetaSchedule's default gives XGBoost every core, beside the build processes and the device
    servers' compilers: on the H100 (16 cores, 8 build processes, 12 servers) the updates took
    70 of 241 s of a MobileNetV2 run, and the same trainings took 9.8 s on 4 threads. Training in a
    background thread instead made a SIGINT during the run end the process in ``std::terminate``
    (``tests/test_faults.py::test_tuner_killed_and_restarted``), so the updates stay on the tuning
    thread.

    ``pretrained``: a trained booster (:func:`.pretrained.load`) the model starts from and
    keeps boosting from in its updates (:func:`.pretrained.start_trained`); None: MetaSchedule's
    untrained start (random scores for the first 100 samples)."""
    threads = threads or max(1, (os.cpu_count() or 4) // 4)
    model = ms.cost_model.XGBModel(num_tuning_cores=threads)
    if pretrained is not None:
        from .pretrained import start_trained
        start_trained(model, pretrained, threads)
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
    before; ``drawn`` counts them. A task resumed from a long log needs this: on the H100 such
    searches ended after 34-146 trials each, among them the first linear layer's forward pass
    of AlexNet (0.12 ms per step), and the rest of the run's budget went to a kernel of 0.006
    ms. The search draws so too when the evolutionary search ends a task before proposing
    anything: MetaSchedule's gives up when fewer than ``init_min_unmeasured`` of its first
    population's draws pass the postprocessors (a small population on a target with tight
    limits, as the Adreno tag's), where a few valid ones may still be found.

    An error of the evolutionary search itself (a mutator or postprocessor that fails on a
    design space: on the H100, a space whose cooperative-fetch annotation was a constant made
    every later round of its task raise in MetaSchedule's thread pool, which ended the whole
    run) ends that task's search only: ``failed`` maps its name to the error, the tuner says so
    on stderr and in its report, and the other tasks go on.

    With ``local_share`` above 0, that share of each batch (rounded; at least one candidate
    where the batch has two or more) goes to the neighbours of the task's ``local_top`` best
    records, each one decision away from one (:class:`.local_search.LocalSearch`), in place of
    the evolutionary search's last picks; ``local`` counts them. A task with no record yet gets
    evolutionary candidates only."""

    #: draws tried per candidate wanted (a draw the postprocessors reject, or one measured
    #: before, is tried again)
    DRAW_TRIES = 8

    def __init__(self, measured: set[int] | None = None, max_empty_rounds: int = 8,
                 phases: Phases | None = None, max_unroll: int | None = None,
                 counts: dict[str, int] | None = None, failed: dict[str, str] | None = None,
                 local_share: float = 0.0, local_top: int = 2, tried: dict | None = None,
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
                                                          "drawn": 0, "local": 0}
        self.local_share, self.local_top = float(local_share), int(local_top)
        self.tried = tried if tried is not None else {}  # LocalSearch's, shared with clones
        self.database = None
        self.failed = failed if failed is not None else {}
        self.task_name = None
        self.proposed = False  # whether this search has proposed candidates yet
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

    @property
    def local(self) -> int:
        return self.counts.get("local", 0)

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
        self.database = database
        self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database,
                              cost_model)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def generate_measure_candidates(self):
        t0 = time.perf_counter()
        try:
            cands = self._fresh_candidates()
            if cands and self.local_share > 0:
                cands = self._with_local(cands)
            self.proposed = self.proposed or bool(cands)
            return cands
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
                # the search ends the task; on its first round that is a search that could not
                # sample its first population (too few valid schedules among its draws): the
                # task gets random draws of its own before it ends
                return None if self.proposed else (self._drawn_candidates() or None)
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

    def _with_local(self, cands: list) -> list:
        """``cands`` with its last picks replaced by neighbours of the task's best records
        (``local_share`` of the batch); the replaced ones may be proposed again later."""
        if self.database is None or self.mod is None or not self.database.has_workload(self.mod):
            return cands
        want = round(self.local_share * len(cands))
        want = max(1, want) if len(cands) > 1 else want
        workload = self.database.commit_workload(self.mod)
        best = self.database.get_top_k(workload, self.local_top)
        if not best:
            return cands
        search = LocalSearch(self.mod, self.postprocs, self.measured, self.local_top,
                             self.rng, self.tried, self.counts)
        local = search.candidates(best, want)
        if not local:
            return cands
        for c in cands[len(cands) - len(local):]:
            self.measured.discard(tvm_ffi.structural_hash(c.sch.mod))
        return cands[: len(cands) - len(local)] + local

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
                              self.max_unroll, self.counts, self.failed, self.local_share,
                              self.local_top, self.tried, **self.kwargs)


def search_context(task: Task, target, measured: set[int], population: int,
                   genetic_iters: int, max_unroll: int | None, seed: int,
                   phases: Phases | None = None, local_share: float = 0.0):
    """The tune context and search strategy (:class:`ResumingSearch`) of one task as
    :func:`tune` searches it: ``measured``, the structural hashes of its schedules already in
    the tuning log; ``population`` and ``genetic_iters``, the evolutionary search's size (a
    quarter of the population, at least 8, is drawn fresh each round); ``max_unroll``, the
    unroll limit (:func:`thomas_tune.schedules.unroll_steps`); ``seed``, the context's random
    state; ``local_share``, the share of each batch given to the local search near the task's
    best records. The search runs on every core. Returns ``(context, strategy)``."""
    strategy = ResumingSearch(measured, phases=phases, max_unroll=max_unroll,
                              local_share=local_share,
                              population_size=population,
                              init_min_unmeasured=max(8, population // 4),
                              genetic_num_iters=genetic_iters)
    ctx = ms.TuneContext(
        mod=task.mod, target=target,
        space_generator=OnceSpaces(space_generator(target, max_unroll)),
        search_strategy=strategy, task_name=task.name, rand_state=seed,
        num_threads=max(1, os.cpu_count() or 1))
    return ctx, strategy
