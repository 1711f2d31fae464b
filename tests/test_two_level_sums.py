"""Long sums of GPU kernels in two levels (``schedules/accumulate.py``): the lowered kernel's
accumulators take their terms through partial sums, the numbers are the float64 ones to float32
rounding and nearer to them than one chain per output, on PoCL; kernels the rewrite does not
fit are left as they are; tuning candidates and step builds are lowered the same way."""

import numpy as np
import tvm
from tvm import te

from thomas_tune.schedules import accumulate, tir_pipeline
from thomas_tune.target import codegen_target, parse_target

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard


def _conv(n, ci, h, co, k):
    """A workload of AlexNet's second convolution's shape family: stride 1, padding k // 2,
    bias and ReLU after the sum (ci * k * k terms per output)."""
    from thomas_tune.kernel_check import default_kernel
    x = te.placeholder((n, ci, h, h), name="x")
    w = te.placeholder((co, ci, k, k), name="w")
    b = te.placeholder((co,), name="b")
    p = k // 2
    pad = te.compute((n, ci, h + 2 * p, h + 2 * p), lambda i, c, y, z: tvm.tirx.if_then_else(
        tvm.tirx.all(y >= p, y < h + p, z >= p, z < h + p), x[i, c, y - p, z - p], 0.0),
        name="pad")
    rc, ry, rx = te.reduce_axis((0, ci)), te.reduce_axis((0, k)), te.reduce_axis((0, k))
    conv = te.compute((n, co, h, h), lambda i, f, y, z: te.sum(
        pad[i, rc, y + ry, z + rx] * w[f, rc, ry, rx], axis=[rc, ry, rx]), name="conv")
    out = te.compute((n, co, h, h), lambda i, f, y, z: te.max(conv[i, f, y, z] + b[f], 0.0),
                     name="out")
    return default_kernel(tvm.IRModule({"main": te.create_prim_func([x, w, b, out])}),
                          parse_target("opencl"))


def test_a_long_sum_is_taken_in_partial_sums_in_the_opencl_source():
    """1,600 terms per output (64 channels x 5 x 5): the OpenCL source of the default
    schedule, built as a step builds it, has the partial sums; TVM's own pipeline has not."""
    target = parse_target("opencl")
    mod = _conv(1, 64, 13, 16, 5)
    split = tvm.compile(mod, codegen_target(target), tir_pipeline=tir_pipeline(target))
    plain = tvm.compile(mod, codegen_target(target), tir_pipeline="default")
    assert "_partial" in split.mod.imports[0].inspect_source()
    assert "_partial" not in plain.mod.imports[0].inspect_source()
    assert tir_pipeline(parse_target("llvm")) == "default"


def test_short_sums_and_many_accumulators_are_left_alone():
    """Fewer terms than :data:`CHAIN` (16 channels x 3 x 3 = 144), or more accumulators per
    thread than the limit allows: the lowered kernel is TVM's, unchanged."""
    target = parse_target("opencl")
    for mod, limit in ((_conv(1, 16, 13, 16, 3), None), (_conv(1, 64, 13, 16, 5), 1)):
        lowered = _to_loops(mod, target)
        assert accumulate.two_level_sums(lowered, max_accumulators=limit).same_as(lowered)
    lowered = _to_loops(_conv(1, 64, 13, 16, 5), target)
    assert not accumulate.two_level_sums(lowered).same_as(lowered)


def _to_loops(mod, target):
    """The kernel of ``mod`` lowered to loops and flat buffers, as the rewrite sees it."""
    with target:
        return accumulate.to_loops()(tvm.tirx.transform.BindTarget(target)(mod))["main"]


@needs_opencl
def test_two_level_sums_compute_the_float64_convolution_nearer_than_one_chain(rng):
    """On PoCL, a convolution of 1,600 terms per output with bias and ReLU: the two-level
    build is within 2e-6 of numpy's float64 result (relative to its largest value), and its
    mean error is at most 0.7 of the one-chain build's, on fresh inputs (about 0.4 of it
    measured: 4.7e-6 against 1.2e-5 on AlexNet's layer at batch 32, docs/journal/precision.md)."""
    import torch

    target = parse_target("opencl")
    n, ci, h, co, k = 2, 64, 27, 32, 5
    mod = _conv(n, ci, h, co, k)
    split = tvm.compile(mod, codegen_target(target), tir_pipeline=tir_pipeline(target))
    plain = tvm.compile(mod, codegen_target(target), tir_pipeline="default")
    dev = tvm.opencl(0)
    xs = np.maximum(rng.standard_normal((n, ci, h, h)), 0).astype("float32")
    ws = (rng.standard_normal((co, ci, k, k)) / 40).astype("float32")
    bs = (rng.standard_normal(co) / 10).astype("float32")
    t = [torch.tensor(v, dtype=torch.float64) for v in (xs, ws, bs)]
    want = torch.relu(torch.nn.functional.conv2d(t[0], t[1], padding=k // 2)
                      + t[2][None, :, None, None]).numpy()
    errors = []
    for lib in (split, plain):
        out = tvm.runtime.tensor(np.full(want.shape, np.nan, "float32"), dev)
        lib["main"](*(tvm.runtime.tensor(v, dev) for v in (xs, ws, bs)), out)
        got = out.numpy().astype("float64")
        errors.append((np.abs(got - want).max() / np.abs(want).max(), np.abs(got - want).mean()))
    (split_max, split_mean), (_, plain_mean) = errors
    assert split_max <= 2e-6, errors
    assert split_mean <= 0.7 * plain_mean, errors


@needs_opencl
def test_tuning_candidates_are_lowered_with_two_level_sums():
    """A candidate built by the tuner's builder is lowered as the step's build lowers it."""
    from thomas_tune.measure.builder import build_candidate
    target = parse_target("opencl")
    lib = build_candidate(_conv(1, 64, 13, 16, 5), target)
    assert "_partial" in lib.imports[0].inspect_source()



def test_runs_count_the_terms_inside_the_accumulators_allocation(rng):
    """A loop around the accumulators' allocation starts their sums again: it is not one of
    the summed loops. 1,024 terms per output give runs of 32 iterations (sqrt), not the 64 of
    8 x 1,024 terms; the rewritten kernel computes numpy's sums (llvm)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def main(a: T.Buffer((8, 1024), "float32"), out: T.Buffer((8, 4), "float32")):
        for t in range(8):
            acc = T.alloc_local((4,))
            for i in range(4):
                acc[i] = T.float32(0)
            for k in range(1024):
                for i in range(4):
                    acc[i] = acc[i] + a[t, k] * T.Cast("float32", i + 1)
            for i in range(4):
                out[t, i] = acc[i]

    rewritten = accumulate.two_level_sums(main)
    text = rewritten.script()
    assert "k % 32 == 0" in text and "k % 32 == 31" in text, text
    lib = tvm.compile(tvm.IRModule({"main": rewritten}), "llvm")
    x = rng.standard_normal((8, 1024)).astype("float32")
    out = tvm.runtime.tensor(np.full((8, 4), np.nan, "float32"))
    lib["main"](tvm.runtime.tensor(x), out)
    want = x.astype("float64").sum(axis=1)[:, None] * np.arange(1, 5)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)
