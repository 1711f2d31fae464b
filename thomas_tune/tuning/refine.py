"""Refinement passes around the search: best records measured again as variants."""

from __future__ import annotations

import math
import time

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..measure.builder import Builder
from ..schedules import (anchor_key, plain_json, postprocessed, with_padding_in_fill,
                         with_unroll)
from ..logs import FAILED_RUN_S, TrialErrors, mean_run_seconds
from .defaults import measure_kernels
from .report import TaskProgress
from .twins import precision_key, twin_trace


def refinement_line(result: dict, what: str) -> str:
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
    kernel faster still (``bench/experiments/compile_cost.py``). Candidates already measured (in the
    log or this run: ``measured``, per context, the structural hashes of its measured schedules,
    which gets the new ones) are skipped. Failed ones are committed as MetaSchedule commits a
    failed trial (run time :data:`~thomas_tune.logs.FAILED_RUN_S`) and their reasons go
    to ``errors``. ``references`` (per context, its
    :class:`~thomas_tune.kernel_reference.Reference`): each candidate's outputs are checked
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
    log's, :meth:`~thomas_tune.logs.TuningLog.workloads`) that is a task's twin
    (:func:`twin_keys`: the same contraction with other element-wise blocks after it, or at
    another storage precision) on that task, rewritten for its blocks
    (:func:`.twins.twin_trace`), and add the results to ``database``.

    The same convolution or linear layer is a kernel with ReLU fused in the inference graph
    and in a graph whose layer is frozen, and one without it where the training step keeps the
    pre-activation for the backward pass; each is a workload of its own, tuned apart, and the
    searches end apart: on the H100 the best AlexNet record of ``conv1`` with ReLU took 0.225
    ms and the best without it 0.399 ms, with the same 7-loop nest to tile. Run before the
    search, so that a transfer that wins seeds the evolutionary search like any record. Only
    a twin's records faster on the twin than the task's best record on the task are tried
    (the twins' kernels differ by an element-wise epilogue). The half-storage step's
    convolutions (``--precision mixed16``) are twins of the float32 step's: tuning them into a
    log of the float32 graphs starts from those graphs' schedules. Arguments and result as
    :func:`refine_unroll`'s."""
    keys: dict[tuple[str, int], list[tvm.IRModule]] = {}
    for mod in workloads:
        for key in twin_keys(mod):
            keys.setdefault(key, []).append(mod)

    def candidates(c, ctx, workload, best_s):
        own = tvm_ffi.structural_hash(ctx.mod)
        donors = {}  # one donor once, though both its keys match
        for key in twin_keys(ctx.mod):
            for donor in keys.get(key, []):
                donors.setdefault(tvm_ffi.structural_hash(donor), donor)
        for h, donor in donors.items():
            if h == own:
                continue
            for rec in database.get_top_k(database.commit_workload(donor), top_k):
                if mean_run_seconds(rec.run_secs) >= best_s:
                    break  # best first: no faster record of this twin left to try
                try:
                    trace_json = twin_trace(rec.trace.as_json(), donor, ctx.mod)
                except TypeError:  # an object with no JSON form: no transfer
                    continue
                if trace_json is not None:
                    yield trace_json

    return _measure_variants(contexts, progress, database, target, runner, builder,
                             candidates, errors, measured, references)


def twin_keys(mod: tvm.IRModule) -> list[tuple[str, int]]:
    """The keys under which ``mod`` meets its twins: its anchor key
    (:func:`thomas_tune.schedules.anchor_key`: the same contraction with other element-wise
    blocks after it) and its :func:`.twins.precision_key` (the same at other storage
    precisions); either may be missing."""
    out = []
    for kind, key_of in (("anchor", anchor_key), ("precision", precision_key)):
        try:
            key = key_of(mod)
        except Exception:  # a kernel the block analysis cannot read: no twin by this key
            key = None
        if key is not None:
            out.append((kind, key))
    return out


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
