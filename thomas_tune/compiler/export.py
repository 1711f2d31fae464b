"""Export: compile the inference and the training module with a tuning log and write them out.

An export folder holds::

    inference.so   predict(x, params..., states...) at the inference batch size
    train.so       train_adjoint, optimizer, and predict at the training batch size; with
                   ``cache_features``, also ``features`` (the frozen part alone) and
                   ``train_head_adjoint`` (the trainable layers' step on features)
    params.npz     the model's parameters and states (a models/ checkpoint, with class names)
    manifest.json  model, shapes, target, host triple, trainable/frozen sets, optimizer,
                   tuning-log hash, class names (:class:`thomas_tune.manifest.Manifest`, the
                   export format)

The libraries are linked for the target's host: this machine, or another architecture through
the cross compiler of ``TVM_NDK_CC`` (``target.export_shared``); ``host_triple`` in the manifest
says which. ``train.so`` also holds ``pack_trainable`` and ``pack_optimizer_state`` (tensors ->
one tuple): over RPC, where tuples of tensors cannot be sent, they make the optimizer's first
inputs on the device; and, for a model with dropout, ``draw_masks`` (a step's seed -> its
dropout masks, drawn on the device: :mod:`thomas_tune.training_graph.dropout`).

Every file is written to a temporary name and renamed, manifest last, so a folder with a
manifest is complete.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import NamedTuple

import numpy as np
import tvm

from ..training_graph import graph as G, lift
from .compile import compile_library, record_gains, tuned_build
from .build_plan import BuildPlan, check_plan
from .record_check import check_in_background, wait_background
from ..training_graph.library_module import training_library_module
from ..manifest import ADJOINT, FEATURES, PREDICT, TRAIN_STEP, Manifest
from ..files import replacing
from ..models import save_checkpoint, spec
from ..schedules import STOCK_RULES
from ..target import cross_compiler, describe, export_shared, host_triple
from ..limits import step_buffers
from ..loss_scale import require_mixed16
from ..logs import TuningLog


def log_hash(log: TuningLog | None) -> str | None:
    """sha256 of the tuning log's two files (workloads, then records), or None without a log."""
    if log is None:
        return None
    h = hashlib.sha256()
    for path in (log.workload_path, log.record_path):
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class _GraphModules(NamedTuple):
    """The graph modules an export compiles: ``tg`` the training graph
    (:func:`thomas_tune.training_graph.graph.training_module`), ``train`` its library module with
    the frozen parameters' transforms lifted out (:func:`training_library_module`), ``lift_inputs``
    the tensors its ``*_frozen`` functions take (None when nothing was lifted), ``infer`` the
    inference module at the inference batch, its ``predict`` marked for lifting."""

    tg: G.TrainingGraph
    train: tvm.IRModule
    lift_inputs: list[str] | None
    infer: tvm.IRModule


def _graph_modules(model, batch: int, infer_batch: int, trainable: str,
                   optimizer: G.OptimizerConfig | None, cache_features: bool,
                   precision: str = "float32", recompute=None,
                   loss_scale=None) -> _GraphModules:
    """The training and inference modules of ``model`` at ``batch`` and ``infer_batch``
    images (:class:`_GraphModules`), their layer outputs stored as float16 for ``precision``
    ``mixed16`` (:mod:`thomas_tune.half_storage`), the training step recomputing what
    ``recompute`` (a memory budget's plan, :mod:`thomas_tune.recompute`) says, its activation
    gradients stored as float16 with ``loss_scale`` (:mod:`thomas_tune.half_grads`). Raises
    ValueError for a bad trainable set or optimizer, and for ``cache_features`` with a
    trainable set whose frozen part is not the same at every step
    (:func:`thomas_tune.training_graph.graph.training_module`)."""
    from ..half_arith import rewrite_for
    from ..half_storage import inference_precision
    from ..memory_plan import step_graph
    # the step as memory_plan estimates it: the budget's plan, then the precision
    tg = step_graph(G.training_module(model, batch, trainable, optimizer,
                                      features=cache_features), batch, recompute, precision,
                   loss_scale)
    infer_mod = inference_precision(precision, G.inference_module(model, infer_batch),
                                    infer_batch, rewrite_for(precision))
    train_mod, lift_inputs = training_library_module(tg)
    s = spec(model)
    n_constant = len(s.params) + len(s.states)
    infer_mod[PREDICT] = infer_mod[PREDICT].with_attr(lift.ATTR, [1, n_constant])
    return _GraphModules(tg, train_mod, lift_inputs, infer_mod)


def _refuse_float32_only(precision: str, cache_features: bool, memory_budget) -> None:
    """ValueError for a ``precision`` :mod:`thomas_tune.half_storage` does not know, for a
    half precision with ``cache_features`` (built in float32 only) and for ``autocast16``
    with a ``memory_budget`` (planned in float32 and mixed16 only), before any work."""
    from ..half_storage import check_precision
    if check_precision(precision) == "float32":
        return
    for given, option, only in ((cache_features, "--cache-features", "float32"),
                                (memory_budget and precision != "mixed16", "--memory-budget",
                                 "float32 and mixed16")):
        if given:
            raise ValueError(f"{option} is built in {only} only: drop --precision "
                             f"{precision} or {option}")


def _refuse_unchecked_log(target: tvm.target.Target, log: TuningLog | None,
                          check_records: bool) -> None:
    """Fail before any work: ValueError for a foreign host without a working cross compiler
    (:func:`thomas_tune.target.cross_compiler`), and for a ``log`` whose records no device of
    this machine can check while ``check_records`` is True."""
    cross_compiler(target)
    if log is not None and check_records:  # no unchecked record reaches a build silently
        from .record_check import CheckUnavailable, local_device
        try:
            local_device(target)
        except CheckUnavailable as err:
            raise ValueError(f"the tuning records of {log.path} cannot be checked on this "
                             f"machine ({err}); export applies no unchecked record: give "
                             "--no-check to apply them unchecked (the manifest's record_check "
                             "then says so)") from None


class _Libraries(NamedTuple):
    """What a build of both libraries chose: ``winograd`` the convolutions in the Winograd
    form (``{"infer": set, "train": set}`` of
    :class:`thomas_tune.training_graph.winograd_form.Conv`) and ``slots`` the frozen slots of each
    library's lifted functions as built (``{"infer": {name: slots}, "train": {name: slots}}``,
    :func:`thomas_tune.compiler.compile.compile_library`); ``database`` the records compiled
    with (None: default schedules)."""

    winograd: dict
    slots: dict
    database: object = None


def _refuse_before_work(target: tvm.target.Target, log: TuningLog | None, check_records: bool,
                        precision: str, cache_features: bool, memory_budget, device,
                        device_profile, progress) -> None:
    """Every refusal :func:`export` makes before any work, as ValueError:
    :func:`_refuse_float32_only`, a half-arithmetic precision for a device without
    ``cl_khr_fp16`` (:func:`thomas_tune.half_arith.refuse_without_fp16`) and
    :func:`_refuse_unchecked_log`."""
    from ..half_arith import refuse_without_fp16
    _refuse_float32_only(precision, cache_features, memory_budget)
    refuse_without_fp16(precision, target, device, device_profile, log, check_records, progress)
    _refuse_unchecked_log(target, log, check_records)


def _write_libraries(out_dir: str, mods: _GraphModules, target: tvm.target.Target, rules,
                     progress, plan: BuildPlan | None) -> _Libraries:
    """Compile both modules of ``mods`` with ``plan``'s schedules and Winograd choice (None:
    default schedules, ``rules`` for them, None for thomas_tune's) and write ``inference.so``
    and ``train.so`` into ``out_dir``, linked for the target's host."""
    database = plan.database if plan else None
    wino = plan.winograd if plan else {"infer": set(), "train": set()}
    if wino["infer"] or wino["train"]:
        progress(f"Winograd form for {len(wino['infer'])} inference and "
                 f"{len(wino['train'])} training convolution(s): their tuned kernels are "
                 "faster than the direct ones")
    slots = {}
    for which, mod, file, what in (("infer", mods.infer, "inference.so", "inference"),
                                   ("train", mods.train, "train.so", "training")):
        t0 = time.perf_counter()
        exe, slots[which] = compile_library(mod, target, database, wino[which], rules)
        progress(f"compiled {what} module in {time.perf_counter() - t0:.1f} s")
        with replacing(os.path.join(out_dir, file), executable=True) as p:
            export_shared(exe, p, target)
    return _Libraries(wino, slots, database)


def _build_with_log(log: TuningLog | None, version, target: tvm.target.Target,
                    mods: _GraphModules, write, check_records: bool, progress,
                    left_out: dict | None = None) -> tuple[_Libraries, dict]:
    """Write the libraries (``write(plan)``, :func:`_write_libraries`) with the records of
    ``log`` (of code-generation ``version``, :meth:`thomas_tune.logs.TuningLog.version`) that
    pass the record check, or with default schedules without a log. The build's plan
    (:class:`thomas_tune.compiler.build_plan.BuildPlan`) is made once; its records are checked in
    child processes while this one compiles with all of them, and a wrong one (rare) means
    compiling again with the plan made without it
    (:func:`thomas_tune.compiler.build_plan.check_plan`). Returns what the build chose
    (:class:`_Libraries`) and the manifest's ``record_check`` (``checked``, ``wrong``,
    ``unchecked``). The records of ``left_out`` (workload keys: the memory budget's,
    :func:`thomas_tune.memory_plan.trade_records`) are not applied."""
    if version is not None and version.status != "current":
        progress(f"tuning log {log.path}: its records were measured with {version.line()}; "
                 "their times are used as they are ('thomas-tune export' refuses such a log "
                 "without --any-codegen)")
    if log is None:
        return write(None), {"checked": None, "wrong": {}, "unchecked": "no tuning log"}
    plan = BuildPlan.from_log(log, target, {"infer": mods.infer, "train": mods.train},
                              left_out={k: "its scratch buffers hold the step over the memory "
                                        "budget" for k in left_out or {}})
    if not check_records:
        checked, checks = plan, {"checked": None, "wrong": {},
                                 "unchecked": "--no-check: the records were applied unchecked"}
        built = write(plan)
    else:
        t0 = time.perf_counter()
        background = check_in_background(plan.tasks, plan.database, target)
        try:
            built = write(plan)
        except BaseException:
            wait_background(background, kill=True)
            raise
        wait_background(background, say=progress)
        checked, checks = check_plan(plan, say=progress, started=t0)
    if checked.slower:
        progress(f"{checked.slower} workload(s) keep their default schedule: their best "
                 "tuning record is slower on the device")
    return (built if checked is plan else write(checked)), checks


def _manifest(mods: _GraphModules, built: _Libraries, checks: dict, target: tvm.target.Target,
              *, infer_batch: int, log: TuningLog | None, version, classes: list[str] | None,
              device: dict | None, stock_defaults: bool, precision: str, memory_budget,
              loss_scale=None) -> Manifest:
    """The export's manifest (:class:`thomas_tune.manifest.Manifest`): the model of ``mods.tg``
    and its shapes, the target and host triple, the trainable and frozen sets and the lifted
    slots of each step function as ``built``, the optimizer, the tuning log (path, SHA-256,
    its code-generation ``version``), the record check (``checks``), the Winograd choice,
    class names, the device limits, the step's largest buffers, the precision, the memory
    budget's plan and the loss scaling (a :class:`thomas_tune.loss_scale.LossScale` or None)."""
    tg, model = mods.tg, mods.tg.model
    s = spec(model)
    train_slots, wino = built.slots["train"], built.winograd
    step_slots = train_slots.get(ADJOINT)
    return Manifest(
        arch=model.arch, config=model.config(), input_shape=list(model.input_shape(infer_batch)),
        batch=tg.batch, infer_batch=infer_batch, target=json.loads(str(target)),
        target_name=describe(target), host_triple=host_triple(target),
        params=[p.name for p in s.params], states=[p.name for p in s.states],
        trainable=tg.trainable, frozen=tg.frozen, frozen_slots=step_slots,
        frozen_lift_inputs=mods.lift_inputs if step_slots else None,
        train_step_slots=train_slots.get(TRAIN_STEP),
        predict_slots=built.slots["infer"].get(PREDICT), features_slots=train_slots.get(FEATURES),
        batchnorm=tg.batchnorm, frozen_bn=sorted(tg.frozen_bn),
        masks={k: {"shape": list(v[0]), "p": v[1]} for k, v in tg.masks.items()},
        features=tg.features.as_dict() if tg.features else None,
        optimizer=dataclasses.asdict(tg.optimizer),
        tuning_log=log.path if log is not None else None, tuning_log_sha256=log_hash(log),
        tuning_log_codegen=None if version is None else {
            "status": version.status, "id": (version.stamp or {}).get("id")},
        default_rules="stock" if stock_defaults else "thomas_tune", record_check=checks,
        winograd={"inference": [dataclasses.asdict(c) for c in sorted(wino["infer"], key=repr)],
                  "training": [dataclasses.asdict(c) for c in sorted(wino["train"], key=repr)]},
        classes=list(classes) if classes else None, device=device,
        buffers=step_buffers(tg.mod[ADJOINT]), precision=precision, memory_budget=memory_budget,
        loss_scale=loss_scale.as_dict() if loss_scale is not None else None)


def _budget_plan(model, batch: int, trainable: str, optimizer, memory_budget: int | None,
                 cache_features: bool, progress, precision: str = "float32",
                 loss_scale=None, log: TuningLog | None = None, target=None
                 ) -> tuple[object, dict | None]:
    """The recomputation plan of ``memory_budget`` bytes (None: no budget) for the step at
    ``precision``, the manifest's ``memory_budget`` record (the budget, the level chosen, the
    estimated peak, bytes saved, FLOPs added, tensors recomputed, the tuning records left out
    for their kernels' scratch buffers). With ``log``, its records for ``target`` as the build
    applies them: the scratch buffers of their kernels counted
    (:func:`thomas_tune.memory_plan.kernel_scratch`), and records left out where that fits
    (:func:`thomas_tune.memory_plan.trade_records`). Raises ValueError with
    ``cache_features``, and :class:`thomas_tune.recompute.BudgetError` when no plan fits."""
    if memory_budget is None:
        return None, None
    if cache_features:
        raise ValueError("--memory-budget plans the whole step; the step on cached features "
                         "(--cache-features) keeps only the last layers' tensors: drop one "
                         "of the two")
    from ..memory_plan import plan_for_budget
    records = gain = None
    if log is not None:
        records, _, kernel_ms = tuned_build(log, target)
        gain = record_gains(log, target, kernel_ms)
    plan, tried = plan_for_budget(model, batch, trainable, optimizer, int(memory_budget),
                                  say=lambda m: progress(f"memory budget: {m}"),
                                  precision=precision, loss_scale=loss_scale,
                                  database=records, target=target, record_gain=gain)
    chosen = next(t for t in tried if t["level"] == plan.level)
    left = chosen["records_left_out"]
    progress(f"memory budget {memory_budget / 1e6:.1f} MB: {plan.level} recomputation "
             f"({len(plan.recomputed)} tensors made again in the backward, "
             f"{chosen['saved_bytes'] / 1e6:.1f} MB saved, "
             f"{plan.flops_added / 1e9:.3f} GFLOP added), estimated peak "
             f"{chosen['peak_bytes'] / 1e6:.1f} MB" + (
                 f"; {len(left)} tuning record(s) left out for their kernels' scratch buffers "
                 f"({', '.join(v['kernel'] for v in left.values())}: "
                 f"{sum(v['scratch_bytes'] for v in left.values()) / 1e6:.1f} MB of scratch, "
                 f"{sum(v['ms_added'] for v in left.values()):.3f} ms per step added as timed "
                 "on the device)" if left else ""))
    return plan, {"budget_bytes": int(memory_budget), "level": plan.level,
                  "estimated_peak_bytes": chosen["peak_bytes"],
                  "saved_bytes": chosen["saved_bytes"], "flops_added": plan.flops_added,
                  "recomputed": [r.name for r in plan.recomputed],
                  "records_left_out": left}


def _budget_with_winograd(budget: dict, tg: G.TrainingGraph, wino: set, progress,
                          records=None, target=None) -> dict:
    """The manifest's ``memory_budget`` with the estimated peak of the step as built, its
    training convolutions ``wino`` in the Winograd form (their transforms hold more), and a
    message when that is over the budget (the build is kept: its record times chose it).
    ``tg``: the step's graph as compiled (its plan and precision already applied);
    ``records``: the records it was compiled with (their kernels' scratch buffers counted),
    for ``target``."""
    from ..memory_plan import compiled_step_memory
    peak = compiled_step_memory(tg.model, tg.batch, tg.trainable, tg.optimizer,
                                winograd=wino, tg=tg, database=records, target=target).peak
    if peak > budget["budget_bytes"]:
        progress(f"memory budget {budget['budget_bytes'] / 1e6:.1f} MB: with the "
                 f"{len(wino)} training convolution(s) the tuning log puts in the Winograd "
                 f"form the step is estimated at {peak / 1e6:.1f} MB, over the budget; "
                 "export without --log, or with a larger budget")
    return dict(budget, estimated_peak_bytes=peak)


def export(out_dir: str, model, tensors: dict[str, np.ndarray], target: tvm.target.Target,
           batch: int = 8, infer_batch: int = 1, trainable: str = "all",
           optimizer: G.OptimizerConfig | None = None, log: TuningLog | None = None,
           classes: list[str] | None = None, progress=print, device: dict | None = None,
           stock_defaults: bool = False, check_records: bool = True,
           cache_features: bool = False, precision: str = "float32",
           memory_budget: int | None = None, device_profile: dict | None = None,
           loss_scale=None) -> Manifest:
    """Compile and write the export folder (see the module docstring); returns its manifest.

    ``tensors``: parameters and states (float32, shapes of ``models.spec``); ``batch``: images
    per training step; ``classes``: class names; ``device``: the device limits the target was
    made from (:func:`thomas_tune.target.device_limits`); ``stock_defaults``: TVM's own default
    GPU rules for kernels without a record (a ``bench`` baseline); ``check_records``: each
    record applied is first run on this machine's device against its default schedule, a
    wrong one left out (:func:`thomas_tune.compiler.build_plan.check_plan`; the manifest's
    ``record_check``); ``cache_features``: the step split at the frozen part's output is
    compiled too (``train --cache-features``; the manifest's ``features``); ``precision``:
    ``float32``, ``mixed16`` (:mod:`thomas_tune.half_storage`) or ``autocast16``
    (:mod:`thomas_tune.half_arith`: only where ``device_profile``, ``device`` or the target
    says the device reports ``cl_khr_fp16``); ``memory_budget``: bytes the step may hold,
    recomputing what :func:`thomas_tune.memory_plan.plan_for_budget` chooses;
    ``loss_scale``: a :class:`thomas_tune.loss_scale.LossScale` (mixed16 only): the
    activation gradients stored as float16 too, the step loss-scaled
    (:mod:`thomas_tune.half_grads`; the manifest's ``loss_scale``). Raises, before
    compiling anything, ValueError for a bad trainable set, optimizer or precision (a half one
    with ``cache_features``, ``autocast16`` with ``memory_budget`` or for a device without
    ``cl_khr_fp16``; ``loss_scale`` at another precision than mixed16), for
    ``cache_features`` whose frozen part changes between steps, for a ``log`` no device
    here can check while ``check_records`` is True, for a foreign host without a cross
    compiler, and :class:`thomas_tune.recompute.BudgetError` (naming the
    smallest budget that fits). A log of another code-generation version is used with a
    message (the manifest's ``tuning_log_codegen``); the ``export`` verb refuses it."""
    _refuse_before_work(target, log, check_records, precision, cache_features, memory_budget,
                        device, device_profile, progress)
    if loss_scale is not None:
        require_mixed16(precision)
    plan, budget = _budget_plan(model, batch, trainable, optimizer, memory_budget,
                                cache_features, progress, precision, loss_scale, log, target)
    left_out = (budget or {}).get("records_left_out") or {}
    os.makedirs(out_dir, exist_ok=True)
    mods = _graph_modules(model, batch, infer_batch, trainable, optimizer, cache_features,
                          precision, plan, loss_scale)
    write = functools.partial(_write_libraries, out_dir, mods, target,
                              STOCK_RULES if stock_defaults else None, progress)
    version = log.version() if log is not None else None
    built, checks = _build_with_log(log, version, target, mods, write, check_records, progress,
                                    left_out)
    save_checkpoint(os.path.join(out_dir, "params.npz"), model, tensors, classes)
    with replacing(os.path.join(out_dir, "optim_state.npz")) as p:
        np.savez(p, **{f"s{i}": a for i, a in enumerate(mods.tg.optim_state)})
    if budget and built.winograd["train"]:  # the plan was measured without the Winograd form
        budget = _budget_with_winograd(budget, mods.tg, built.winograd["train"], progress,
                                       built.database, target)
    manifest = _manifest(mods, built, checks, target, infer_batch=infer_batch, log=log,
                         version=version, classes=classes, device=device,
                         stock_defaults=stock_defaults, precision=precision,
                         memory_budget=budget, loss_scale=loss_scale)
    manifest.write(out_dir)  # last: a folder with a manifest is complete
    return manifest
