"""Default GPU schedules (the kernels of an untuned build) on PoCL: which rule schedules a
kernel, and that its numbers match numpy in float64."""

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune.schedules import default_gpu_schedules

from opencl_kernels import (NEEDS_OPENCL, run_kernel)

# the whole file runs in seconds: all of it in the subset for edits (pytest -m quick)
pytestmark = [NEEDS_OPENCL, pytest.mark.quick]


def test_long_reduction_schedule(target, rng):
    """Weight-gradient kernels (few outputs, long sums) get LongReduction's default schedule
    (threads split each sum) and match numpy in float64: a depthwise layer's weight gradient
    (stride 2, padding 1) and a 1x1 convolution's with an injective epilogue."""
    from thomas_tune.training_graph.gradients import depthwise_weight_grad_te
    from thomas_tune.schedules import LongReduction

    n, c, h = 8, 8, 46
    x = te.placeholder((n, c, h, h), name="x")
    dy = te.placeholder((n, c, 23, 23), name="dy")
    dw = depthwise_weight_grad_te(x, dy, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1))
    f = te.create_prim_func([x, dy, dw])
    assert LongReduction().apply(f, target, False) is not None
    xn, dyn = rng.standard_normal((n, c, h, h)), rng.standard_normal((n, c, 23, 23))
    got = run_kernel(default_gpu_schedules(tvm.IRModule({"main": f}), target), target, [xn, dyn],
                     (c, 1, 3, 3))
    xp = np.pad(xn.astype("float32").astype("float64"), ((0, 0), (0, 0), (1, 1), (1, 1)))
    dy64 = dyn.astype("float32").astype("float64")
    ref = np.zeros((c, 1, 3, 3))
    for kh in range(3):
        for kw in range(3):
            ref[:, 0, kh, kw] = (dy64 * xp[:, :, kh:kh + 45:2, kw:kw + 45:2]).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    a = te.placeholder((n, 16, 20, 20), name="a")
    b = te.placeholder((n, 8, 20, 20), name="b")
    rn, rh, rw = te.reduce_axis((0, n)), te.reduce_axis((0, 20)), te.reduce_axis((0, 20))
    s = te.compute((16, 8), lambda i, j: te.sum(a[rn, i, rh, rw] * b[rn, j, rh, rw],
                                                 axis=[rn, rh, rw]), name="s")
    out = te.compute((16, 8, 1, 1), lambda i, j, p, q: s[i, j] * 0.5, name="out")
    f2 = te.create_prim_func([a, b, out])
    assert LongReduction().apply(f2, target, False) is not None
    an, bn = rng.standard_normal((n, 16, 20, 20)), rng.standard_normal((n, 8, 20, 20))
    got2 = run_kernel(default_gpu_schedules(tvm.IRModule({"main": f2}), target), target, [an, bn],
                      (16, 8, 1, 1))
    ref2 = 0.5 * np.einsum("nihw,njhw->ij", an.astype("float32").astype("float64"),
                           bn.astype("float32").astype("float64"))[:, :, None, None]
    np.testing.assert_allclose(got2, ref2, rtol=1e-4, atol=1e-4 * np.abs(ref2).max())


def test_a_depthwise_convolution_and_its_batchnorm_are_one_kernel(target, rng):
    """A depthwise convolution (padding 1) followed by an inference-form BatchNorm and ReLU6,
    as a frozen layer's kernel: ReductionEpilogue's default schedule (dlight's Fallback gave two
    kernels, the convolution's output written and read back), one kernel in the built module,
    and the numbers of numpy in float64."""
    from thomas_tune.schedules import ReductionEpilogue

    n, c, h = 4, 8, 10
    x = te.placeholder((n, c, h, h), name="x")
    w = te.placeholder((c, 1, 3, 3), name="w")
    g, b, mean, var = (te.placeholder((c,), name=k) for k in ("g", "b", "mean", "var"))
    pad = te.compute((n, c, h + 2, h + 2), lambda i, j, p, q: te.if_then_else(
        te.all(p >= 1, p <= h, q >= 1, q <= h), x[i, j, p - 1, q - 1], 0.0), name="pad")
    rh, rw = te.reduce_axis((0, 3)), te.reduce_axis((0, 3))
    conv = te.compute((n, c, h, h), lambda i, j, p, q: te.sum(
        pad[i, j, p + rh, q + rw] * w[j, 0, rh, rw], axis=[rh, rw]), name="conv")
    scale = te.compute((c,), lambda j: g[j] / te.sqrt(var[j] + 1e-5), name="scale")
    out = te.compute((n, c, h, h), lambda i, j, p, q: te.min(te.max(
        (conv[i, j, p, q] - mean[j]) * scale[j] + b[j], 0.0), 6.0), name="out")
    f = te.create_prim_func([x, w, g, b, mean, var, out])
    sch = ReductionEpilogue().apply(f, target, False)
    assert sch is not None
    scheduled = default_gpu_schedules(tvm.IRModule({"main": f}), target)
    assert scheduled["main"].script().count('thread="blockIdx.x"') == 1
    xn, wn = rng.standard_normal((n, c, h, h)), rng.standard_normal((c, 1, 3, 3))
    gn, bn, mn = rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(c)
    vn = rng.uniform(0.5, 1.5, c)
    got = run_kernel(scheduled, target, [xn, wn, gn, bn, mn, vn], (n, c, h, h))
    f64 = [a.astype("float32").astype("float64") for a in (xn, wn, gn, bn, mn, vn)]
    xp = np.pad(f64[0], ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = sum(xp[:, :, i:i + h, j:j + h] * f64[1][None, :, 0, i, j, None, None]
              for i in range(3) for j in range(3))
    ref = (ref - f64[4][:, None, None]) * (f64[2] / np.sqrt(f64[5] + 1e-5))[:, None, None]
    ref = np.clip(ref + f64[3][:, None, None], 0.0, 6.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_stock_default_rules_schedule_otherwise_and_compute_the_same(target, rng):
    """``bench --stock-defaults``' variant: the same weight-gradient kernel with TVM's own
    default GPU rules (``STOCK_RULES``) gets another schedule than with thomas_tune's (no
    ``LongReduction``), and both match numpy in float64."""
    import tvm_ffi

    from thomas_tune.schedules import STOCK_RULES

    n = 8
    a = te.placeholder((n, 16, 20, 20), name="a")
    b = te.placeholder((n, 8, 20, 20), name="b")
    rn, rh, rw = te.reduce_axis((0, n)), te.reduce_axis((0, 20)), te.reduce_axis((0, 20))
    s = te.compute((16, 8), lambda i, j: te.sum(a[rn, i, rh, rw] * b[rn, j, rh, rw],
                                                 axis=[rn, rh, rw]), name="s")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, s])})
    ours = default_gpu_schedules(mod, target)
    stock = default_gpu_schedules(mod, target, STOCK_RULES)
    assert not tvm_ffi.structural_equal(ours["main"], stock["main"])
    an, bn = rng.standard_normal((n, 16, 20, 20)), rng.standard_normal((n, 8, 20, 20))
    ref = np.einsum("nihw,njhw->ij", an.astype("float32").astype("float64"),
                    bn.astype("float32").astype("float64"))
    for scheduled in (ours, stock):
        got = run_kernel(scheduled, target, [an, bn], (16, 8))
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_wide_matmul_gets_a_tiled_default_schedule(target, rng):
    """A fully connected layer (many outputs, long sums) gets dlight's tiled matmul by
    default: its shared-memory tiles are counted after buffer compaction (their declared
    shape is the whole weight matrix, over the target's limit), and it matches numpy in
    float64. Narrow matmuls stay with LongReduction; short sums get no cross-thread rule."""
    from thomas_tune.schedules import (LongGeneralReduction, LongReduction, WideMatmul,
                                       shared_bytes)

    n, k, m = 64, 2304, 1024
    x = te.placeholder((n, k), name="x")
    w = te.placeholder((k, m), name="w")
    bias = te.placeholder((m,), name="bias")
    rk = te.reduce_axis((0, k))
    mm = te.compute((n, m), lambda i, j: te.sum(x[i, rk] * w[rk, j], axis=rk), name="mm")
    y = te.compute((n, m), lambda i, j: mm[i, j] + bias[j], name="y")
    f = te.create_prim_func([x, w, bias, y])
    sch = WideMatmul().apply(f, target, False)
    assert sch is not None
    limit = int(target.attrs["max_shared_memory_per_block"])
    assert 0 < shared_bytes(sch.mod["main"], target) <= limit
    scheduled = default_gpu_schedules(tvm.IRModule({"main": f}), target)
    assert "shared" in scheduled.script()
    xn, wn, bn = (rng.standard_normal(s) for s in ((n, k), (k, m), (m,)))
    got = run_kernel(scheduled, target, [xn, wn, bn], (n, m))
    f64 = [a.astype("float32").astype("float64") for a in (xn, wn, bn)]
    ref = f64[0] @ f64[1] + f64[2]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    # a weight gradient's shape (few outputs, a long sum): LongReduction's, not the tiles
    a = te.placeholder((4096, 16), name="a")
    b = te.placeholder((4096, 8), name="b")
    rn = te.reduce_axis((0, 4096))
    g = te.compute((16, 8), lambda i, j: te.sum(a[rn, i] * b[rn, j], axis=rn), name="g")
    fg = te.create_prim_func([a, b, g])
    assert WideMatmul().apply(fg, target, False) is None
    assert LongReduction().apply(fg, target, False) is not None
    # a 3x3x3 convolution's 27-term sums: no work-group per output
    img = te.placeholder((1, 3, 34, 34), name="img")
    wt = te.placeholder((8, 3, 3, 3), name="wt")
    rc, rh, rw = te.reduce_axis((0, 3)), te.reduce_axis((0, 3)), te.reduce_axis((0, 3))
    conv = te.compute((1, 8, 32, 32), lambda b_, o, i, j: te.sum(
        img[b_, rc, i + rh, j + rw] * wt[o, rc, rh, rw], axis=[rc, rh, rw]), name="conv")
    assert LongGeneralReduction().apply(te.create_prim_func([img, wt, conv]), target,
                                        False) is None


def test_default_schedules_are_kept_on_disk_per_kernel(tmp_path, monkeypatch, target, rng):
    """A kernel's default schedule is kept on disk: asked again with this process's copies
    cleared (as in another process), it is read back, not made again, the same schedule, and
    its kernel matches numpy in float64; a damaged file is made again and rewritten."""
    import pytest
    import tvm_ffi

    from thomas_tune import kept_ir
    from thomas_tune.schedules import defaults
    monkeypatch.setenv("THOMAS_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(kept_ir, "_KEPT", {})
    a = te.placeholder((48, 40), name="a")
    b = te.placeholder((40, 24), name="b")
    k = te.reduce_axis((0, 40), name="k")
    c = te.compute((48, 24), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, c])})
    first = default_gpu_schedules(mod, target)
    files = list((tmp_path / "default_schedules").rglob("*.json"))
    assert len(files) == 1
    made = defaults._schedule_one
    monkeypatch.setattr(kept_ir, "_KEPT", {})
    monkeypatch.setattr(defaults, "_schedule_one", lambda *_: pytest.fail("scheduled again"))
    second = default_gpu_schedules(mod, target)
    assert tvm_ffi.structural_equal(first["main"], second["main"])
    x, y = rng.standard_normal((48, 40)), rng.standard_normal((40, 24))
    got = run_kernel(second, target, [x, y], (48, 24))
    ref = x.astype("float32").astype("float64") @ y.astype("float32").astype("float64")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    files[0].write_text("{damaged")
    monkeypatch.setattr(kept_ir, "_KEPT", {})
    monkeypatch.setattr(defaults, "_schedule_one", made)
    third = default_gpu_schedules(mod, target)
    assert tvm_ffi.structural_equal(first["main"], third["main"])
    assert tvm_ffi.structural_equal(tvm.ir.load_json(files[0].read_text()), first["main"])
