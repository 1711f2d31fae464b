"""Compile a Relax graph for a target, applying the schedules of a tuning log.

Kernels with a tuning record get their tuned schedule (``MetaScheduleApplyDatabase``); on GPU
targets the rest get dlight's default GPU schedules so that every kernel has thread bindings.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from ..training_graph.loss import one_group_kernels
from ..schedules import default_schedules, tir_pipeline
from ..storage_merge import merge_storages
from ..target import codegen_target, is_gpu
from ..tasks import choose_winograd, fuse, lifted_slots


def _pipeline(target: tvm.target.Target, database: ms.Database | None, winograd=None,
              rule_classes=None, slots: dict | None = None):
    """The build's Relax passes; ``slots``, where given, receives the frozen slots of the
    fused module's lifted functions (:func:`thomas_tune.tasks.lifted_slots`)."""
    @tvm.transform.module_pass(opt_level=0, name="ThomasTuneBuild")
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = fuse(mod, winograd)
        if slots is not None:
            slots.update(lifted_slots(mod))
        if is_gpu(target):  # the loss in one work-group, before any record could apply
            mod = one_group_kernels(mod, target)
        if database is not None:
            before = dict(mod.functions)
            with target, database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
            # kernels that got their tuned schedule are final: mark them so that the default
            # GPU schedules below leave them alone
            for gv, func in list(mod.functions.items()):
                if isinstance(func, tvm.tirx.PrimFunc) and not tvm_ffi.structural_equal(
                        func, before.get(gv)):
                    mod[gv] = func.with_attr("tir.is_scheduled", True)
        mod = default_schedules(mod, target, rule_classes)
        passes = [relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
                  relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
                  relax.transform.StaticPlanBlockMemory(), merge_storages,
                  relax.transform.LowerAllocTensor(),
                  relax.transform.KillAfterLastUse(), relax.transform.LowerRuntimeBuiltin(),
                  relax.transform.ComputePrimValue(), relax.transform.VMShapeLower(),
                  relax.transform.AttachGlobalSymbol()]
        return tvm.transform.Sequential(passes)(mod)

    return pipeline


def best_records(database: ms.Database, log_path: str,
                 target: tvm.target.Target) -> tuple[dict, set[str]]:
    """Per workload of ``database`` (the tuning log at ``log_path``, as
    :meth:`TuningLog.database` opens it): its fastest valid record, keyed by workload key
    (structural hash, decimal); and the keys whose fastest record is slower than the default
    schedule as measured on the device under this target and these rules
    (``default_latency.json`` in ``log_path``, :func:`thomas_tune.tuning.read_default_times`:
    only times of the kernels the default rules make today; empty without one or without
    ``target``). Failed trials (MetaSchedule stores 1e10 s) are
    no records."""
    import math

    from ..tuning.defaults import read_default_times
    from ..logs import LogDatabase, mean_run_seconds

    def valid(secs: list[float]) -> bool:
        return math.isfinite(mean_run_seconds(secs))

    best: dict[str, tuple[float, object]] = {}
    # a LogDatabase builds each workload's fastest valid record only (building every record
    # replays every trace: minutes on the committed GPU logs)
    records = (database.first(valid) if isinstance(database, LogDatabase)
               else database.get_all_tuning_records())
    for rec in records:
        mean = mean_run_seconds(rec.run_secs or [])
        if not math.isfinite(mean):
            continue
        key = str(tvm_ffi.structural_hash(rec.workload.mod))
        if key not in best or mean < best[key][0]:
            best[key] = (mean, rec)
    defaults = (read_default_times(log_path, target,
                                   {k: rec.workload.mod for k, (_, rec) in best.items()})
                if target is not None else None) or {}
    slower = {k for k, (mean, _) in best.items() if mean >= defaults.get(k, math.inf)}
    return {k: rec for k, (_, rec) in best.items()}, slower


def tuned_build(log, target: tvm.target.Target, exclude: set[str] = frozenset()
                ) -> tuple[ms.Database, int, dict[str, float]]:
    """The schedules to compile with from the tuning log ``log`` (a TuningLog), how many
    workloads were left at their default schedule, and each workload's time as built (ms per
    call: its fastest record, or its default schedule's time where that is faster; keyed by
    workload key).

    MetaSchedule applies each workload's fastest record. Where the log folder holds default-
    schedule times measured on the device under this target and these rules (``tune
    --time-share`` writes them), a workload whose fastest record is slower than its default
    schedule keeps the default (:func:`best_records`): a tuned build never runs a kernel slower
    than the untuned one. (A search stopped early can leave records many times slower than the
    default schedule.) Without such times every record is used. The workloads of
    ``exclude`` (workload keys: records found to compute wrong numbers,
    :func:`thomas_tune.compiler.build_plan.check_plan`) keep their default schedule too, and their
    time as built is the default's where known. Raises what :meth:`TuningLog.database`
    raises."""
    import math

    from ..tuning.defaults import read_default_times
    from ..logs import mean_run_seconds
    database = log.database()
    best, slower = best_records(database, log.path, target)
    times = {k: mean_run_seconds(rec.run_secs) * 1e3 for k, rec in best.items()}
    left_out = slower | (set(exclude) & set(best))
    if left_out:
        defaults = read_default_times(log.path, target,
                                      {k: best[k].workload.mod for k in left_out}) or {}
        for k in set(exclude) & set(best):  # a wrong record's time means nothing
            del times[k]
        for k, secs in defaults.items():
            if math.isfinite(secs):
                times[k] = min(times.get(k, math.inf), secs * 1e3)
    if not left_out:
        return database, 0, times
    kept = ms.database.MemoryDatabase()
    for key, rec in best.items():
        if key in left_out:
            continue
        workload = kept.commit_workload(rec.workload.mod)
        kept.commit_tuning_record(ms.database.TuningRecord(
            rec.trace, workload, rec.run_secs, rec.target, rec.args_info))
    return kept, len(slower), times


def tuned_database(log, target: tvm.target.Target) -> tuple[ms.Database, int]:
    """The first two of :func:`tuned_build`: the database to compile with and how many
    workloads keep their default schedule."""
    database, slower, _ = tuned_build(log, target)
    return database, slower


def default_ms(log, target: tvm.target.Target):
    """``ms(workloads)``: for each of ``workloads`` ({workload key: IRModule}) whose default
    schedule ``tune --time-share`` timed on the device under ``target`` (cached in ``log``'s
    folder, :func:`thomas_tune.tuning.read_default_times`), its ms per call; kernels that
    failed to run, and the others, are left out."""
    import math

    from ..tuning.defaults import read_default_times

    def ms(workloads: dict[str, tvm.IRModule]) -> dict[str, float]:
        secs = read_default_times(log.path, target, workloads) or {}
        return {k: s * 1e3 for k, s in secs.items() if math.isfinite(s)}
    return ms


def record_gains(log, target: tvm.target.Target, kernel_ms: dict[str, float]):
    """``gain(workloads)`` for :func:`thomas_tune.memory_plan.trade_records`: for each of
    ``workloads`` ({workload key: IRModule}) that has a time as built in ``kernel_ms``
    (:func:`tuned_build`) and a default-schedule time (:func:`default_ms`), the ms per call
    its record saves: default minus as built."""
    defaults = default_ms(log, target)
    return lambda workloads: {k: d - kernel_ms[k] for k, d in defaults(workloads).items()
                              if k in kernel_ms}


def winograd_choice(mod: tvm.IRModule, times: dict[str, float] | None, log=None,
                    target: tvm.target.Target | None = None) -> set:
    """The convolutions of ``mod`` (unfused Relax) that a build computes in the Winograd form,
    given the kernels' times as built (:func:`tuned_build`): those whose Winograd kernels,
    all timed, take less than the timed direct kernels they replace
    (:func:`thomas_tune.tasks.choose_winograd`). Empty without times (an untuned build).

    With the tuning log ``log`` (a TuningLog) and ``target``, a kernel with no tuning record
    takes its default schedule's time from the log's folder where ``tune --time-share`` timed
    it on the device (a Winograd transform fused with the mask of the layer before it is small
    enough that tuning often leaves it at its default schedule: without that time it could
    never be chosen)."""
    if not times:
        return set()
    untimed_ms = default_ms(log, target) if log is not None and target is not None else None
    return choose_winograd(mod, times.get, untimed_ms)


def reference_target(target: tvm.target.Target) -> tvm.target.Target:
    """``target``, an ``llvm`` target, with LLVM's optimisation off (``opt-level`` 0): for
    builds whose numbers are a reference and whose speed does not matter (the float64 graphs
    that tuned builds are checked against). The arithmetic is the same at every level (TVM
    turns on no fast-math), and LLVM's optimisation passes are most of an llvm build's time
    and of its loading into the VM (figures: ``docs/journal/suite.md``).

    Raises ValueError for a target of another kind."""
    if target.kind.name != "llvm":
        raise ValueError(f"reference builds run on this machine's CPU: target {target} is "
                         "not an llvm target")
    return tvm.target.Target(dict(target.export(), **{"opt-level": 0}))


def compile_graph(mod: tvm.IRModule, target: tvm.target.Target,
                  database: ms.Database | None = None, winograd=None,
                  rule_classes=None) -> relax.VMExecutable:
    """Compile ``mod`` (unfused Relax) for ``target``; returns a Relax VM executable.

    ``database``: a MetaSchedule database (the tuning log) or None for default schedules.
    ``winograd``: the convolutions to compute in the Winograd form (a set of
    :class:`thomas_tune.training_graph.winograd_form.Conv`, :func:`winograd_choice`), None for none.
    ``rule_classes``: the default GPU rules of kernels without a record
    (:func:`thomas_tune.schedules.default_gpu_schedules`; None: thomas_tune's).
    The schedules are chosen for ``target``; the code is generated for
    :func:`thomas_tune.target.codegen_target` (a GPU target's host code unoptimised), its
    kernels lowered by :func:`thomas_tune.schedules.tir_pipeline` (on GPUs, long sums in two
    levels). A module with autocast float16's arithmetic (``--precision autocast16``) is built
    in the native form: its OpenCL C keeps ``half`` arithmetic and the ``cl_khr_fp16`` pragma
    (:func:`thomas_tune.half_arith.native_for`).

    The kernels' host wrappers are built without TIR's assertions (:data:`BUILD_CONFIG`).
    """
    return compile_library(mod, target, database, winograd, rule_classes)[0]


#: The pass configuration of a library's build: TIR's assertions left out
#: (``tirx.disable_assert``). They are the argument checks of each kernel's host wrapper (the
#: type, rank, shape, strides and device of every buffer), made for callers that may pass
#: anything. A library's kernels are called by its own Relax VM code only, with the buffers its
#: memory plan made for them, and the VM checks the tensors a caller passes to the step and
#: the inference function itself. The checks are more than half of the host module's LLVM IR
#: and nine tenths of the time its object code takes (``docs/opencl.md``). Tuning builds
#: (:mod:`thomas_tune.measure.builder`) keep them: their kernels are called by MetaSchedule's
#: runner.
BUILD_CONFIG = {"tirx.disable_assert": True}


def compile_library(mod: tvm.IRModule, target: tvm.target.Target,
                    database: ms.Database | None = None, winograd=None, rule_classes=None
                    ) -> tuple[relax.VMExecutable, dict[str, list[str] | None]]:
    """:func:`compile_graph`, and the frozen slots of each function of ``mod`` that asks for
    lifting, as built (:func:`thomas_tune.tasks.lifted_slots`, read from this build's own
    fusion; what an export's manifest keeps)."""
    from ..half_arith import native_for
    slots: dict[str, list[str] | None] = {}
    with native_for(mod), tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        exe = tvm.compile(mod, codegen_target(target),
                          relax_pipeline=_pipeline(target, database, winograd, rule_classes,
                                                   slots),
                          tir_pipeline=tir_pipeline(target))
    return exe, slots
