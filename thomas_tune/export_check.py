"""The step check of an export (:func:`check_export`): its own ``train.so`` on the check batches
against PyTorch's float64 step that follows its decisions, judged by
:mod:`thomas_tune.step_check`'s bounds.

A float32 export is run (here or on a device server, on images or cached features) and its
loss and gradients compared with :func:`thomas_tune.step_check.reference_steps`' float64 step,
followed at the kinks where the build decided otherwise within rounding
(:func:`thomas_tune.step_check.following_step`). A mixed16 export run here is followed at its
float16 roundings too (:func:`thomas_tune.half_reference.round_like`): its stored tensors are
read from the check-only form of its step (:func:`thomas_tune.step_run.stored_step`, the
graph its manifest states compiled here), which are the build's where that form's loss is the
build's bit for bit; where it is not, the build's forward is not the stated step's and the
check fails it. The export's optimizer update is checked as well
(:mod:`thomas_tune.update_check`).
"""

from __future__ import annotations

import dataclasses
import os
import time

from .half_reference import Aligned
from .step_check import (CAP, CHECK_BATCHES, FACTOR, StepCheck, check_batches, compare_step,
                         following_step, manifest_frozen_bn, reference_steps)
from .step_run import export_step


def _following_roundings(export_dir: str, m, reference: dict, ours: list, seed: int,
                         frozen_bn, say) -> dict:
    """The reference steps (:func:`thomas_tune.step_check.reference_steps`) of a mixed16
    export on the batches of ``reference``, following the float16 roundings of the build: its
    stored tensors read by the check-only form of its step
    (:func:`thomas_tune.step_run.stored_step`: the graph its manifest states, compiled here),
    which are the build's where that form's loss is ``ours``' (the export's own ``train.so``
    on those batches) bit for bit: the result's ``"same_forward"`` says whether it is on every
    batch. Where it is not, the build's forward is not the step its manifest states (a wrong
    forward kernel; a build of another precision presented as mixed16) and the check fails it
    (:attr:`thomas_tune.step_check.StepCheck.aligned`); the roundings followed are then that
    step's, each still within one float16 step of the reference's own."""
    from .step_run import stored_step
    model, tensors, trainable, _ = reference["context"]
    t0 = time.perf_counter()
    stored = [stored_step(export_dir, x, y, mk, tensors)
              for (x, y), mk in zip(reference["batches"], reference["masks"])]
    # the forward is the build's where the loss is, bit for bit (its gradients may differ:
    # that is what the check judges)
    same = [loss == s[0] for (loss, _), s in zip(ours, stored)]
    if not all(same):
        say(f"[check] the build's loss differs from the stated mixed16 step's compiled here "
            f"on batch(es) {[i for i, v in enumerate(same) if not v]}: its forward is not "
            "that step's; the roundings followed are that step's")
    say(f"[check] the build's float16 tensors read back in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    out = reference_steps(model, tensors, trainable, m.batch, seed, frozen_bn,
                          precision="mixed16", halves=[s[2] for s in stored])
    out["same_forward"] = all(same)
    say(f"[check] PyTorch's float64 and float32 steps of {CHECK_BATCHES} batches, following "
        f"the build's float16 roundings, in {time.perf_counter() - t0:.1f} s")
    return out


def _follows_roundings(export_dir: str, m, rpc_session, cached: bool) -> tuple[bool, str]:
    """Whether the check follows the float16 roundings of export ``export_dir`` (manifest
    ``m``): a mixed16 build whose step runs here on images, and whose check-only form
    compiles (:func:`thomas_tune.step_run.stored_library`); and why not, for a mixed16 one."""
    if m.precision != "mixed16":
        return False, ""
    if rpc_session is not None or cached:
        return False, "its step runs on a device server or on cached features"
    from .step_run import stored_library
    try:
        stored_library(export_dir)
    except ValueError as err:
        return False, str(err)
    return True, ""


def _reference(export_dir: str, m, reference, seed: int, frozen_bn, follows: bool,
               say) -> dict:
    """``reference`` where it was made for this precision, else :func:`thomas_tune.
    step_check.reference_steps` of the export's own parameters; for a build whose roundings
    are followed, only the batches, masks and context (its reference is made from the
    build's stored tensors, :func:`_following_roundings`)."""
    if reference is not None and reference.get("precision", "float32") == m.precision:
        return reference
    from .models import load_checkpoint
    t0 = time.perf_counter()
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    if follows:
        xs, masks = check_batches(model, m.batch, seed)
        return {"batches": xs, "masks": masks,
                "context": (model, tensors, list(m.trainable), frozen_bn)}
    reference = reference_steps(model, tensors, m.trainable, m.batch, seed, frozen_bn,
                                precision=m.precision)
    say(f"[check] PyTorch's float64 and float32 steps of {CHECK_BATCHES} batches in "
        f"{time.perf_counter() - t0:.1f} s")
    return reference


def _followed(reference: dict, ours: list, say) -> list:
    """Per check batch, the float64 step following the build's decisions at the kinks
    (:func:`thomas_tune.step_check.following_step`), each batch's stage said with its time."""
    refs = []
    for i, o in enumerate(ours):
        t0 = time.perf_counter()
        refs.append(following_step(reference, i, o[1]))
        r, dt = refs[-1], time.perf_counter() - t0
        say(f"[check] batch {i}: " + (f"{r.ambiguous} element(s) within rounding of a kink "
            f"weighed, {len(r.flips)} decided as the build did" if r.ambiguous else
            "float64's own decisions explain the build") + f" ({dt:.1f} s)")
    return refs


def refuse_loss_scaled(m, export_dir: str) -> None:
    """ValueError for a loss-scaled export (manifest ``m``: activation gradients stored as
    float16, :mod:`thomas_tune.half_grads`): its step is unverifiable here, since the float64
    reference rounds the forward's layer outputs only (:mod:`thomas_tune.half_reference`), not
    the backward's gradients, and the update check drives the optimizer without a scale."""
    if m.loss_scale:
        raise ValueError(f"{export_dir}: a loss-scaled export (--loss-scale dynamic: activation "
                         "gradients stored as float16) is unverifiable by the step check, "
                         "whose float64 reference rounds only the forward's layer outputs to "
                         "float16; check the same model exported without --loss-scale")


def check_export(export_dir: str, seed: int = 0, frozen_bn: bool | set | None = None,
                 reference: dict | None = None, rpc_session=None,
                 cached: bool = False, say=None, train_lib=None) -> StepCheck:
    """Check an export's training step against PyTorch float64 following the build's branches
    (:mod:`thomas_tune.step_check`), at the build's precision (its manifest's: a mixed16 build
    against float64 rounding where it stores float16, :mod:`thomas_tune.half_reference`),
    on the :data:`~thomas_tune.step_check.CHECK_BATCHES` batches of ``seed``
    (:func:`~thomas_tune.step_check.reference_steps`), from the export's own parameters, with
    PyTorch float32's errors on the same batches as the yardstick. ``frozen_bn``: the
    BatchNorms in inference form, True for all or a set of names (None: as the export's
    manifest says); ``rpc_session``: run the export's step on that device server
    (:func:`thomas_tune.step_run.export_step`), its ``train.so`` loaded there once
    (``train_lib``: already loaded, e.g. by the :class:`thomas_tune.runtime.Session` about to
    be timed, so the server loads it only once); ``reference``: ``reference_steps`` already
    computed for this model, parameters, seed and precision (several exports of one step
    share it; one of another precision is made again; a mixed16 build run here gets a
    reference of its own, following its float16 roundings, module docstring); ``cached``:
    check the step on cached features. The export's optimizer update is checked too, against
    ``torch.optim`` on fresh values of ``seed`` (:mod:`thomas_tune.update_check`, the
    result's ``update``). ``say``: a callable given a line per stage with its wall time in s
    (the reference steps, each batch's following: at 224 px these take minutes). A mixed16
    export whose forward is not the step its manifest states fails
    (:func:`_following_roundings`). Raises ValueError as ``reference_steps``, and for a
    loss-scaled export (:func:`refuse_loss_scaled`: unverifiable). Needs torch."""
    from .manifest import Manifest
    from .update_check import check_update
    m = Manifest.read(export_dir)
    refuse_loss_scaled(m, export_dir)
    if frozen_bn is None:
        frozen_bn = manifest_frozen_bn(m)
    say = say or (lambda _line: None)
    follows, why = _follows_roundings(export_dir, m, rpc_session, cached)
    reference = _reference(export_dir, m, reference, seed, frozen_bn, follows, say)
    if rpc_session is not None and train_lib is None:
        from .remote import device_train_library
        train_lib = device_train_library(export_dir, rpc_session)
    ours = [export_step(export_dir, x, y, rpc_session=rpc_session, cached=cached, masks=mk,
                        tensors=reference["context"][1], train_lib=train_lib)
            for (x, y), mk in zip(reference["batches"], reference["masks"])]
    if follows:
        reference = _following_roundings(export_dir, m, reference, ours, seed, frozen_bn, say)
    elif why:
        say(f"[check] the build's float16 roundings are not followed: {why}")
    refs = _followed(reference, ours, say)
    yard = reference["yardstick"]
    check = compare_step([o[0] for o in ours], [o[1] for o in ours], [r.loss for r in refs],
                         [r.grads for r in refs], yard.errors, yard.loss_err,
                         reference["sums"])
    check.few_bn_values = reference.get("few_bn_values")
    check.flips = [len(r.flips) for r in refs]
    check.unresolved = sum(r.unresolved for r in refs)
    check.coverage = reference.get("coverage", {})
    if reference.get("aligned") is not None:
        total = Aligned()
        for a in reference["aligned"]:
            total = total.add(a)
        check.aligned = dict(dataclasses.asdict(total),
                             same_forward=reference.get("same_forward", True))
    if m.precision != "float32":  # (float32's bounds are capped; step_check's docstring)
        check.unverifiable = sorted(n for n, e in yard.errors.items() if FACTOR * e > CAP)
    (x, y), masks = reference["batches"][0], reference["masks"][0]
    check.update = check_update(export_dir, seed, rpc_session, (x, y, masks, ours[0][1]),
                                train_lib=train_lib)
    return check
