"""Each build's training step checked against PyTorch in float64 before the bench times it."""

from __future__ import annotations


def bench_reference(exports: dict, seed: int) -> dict | None:
    """PyTorch's float64 and float32 steps on the check batches of ``seed``
    (:func:`thomas_tune.step_check.reference_steps`) for the model, parameters, trainable set
    and batch of the first export of ``exports`` (variant -> folder): what every side of one
    bench is checked against. None without PyTorch or without an export."""
    import os

    from ..manifest import Manifest
    from ..models import load_checkpoint
    from ..step_check import manifest_frozen_bn, reference_steps
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    if not exports:
        return None
    first = next(iter(exports.values()))
    m = Manifest.read(first)
    model, tensors, _ = load_checkpoint(os.path.join(first, "params.npz"))
    return reference_steps(model, tensors, m.trainable, m.batch, seed,
                           manifest_frozen_bn(m))


def check_variants(exports: dict, seed: int, say=print, reference: dict | None = None,
                   progress=None) -> dict:
    """Each export's training step checked against PyTorch in float64, with PyTorch's float32
    step on the same batches as the yardstick (:func:`thomas_tune.export_check.check_export`,
    on the check batches of ``seed``; ``reference``: :func:`bench_reference` already
    computed; ``progress``: given a line per stage of each check with its time, or None).
    Returns variant ->
    :class:`~thomas_tune.step_check.StepCheck` plus ``"torch_float32"`` (PyTorch float32's own
    comparison); says one line per variant. Without PyTorch, says so and returns nothing
    checked: the bench then marks every time unchecked and gives no ratio of them."""
    from ..export_check import check_export
    try:
        import torch  # noqa: F401
    except ImportError:
        say("[bench] PyTorch is not installed: the builds' numbers cannot be checked; their "
            "times are marked unchecked and enter no ratio")
        return {}
    if not exports:
        return {}
    out = {}
    ref = reference if reference is not None else bench_reference(exports, seed)
    for variant in sorted(exports, key=lambda v: v != "default"):
        out[variant] = c = check_export(exports[variant], seed, reference=ref, say=progress)
        say(f"[bench] numbers of {variant} against PyTorch float64: {c.line()}")
    out["torch_float32"] = c = ref["yardstick"]
    name, err = c.worst
    # the yardstick itself: its errors set the bounds, so no verdict of right or wrong
    say(f"[bench] PyTorch's float32 step against its float64 step (the yardstick of the "
        f"bounds): loss {c.loss:.6f} (float64 {c.loss_ref:.6f}), relative error "
        f"{c.loss_err:.1e}; {len(c.errors)} gradients, worst {name} {err:.1e}")
    return out


def check_torch_side(side, reference: dict, eager=None):
    """A PyTorch side's training step (a :class:`~thomas_tune.benchmark.timing.TorchSide`,
    e.g. compiled with ``torch.compile``) checked as an export is
    (:func:`thomas_tune.export_check.check_export`): its loss and every trainable gradient on
    the check batches of ``reference`` (:func:`bench_reference`), dropout off, from the
    parameters it was made with, against PyTorch float64 with PyTorch float32's errors as
    the yardstick. With ``eager`` (a TorchSide of the same network, eager, made from the same
    parameters), the same step compared with that eager float32 step
    on the same batches too, against the rounding floors alone. Returns (StepCheck against
    float64, StepCheck against eager or None). The side's optimizer is not stepped; its
    gradients are left set."""
    from ..step_check import compare_step

    def run(s):
        out = []
        with s.no_dropout():
            for x, y in reference["batches"]:
                out.append(s.loss_and_grads(s.torch.tensor(x).to(s.dev),
                                            s.torch.tensor(y).to(s.dev)))
        return [o[0] for o in out], [o[1] for o in out]

    from ..step_check import torch_step
    losses, grads = run(side)
    yard = reference["yardstick"]
    model, tensors, trainable, frozen_bn = reference["context"]
    # the side runs with dropout off: its float64 step too (float64's own branches: a side
    # is not a build whose branches the reference follows)
    f64 = [torch_step(model, tensors, trainable, x, y, frozen_bn)
           for x, y in reference["batches"]]
    check = compare_step(losses, grads, [r[0] for r in f64], [r[1] for r in f64], yard.errors,
                         yard.loss_err, reference["sums"])
    check.few_bn_values = reference.get("few_bn_values")
    against = None
    if eager is not None:
        against = compare_step(losses, grads, *run(eager))
    return check, against


def torch_float32_check(export_dir: str, seed: int):
    """PyTorch's own float32 step (TF32 off) compared with its float64 step on the check
    batches of :func:`thomas_tune.export_check.check_export`: the rounding float32 alone brings
    to this network and these batches (a :class:`~thomas_tune.step_check.StepCheck` against
    the rounding floors alone)."""
    import os

    from ..manifest import Manifest
    from ..models import load_checkpoint
    from ..step_check import manifest_frozen_bn, reference_steps
    m = Manifest.read(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    return reference_steps(model, tensors, m.trainable, m.batch, seed,
                           manifest_frozen_bn(m))["yardstick"]
