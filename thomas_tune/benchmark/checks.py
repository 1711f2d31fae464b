"""Each build's training step checked against PyTorch in float64 before the bench times it."""

from __future__ import annotations


def check_variants(exports: dict, seed: int, say=print) -> dict:
    """Each export's training step checked against PyTorch in float64
    (:func:`thomas_tune.step_check.check_export`, on one batch drawn from ``seed``): the
    default-schedule build first, whose errors bound the others'. Returns variant ->
    :class:`~thomas_tune.step_check.StepCheck`; says one line per variant. Without PyTorch,
    says so and returns nothing checked."""
    from ..step_check import check_export
    try:
        import torch  # noqa: F401
    except ImportError:
        say("[bench] PyTorch is not installed: the builds' numbers are not checked")
        return {}
    out = {}
    order = sorted(exports, key=lambda v: v != "default")
    for variant in order:
        yard = out.get("default") if variant != "default" else None
        out[variant] = c = check_export(exports[variant], seed, yardstick=yard)
        say(f"[bench] numbers of {variant} against PyTorch float64: {c.line()}")
    if exports:  # PyTorch's own float32 step on the same batch: how far float32 rounding goes
        out["torch_float32"] = c = torch_float32_check(next(iter(exports.values())), seed)
        say(f"[bench] PyTorch's float32 step against its float64 step: {c.line()}")
    return out


def torch_float32_check(export_dir: str, seed: int):
    """PyTorch's own float32 step (TF32 off) compared with its float64 step on the batch of
    :func:`thomas_tune.step_check.check_export`: the rounding float32 alone brings to this
    network and batch (a :class:`~thomas_tune.step_check.StepCheck`, judged as an untuned
    build)."""
    import os

    from ..manifest import read_manifest
    from ..models import load_checkpoint
    from ..step_check import batch, compare_step, torch_step
    m = read_manifest(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    x, y = batch(model, m["batch"], seed)
    frozen_bn = set(m.get("frozen_bn", []))
    ref = torch_step(model, tensors, m["trainable"], x, y, frozen_bn)
    got = torch_step(model, tensors, m["trainable"], x, y, frozen_bn, dtype="float32")
    return compare_step(*got, *ref)
