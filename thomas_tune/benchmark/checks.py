"""Each build's training step checked against PyTorch in float64 before the bench times it."""

from __future__ import annotations


def check_variants(exports: dict, seed: int, say=print) -> dict:
    """Each export's training step checked against PyTorch in float64, with PyTorch's float32
    step on the same batches as the yardstick (:func:`thomas_tune.step_check.check_export`,
    on the check batches of ``seed``). Returns variant ->
    :class:`~thomas_tune.step_check.StepCheck` plus ``"torch_float32"`` (PyTorch float32's own
    comparison); says one line per variant. Without PyTorch, says so and returns nothing
    checked: the bench then marks every time unchecked and gives no ratio of them."""
    import os

    from ..manifest import read_manifest
    from ..models import load_checkpoint
    from ..step_check import check_export, manifest_frozen_bn, reference_steps
    try:
        import torch  # noqa: F401
    except ImportError:
        say("[bench] PyTorch is not installed: the builds' numbers cannot be checked; their "
            "times are marked unchecked and enter no ratio")
        return {}
    if not exports:
        return {}
    out = {}
    first = next(iter(exports.values()))
    m = read_manifest(first)
    model, tensors, _ = load_checkpoint(os.path.join(first, "params.npz"))
    ref = reference_steps(model, tensors, m["trainable"], m["batch"], seed,
                          manifest_frozen_bn(m))
    for variant in sorted(exports, key=lambda v: v != "default"):
        out[variant] = c = check_export(exports[variant], seed, reference=ref)
        say(f"[bench] numbers of {variant} against PyTorch float64: {c.line()}")
    out["torch_float32"] = c = ref["yardstick"]
    name, err = c.worst
    # the yardstick itself: its errors set the bounds, so no verdict of right or wrong
    say(f"[bench] PyTorch's float32 step against its float64 step (the yardstick of the "
        f"bounds): loss {c.loss:.6f} (float64 {c.loss_ref:.6f}), relative error "
        f"{c.loss_err:.1e}; {len(c.errors)} gradients, worst {name} {err:.1e}")
    return out


def torch_float32_check(export_dir: str, seed: int):
    """PyTorch's own float32 step (TF32 off) compared with its float64 step on the check
    batches of :func:`thomas_tune.step_check.check_export`: the rounding float32 alone brings
    to this network and these batches (a :class:`~thomas_tune.step_check.StepCheck` against
    the rounding floors alone)."""
    import os

    from ..manifest import read_manifest
    from ..models import load_checkpoint
    from ..step_check import manifest_frozen_bn, reference_steps
    m = read_manifest(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    return reference_steps(model, tensors, m["trainable"], m["batch"], seed,
                           manifest_frozen_bn(m))["yardstick"]
