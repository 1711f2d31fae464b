"""Vector casts of comparisons in OpenCL kernels (``schedules/bool_casts.py``): a ReLU's
backward mask (``where(0 < x, dy, 0)``, as Relax lowers it) with its loop vectorized computes
numpy's values on PoCL when built as a step or a tuning candidate is built; TVM's own pipeline
selects the wrong side, and kernels without such casts are left as they are."""

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune.schedules import bool_casts, tir_pipeline
from thomas_tune.target import codegen_target, parse_target

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard

N = 4096


def _relu_mask(lanes: int) -> tvm.IRModule:
    """``where(0 < x, dy, 0)`` over N floats in the form Relax's ``where`` lowers to
    (``Select(0 < Cast(int64, 0 < x), dy, 0)``), one work-item per ``lanes`` of them, its inner
    loop vectorized when ``lanes`` > 1."""
    x = te.placeholder((N,), name="x")
    dy = te.placeholder((N,), name="dy")
    zero = tvm.tirx.const(0, "int64")
    out = te.compute((N,), lambda i: tvm.tirx.Select(
        zero < tvm.tirx.Cast("int64", x[i] > 0.0), dy[i], tvm.tirx.const(0.0, "float32")),
        name="mask")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, dy, out]))
    loop, = sch.get_loops(sch.get_sblock("mask"))
    b, t, v = sch.split(loop, [None, 64, lanes])
    sch.bind(b, "blockIdx.x")
    sch.bind(t, "threadIdx.x")
    if lanes > 1:
        sch.vectorize(v)
    return sch.mod


@pytest.mark.quick
@needs_opencl
def test_a_vectorized_relu_mask_selects_as_numpy_on_the_device(rng):
    """Fresh inputs of both signs: the product's pipeline gives numpy's values for 1 and 4
    lanes; with TVM's pipeline the 4-lane mask is false everywhere (its OpenCL writes ``0 <
    convert_int4(0 < x)``: -1 where x > 0, 0 elsewhere, neither above 0), which is what the
    rewrite is for."""
    from thomas_tune.measure.builder import build_candidate
    target = parse_target("opencl")
    dev = tvm.opencl(0)
    x = rng.standard_normal(N).astype("float32")
    dy = rng.standard_normal(N).astype("float32")
    want = np.where(x > 0, dy, 0.0)

    def run(lib):
        out = tvm.runtime.tensor(np.full(N, np.nan, "float32"), dev)
        lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(dy, dev), out)
        return out.numpy()

    for lanes in (1, 4):
        mod = _relu_mask(lanes)
        ours = tvm.compile(mod, codegen_target(target), tir_pipeline=tir_pipeline(target))
        np.testing.assert_array_equal(run(ours), want)
        np.testing.assert_array_equal(run(build_candidate(mod, target)), want)
    tvms = tvm.compile(_relu_mask(4), codegen_target(target), tir_pipeline="default")
    assert "convert_int4" in tvms.mod.imports[0].inspect_source()
    np.testing.assert_array_equal(run(tvms), np.zeros(N, "float32"))


@pytest.mark.quick
def test_kernels_without_vector_casts_of_comparisons_are_left_alone():
    """Lowered and vectorized: the 1-lane mask (a scalar cast only) comes back as the same
    object; the 4-lane one is rewritten to a ``Select``."""
    from thomas_tune.schedules.accumulate import to_loops
    target = parse_target("opencl")
    with target:
        scalar = tvm.tirx.transform.VectorizeLoop()(
            to_loops()(tvm.tirx.transform.BindTarget(target)(_relu_mask(1))))["main"]
        vector = tvm.tirx.transform.VectorizeLoop()(
            to_loops()(tvm.tirx.transform.BindTarget(target)(_relu_mask(4))))["main"]
    assert bool_casts.vector_bool_casts(scalar).same_as(scalar)
    rewritten = bool_casts.vector_bool_casts(vector)
    assert not rewritten.same_as(vector) and "Select" in rewritten.script()
