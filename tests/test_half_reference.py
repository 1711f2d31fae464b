"""The step check of a half-storage build (``--precision mixed16``): its float64 reference
rounds to float16 where the build stores float16 (thomas_tune.half_reference, stated from the
model's layers in PyTorch), and it tells a right mixed16 build from wrong ones.

* The places: the float16 tensors of the build's training step (read from the compiled graph's
  forward pass) and the tensors the reference rounds are the same, shape for shape, for every
  kind of layer (convolutions with and without bias, training-form and frozen BatchNorms, the
  fold of a frozen BatchNorm into a frozen convolution, residual sums, pools, dropout, the
  classifier).
* The check: a right mixed16 llvm build passes against its reference and fails against the
  plain float64 step (whose measure of the forward's rounding is float32's: it cannot follow
  the branches float16 storage moves); builds with a gradient 1% off fail.
* The reference follows the build's float16 roundings (thomas_tune.half_reference.round_like:
  the build's stored value where it is the other float16 neighbour of the reference's own
  unrounded value, never beyond one step), read back by the check-only form of the step
  (thomas_tune.step_run.stored_step), paired place by place in order. Without that, small
  MobileNetV2s are not checkable at mixed16 (PyTorch's own half-storage step is over the cap's
  share); with it, a right mixed16 MobileNetV2 passes on fresh seeds and one whose first
  convolution computes one image 1% off fails; a float32 build presented as mixed16 fails.
"""

import collections

import pytest

torch = pytest.importorskip("torch")

CASES = {  # (model, configuration, trainable): every kind of stored layer output between them
    "mobilenet_v2-all": ("mobilenet_v2", dict(num_classes=5, resolution=32, width=0.35), "all"),
    "mobilenet_v2-last2": ("mobilenet_v2", dict(num_classes=5, resolution=32, width=0.35),
                           "last:2"),
    "alexnet-all": ("alexnet", dict(num_classes=5, resolution=67, width=0.1), "all"),
}


def _built_stores(model, batch, trainable):
    """The shapes of the float16 tensors the mixed16 step stores (its forward pass), in the
    order it makes them."""
    from tvm import relax

    from thomas_tune.training_graph import graph as G
    from thomas_tune.half_storage import apply_precision
    from thomas_tune.manifest import ADJOINT
    tg = G.training_module(model, batch, trainable)
    train, _ = apply_precision("mixed16", tg.mod, G.inference_module(model, 1), batch, 1)
    shapes = []

    def visit(e):
        if isinstance(e, relax.VarBinding) and "_f16" in e.var.name:
            ty = e.var.ty
            if ty.dtype == "float16":
                shapes.append(tuple(int(v) for v in ty.shape.values))

    for block in train[ADJOINT].body.blocks:
        for b in block.bindings:
            visit(b)
    return shapes, tg


def _reference_rounds(model, batch, tg, monkeypatch):
    """The shapes of the tensors the reference's forward pass rounds to float16, in order."""
    import numpy as np

    from thomas_tune import half_reference as H
    from thomas_tune.kink_step import torch_forward
    from thomas_tune.models import init_params
    from thomas_tune.step_check import batch as check_batch
    from thomas_tune.step_check import dropout_masks
    seen = []
    plain = H.round_half

    def recording(t):
        seen.append(tuple(t.shape))
        return plain(t)

    monkeypatch.setattr(H, "round_half", recording)
    x, y = check_batch(model, batch, 0)
    torch_forward(model, init_params(model, seed=1), tg.trainable, x, y, tg.frozen_bn,
                  masks=dropout_masks(model, batch, 0), precision="mixed16")
    assert np.isfinite(x).all()
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reference_rounds_where_the_build_stores_half(case, monkeypatch):
    from thomas_tune.models import build
    arch, config, trainable = CASES[case]
    model = build(arch, **config)
    built, tg = _built_stores(model, 4, trainable)
    rounded = _reference_rounds(model, 4, tg, monkeypatch)
    b, r = collections.Counter(built), collections.Counter(rounded)
    assert built and b == r, (
        f"stored by the build but not rounded by the reference: {b - r}; rounded "
        f"but not stored: {r - b}")
    # the same order too: the check pairs the build's stored tensors with the places by it
    assert built == rounded


ALEXNET = dict(num_classes=5, resolution=67, width=0.1)


def _alexnet_export(path, precision, mutant=None):
    """An llvm export of AlexNet 0.1@67 (every layer, batch 8) at ``precision``, built under
    ``mutant`` (a context of tests/mutants.py) when given; LLVM's optimisation off
    (``compile.reference_target``): the same loss and gradients to the last bit, at mixed16 as
    at float32 (docs/journal/suite.md), in half the build's CPU time."""
    import contextlib

    from thomas_tune.compiler.compile import reference_target
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    model = build("alexnet", **ALEXNET)
    with mutant if mutant is not None else contextlib.nullcontext():
        export(str(path), model, init_params(model, seed=11), reference_target(parse_target(
            "llvm")), batch=8,
               trainable="all", precision=precision, progress=lambda *_: None)
    return str(path)


def _claim(export_dir, precision):
    """The export's manifest made to say ``precision`` (what the check reads to pick its
    reference), as a build of another precision would be presented."""
    import json
    import os
    path = os.path.join(export_dir, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["precision"] = precision
    with open(path, "w") as f:
        json.dump(m, f)


@pytest.fixture(scope="module")
def mixed_alexnet(tmp_path_factory):
    return _alexnet_export(tmp_path_factory.mktemp("half") / "mixed16", "mixed16")


def test_a_right_mixed16_build_passes_against_its_rounding_reference(mixed_alexnet, rng):
    """The right mixed16 build passes on fresh seeds, within the bounds of PyTorch float32
    rounded the same way; no parameter is beyond what the check can see."""
    from thomas_tune.export_check import check_export
    seed = int(rng.integers(0, 10_000))
    check = check_export(mixed_alexnet, seed=seed)
    print(seed, check.line())
    assert check.ok and not check.unverifiable, check.line()


def test_a_right_mixed16_build_fails_against_the_plain_reference(mixed_alexnet, tmp_path):
    """The right mixed16 build presented as float32 (checked against float64 without the
    rounding, whose branches lie within float32's rounding only) fails by far: float16
    storage moves many ReLU and max-pool inputs across their kinks, which only the rounding
    reference's measure of the forward's rounding lets the check follow."""
    import shutil

    from thomas_tune.export_check import check_export
    plain = str(tmp_path / "as_float32")
    shutil.copytree(mixed_alexnet, plain)
    _claim(plain, "float32")
    check = check_export(plain, seed=0)
    print(check.line())
    assert not check.ok and max(check.errors.values()) > 10 * CAP_SHARE, check.line()


#: how far over the cap the wrong reference puts a right build (measured: 0.18 and 0.11)
CAP_SHARE = 1e-2


def test_a_mixed16_build_with_a_gradient_1_percent_off_fails(tmp_path):
    """The max pool's gradient 1% too large (the kink the rounding reference follows most):
    several parameters over their bounds (measured 1.2e-2 against 2.0e-3; a convolution's
    weight gradient x1.01 fails likewise, 1.0e-2, docs/journal/precision.md)."""
    import mutants as M

    from thomas_tune.export_check import check_export
    out = _alexnet_export(tmp_path / "mutant", "mixed16", M.DATA_MUTANTS["max pool"](1.01))
    check = check_export(out, seed=0)
    print(check.line())
    assert not check.ok and check.failing, check.line()


def test_small_mobilenets_at_mixed16_are_not_checkable_without_the_builds_roundings():
    """MobileNetV2 0.35@32 at batch 8: PyTorch's own half-storage float32 step, rounding on its
    own, is already further from the rounding float64 step than the cap allows on some
    parameters (float16's rounding amplified by BatchNorms over 8 to 32 values), so a check
    that does not follow the build's roundings (a build run on a device server) would say
    nothing: check_export refuses it there as not checkable (StepCheck.unverifiable)."""
    from thomas_tune.models import build, init_params
    from thomas_tune.step_check import CAP, FACTOR, reference_steps
    from thomas_tune.trainable import select_trainable
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    ref = reference_steps(model, init_params(model, seed=3), select_trainable(model, "all"),
                          8, 0, precision="mixed16")
    over = [n for n, e in ref["yardstick"].errors.items() if FACTOR * e > CAP]
    assert over, ref["yardstick"].line()


def test_round_like_takes_the_other_neighbour_only():
    """The build's float16 value is taken where it is the neighbour of the reference's
    unrounded value that the reference's own rounding is not; a value two steps away, or not
    finite, is not taken (counted beyond); the gradient passes unchanged."""
    import numpy as np

    from thomas_tune.half_reference import Aligned, round_like
    one = np.float16(1.0)
    up = np.nextafter(one, np.float16(2))  # 1 + 2^-10
    up2 = np.nextafter(up, np.float16(2))
    x = torch.tensor([1.0 + 2.0 ** -11 * 0.999, 1.0 + 2.0 ** -11 * 0.999, 1.0 + 2 ** -12,
                      1.0 + 2 ** -12, 1.0, 1.0], dtype=torch.float64, requires_grad=True)
    build = np.array([up, one, up2, np.inf, up, one], "float16")  # own rounding: 1 each
    count = Aligned()
    r = round_like(x, build, count)
    want = [float(up), 1.0, 1.0, 1.0, 1.0, 1.0]  # an exact float16 value has one neighbour
    assert r.detach().tolist() == want
    assert (count.places, count.elements, count.taken, count.beyond) == (1, 6, 1, 3)
    r.sum().backward()
    assert x.grad.tolist() == [1.0] * 6
    with pytest.raises(ValueError, match="paired by order"):
        round_like(x, build[:5])


MOBILENET = dict(num_classes=5, resolution=32, width=0.35)


def _mobilenet_export(path, precision, mutant=None):
    """An llvm export of MobileNetV2 0.35@32 (every layer, batch 8) at ``precision``, built
    under ``mutant`` when given; LLVM's optimisation off, as :func:`_alexnet_export` (the
    check-only form of its step is compiled for the same target)."""
    import contextlib

    from thomas_tune.compiler.compile import reference_target
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    model = build("mobilenet_v2", **MOBILENET)
    with mutant if mutant is not None else contextlib.nullcontext():
        export(str(path), model, init_params(model, seed=11), reference_target(
            parse_target("llvm")), batch=8, trainable="all", precision=precision,
            progress=lambda *_: None)
    return str(path)


def test_a_right_mixed16_mobilenet_passes_following_the_builds_roundings(tmp_path, rng):
    """MobileNetV2 0.35@32, batch 8, every layer, mixed16 on llvm: with the build's float16
    roundings followed the check judges it (nothing unverifiable: PyTorch's own step,
    following them too, is within the cap's share) and passes on a fresh seed, taking the
    build's value at a few elements per ten thousand. (Following fails a gradient 1% off:
    AlexNet's max-pool mutant above; MobileNetV2's conv weight gradient x1.01 fails too,
    1.0e-2 against 2.0e-3, docs/journal/precision.md.)"""
    from thomas_tune.export_check import check_export
    from thomas_tune.step_check import CAP, FACTOR
    out = _mobilenet_export(tmp_path / "right", "mixed16")
    seed = int(rng.integers(0, 10_000))
    check = check_export(out, seed=seed)
    print(seed, check.line())
    assert check.ok and not check.unverifiable, check.line()
    assert max(check.yardstick.values()) * FACTOR < CAP
    a = check.aligned
    assert a["places"] > 0 and 0 < a["taken"] < 1e-3 * a["elements"], a


def test_a_mixed16_build_with_a_wrong_forward_convolution_fails(tmp_path):
    """The first convolution computing the first image 1% too large (the gradients those of
    that wrong forward; AlexNet: the check-only form is the same code for every network): its
    loss is not the stated step's bit for bit (the stored tensors read back, from that step
    compiled again, are the right forward's), and its gradients are far over their bounds
    (seed 0: 15 of 16, the worst 47x; its loss 1.2x, one image of eight moved)."""
    import mutants as M

    from thomas_tune.export_check import check_export
    out = _alexnet_export(tmp_path / "fwd", "mixed16", M.FORWARD_MUTANTS[
        "first conv forward, image 0 x1.01"]("features.0"))
    check = check_export(out, seed=0)
    print(check.line())
    assert not check.ok and len(check.failing) > len(check.errors) // 2, check.line()
    assert max(check.errors[n] / check.bounds[n] for n in check.failing) > 10, check.line()
    assert not check.aligned["same_forward"], check.aligned


def test_a_float32_build_presented_as_mixed16_fails(tmp_path):
    """A float32 AlexNet export whose manifest says mixed16: its loss is not, bit for bit,
    that of the mixed16 step the manifest states (compiled again to read the float16 tensors
    it stores), so the check fails it, saying why (its gradients alone are within the
    bounds: float16 storage moves AlexNet's by less, docs/journal/precision.md)."""
    import shutil

    from thomas_tune.export_check import check_export
    plain = _alexnet_export(tmp_path / "float32", "float32")
    claimed = str(tmp_path / "as_mixed16")
    shutil.copytree(plain, claimed)
    _claim(claimed, "mixed16")
    check = check_export(claimed, seed=0)
    print(check.line())
    assert not check.ok and not check.aligned["same_forward"], check.line()
    assert "its forward is not that step's" in check.line()
