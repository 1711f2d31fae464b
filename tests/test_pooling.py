"""Max pooling as one injective kernel (``thomas_tune.training_graph.pooling``): exact, and fused as
designed."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from thomas_tune.training_graph import pooling
from thomas_tune.target import parse_target

# the whole file runs in seconds: all of it in the subset for edits (pytest -m quick)
pytestmark = pytest.mark.quick


def _pool_module(shape, kernel, stride, padding, ceil_mode, dtype="float64"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.max_pool2d(x, kernel, stride, padding,
                                                 ceil_mode=ceil_mode))
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, kernel, stride, padding, out_hw):
    """max over each window, positions outside the input skipped (numpy, float64)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, stride, padding
    n, c, h, w = x.shape
    xp = np.full((n, c, h + pt + pb + kh, w + pl + pr + kw), -np.inf)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    out = np.empty((n, c, *out_hw))
    for i, j in np.ndindex(*out_hw):
        out[:, :, i, j] = xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw].max(axis=(2, 3))
    return out


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,hw", [
    ((3, 3), (2, 2), (0, 0, 0, 0), False, (13, 13)),  # AlexNet's pools
    ((3, 3), (2, 2), (1, 1, 1, 1), False, (8, 7)),    # ResNet's stem pool
    ((2, 2), (2, 2), (0, 0, 0, 0), False, (6, 8)),    # windows that do not overlap
    ((3, 3), (1, 1), (1, 1, 1, 1), False, (5, 6)),    # stride 1
    ((3, 2), (2, 1), (1, 0, 0, 1), True, (7, 6)),     # uneven, ceil mode
])
def test_small_window_is_one_injective_kernel_and_exact(rng, kernel, stride, padding,
                                                        ceil_mode, hw):
    """A window of at most MAX_WINDOW elements becomes one kernel with no reduction, marked
    to fuse like a convolution; its output equals the window maxima exactly (float64, fresh
    random values and values with ties), windows running past the edges included."""
    shape = (2, 3, *hw)
    mod = _pool_module(shape, kernel, stride, padding, ceil_mode)
    legal = relax.transform.LegalizeOps(customize_legalize_map=pooling.LEGALIZE)(mod)
    funcs = [f for f in legal.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1
    assert int(funcs[0].attrs["op_pattern"]) == pooling.OUT_EWISE_FUSABLE
    assert "T.init()" not in funcs[0].script()  # no reduction block
    vm = relax.VirtualMachine(tvm.compile(legal, parse_target("llvm")), tvm.cpu())
    out_hw = [int(v) for v in mod["main"].ret_ty.shape.values][2:]
    for x in (rng.standard_normal(shape), rng.integers(0, 3, shape).astype("float64")):
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(got, _reference(x, kernel, stride, padding, out_hw))


def test_large_window_keeps_the_reduction_form(rng):
    """A window of more than MAX_WINDOW elements (5x5) keeps TVM's legalization, a reduction
    over the window, with the same values."""
    mod = _pool_module((1, 2, 9, 9), (5, 5), (2, 2), (0, 0, 0, 0), False)
    legal = relax.transform.LegalizeOps(customize_legalize_map=pooling.LEGALIZE)(mod)
    (func,) = [f for f in legal.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert "T.init()" in func.script()  # a reduction block
    vm = relax.VirtualMachine(tvm.compile(legal, parse_target("llvm")), tvm.cpu())
    x = rng.standard_normal((1, 2, 9, 9))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(),
                                  _reference(x, (5, 5), (2, 2), (0, 0, 0, 0), (3, 3)))


def test_fuses_with_what_follows_not_with_what_makes_its_input():
    """In a fused graph the pool joins the element-wise kernel after it, never the
    element-wise kernel before it (whose values it would compute once per window)."""
    from thomas_tune.tasks import callees, fuse
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 9, 9), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.nn.relu(R.add(x, relax.const(1.0, "float32"))))
            p = bb.emit(R.nn.max_pool2d(y, (3, 3), (2, 2)))
            out = bb.emit_output(R.multiply(p, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    calls = callees(fuse(bb.get())["main"])
    assert sorted(calls) == ["fused_add_relu", "fused_max_pool2d_multiply"], calls
