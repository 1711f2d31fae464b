"""The whole-step check fails a build with one deliberately broken backward kernel (real llvm
exports of a small MobileNetV2 against PyTorch in float64). A right build of the same kind
passes it in tests/test_kernel_check.py (on PoCL) and tests/test_bench.py (llvm)."""

import contextlib
import itertools

import pytest

from thomas_tune import gradients

torch = pytest.importorskip("torch")


@contextlib.contextmanager
def broken_bn_backward(factor: float):
    """BatchNorm's backward (with its ReLU6, :func:`thomas_tune.gradients._bn_act_grad`) with
    the input gradient of its first use in a backward pass (the network's last trainable
    BatchNorm) multiplied by ``factor``: -1 is a wrong sign, 1.01 a gradient 1% too large.
    Every other BatchNorm keeps the right gradient; the right one is registered again on
    exit."""
    import tvm
    from tvm import relax
    from tvm.relax import op as R
    from thomas_tune.models import batchnorm as B
    name = "tvm.relax.te_grad._register." + B.GRADIENT
    calls = itertools.count()

    def grad(orig_var, call, output_grad, ctx):
        parts = gradients._bn_act_grad(orig_var, call, output_grad, ctx)
        if next(calls):
            return parts
        fields = [ctx.emit(relax.TupleGetItem(parts, i)) for i in range(5)]
        fields[0] = ctx.emit(R.multiply(fields[0], relax.const(factor, "float32")))
        return ctx.emit(relax.Tuple(fields))

    tvm.register_global_func(name, grad, override=True)
    try:
        yield
    finally:
        tvm.register_global_func(name, gradients._bn_act_grad, override=True)


@pytest.fixture(scope="module")
def reference():
    """The model, its parameters and PyTorch's steps on the check batches."""
    from thomas_tune import graph as G
    from thomas_tune.models import build, init_params
    from thomas_tune.step_check import reference_steps
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tensors = init_params(model, seed=11)
    names = G.select_trainable(model, TRAINABLE)
    frozen_bn = G.frozen_batchnorms(model, names, G.parse_trainable(TRAINABLE)[1])
    return model, tensors, reference_steps(model, tensors, names, 8, seed=5, frozen_bn=frozen_bn)


TRAINABLE = "last:4"


def _export(tmp_path, model, tensors, name):
    from thomas_tune.export import export
    from thomas_tune.target import parse_target
    out = str(tmp_path / name)
    export(out, model, tensors, parse_target("llvm"), batch=8, trainable=TRAINABLE,
           progress=lambda *_: None)
    return out


@pytest.mark.parametrize("factor", [-1.0, 1.01], ids=["wrong-sign", "1.01x"])
def test_step_check_fails_one_backward_with_a_wrong_sign_or_one_percent_off(
        tmp_path, reference, factor):
    from thomas_tune.step_check import check_export
    model, tensors, ref = reference
    with broken_bn_backward(factor):
        out = _export(tmp_path, model, tensors, "build")
    check = check_export(out, reference=ref)
    print(check.line())
    assert not check.ok and check.failing, check.line()
    assert abs(check.loss_err) <= check.loss_bound  # the forward pass is untouched
    assert max(check.errors[n] for n in check.failing) > 5e-3, check.line()
