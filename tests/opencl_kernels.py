"""Helpers of the OpenCL tests (PoCL in tests and CI): the mark that skips them where no
OpenCL device is visible (and fails instead when ``THOMAS_TUNE_REQUIRE_OPENCL`` is set, as in CI),
and small kernels run against numpy."""

import os

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune import opencl

if os.environ.get("THOMAS_TUNE_REQUIRE_OPENCL") and not opencl.available():
    opencl.load()  # raises with what is missing: CI must not skip these tests
    raise RuntimeError("THOMAS_TUNE_REQUIRE_OPENCL is set but no OpenCL device is visible")
NEEDS_OPENCL = pytest.mark.skipif(not opencl.available(),
                                  reason="no OpenCL device (install pocl-opencl-icd)")


def run_kernel(mod, target, arrays, out_shape):
    """Run ``mod`` (an IRModule, compiled here for ``target``, or a built module) on OpenCL
    device 0: ``main(*arrays, out)`` with the arrays rounded to float32 and a float32 output of
    ``out_shape``; returns the output in float64."""
    lib = tvm.compile(mod, target) if isinstance(mod, tvm.IRModule) else mod
    dev = tvm.opencl(0)
    args = [tvm.runtime.tensor(a.astype("float32"), dev) for a in arrays]
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"), dev)
    lib["main"](*args, out)
    return out.numpy().astype("float64")


def prim_module(*tensors):
    """An IRModule whose ``main`` is the TensorIR function of ``tensors`` (te placeholders and
    computes, in argument order)."""
    return tvm.IRModule({"main": te.create_prim_func(list(tensors))})


def dense_layer(m, n, k, epilogue):
    """A dense layer's forward pass at batch ``m``: ``NT_matmul = x @ w.T`` (x: m x k, w:
    n x k), then ``epilogue(NT_matmul[i, j], bias[j])``; returns the module and x, w, bias."""
    x = te.placeholder((m, k), name="x")
    w = te.placeholder((n, k), name="w")
    bias = te.placeholder((n,), name="bias")
    rk = te.reduce_axis((0, k), name="k")
    mm = te.compute((m, n), lambda i, j: te.sum(x[i, rk] * w[j, rk], axis=rk), name="NT_matmul")
    out = te.compute((m, n), lambda i, j: epilogue(mm[i, j], bias[j]), name="out")
    return prim_module(x, w, bias, out), x, w, bias


def conv3x3_same(x, w):
    """numpy's float64 reference of a stride-1 3x3 convolution padded by 1 (NCHW, OIHW) of the
    float32-rounded inputs."""
    x64, w64 = (a.astype("float32").astype("float64") for a in (x, w))
    h = x.shape[2]
    xp = np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)))
    return sum(np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + h], w64[:, :, i, j])
               for i in range(3) for j in range(3))


def padding_in_fill(sch) -> bool:
    """Whether the padding of ``sch``'s convolution is done in the copy that stages the padded
    input in shared memory (``pad_temp_shared``), with no padding block of its own."""
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    return "pad_temp_shared" in names and "pad_temp" not in names


class HalfEpilogueConv:
    """The half-storage step's convolution: a float16 input (4 x 16 x 16 x 16), float32
    weights (64 x 16 x 3 x 3) and bias, float32 sums, bias and ReLU, a float16 output; fresh
    inputs of ``rng`` and their float64 reference."""

    def __init__(self, rng):
        from tvm import topi
        n, self.ci, co, h = 4, 16, 64, 16
        x16 = te.placeholder((n, self.ci, h, h), "float16", name="x")
        w = te.placeholder((co, self.ci, 3, 3), name="w")
        b = te.placeholder((co,), name="b")
        xf = te.compute(x16.shape, lambda *i: x16(*i).astype("float32"), name="xcast")
        s = topi.nn.conv2d_nchw(xf, w, 1, 1, 1, out_dtype="float32")
        r = te.compute(s.shape, lambda a, c, i, j: te.max(s[a, c, i, j] + b[c], 0.0),
                       name="relu")
        self.mod = prim_module(x16, w, b, te.compute(
            s.shape, lambda *i: r(*i).astype("float16"), name="out"))
        self.x = rng.standard_normal((n, self.ci, h, h)).astype("float16")
        self.w, self.b = rng.standard_normal((co, self.ci, 3, 3)), rng.standard_normal(co)
        self.ref = np.maximum(conv3x3_same(self.x.astype("float64"), self.w)
                              + self.b[None, :, None, None], 0)

    def inputs(self):
        """The kernel's arguments as numpy arrays: x, w, b and a float16 output to fill."""
        return [self.x, self.w.astype("float32"), self.b.astype("float32"),
                np.zeros(self.ref.shape, "float16")]

    def check(self, got) -> None:
        """Assert that ``got`` (the float16 output) holds the float16 nearest each float64
        output, within one float16 step where float32's sums may reach a midpoint: float32's
        sum of ci x 9 products and the bias is within that many unit roundoffs of the sum of
        their magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
        eq. 3.5)."""
        got = got.astype("float64")
        nearest = self.ref.astype("float16").astype("float64")
        step = np.spacing(np.abs(nearest).astype("float16")).astype("float64")
        bound = (self.ci * 9 + 1) * 2.0 ** -24 * (conv3x3_same(
            np.abs(self.x.astype("float64")), np.abs(self.w))
            + np.abs(self.b)[None, :, None, None])
        assert np.all(np.abs(got - self.ref) <= step + bound), \
            np.max(np.abs(got - self.ref) / step)
        assert np.mean(got == nearest) > 0.99


def vector_half_epilogues(mod, target, rng, want: int, draws: int = 24):
    """Up to ``want`` schedules of ``mod`` sampled (``draws`` design spaces) from thomas_tune's
    space for ``target`` whose OpenCL C, as TVM writes it, stores a vectorized float16
    epilogue through a private ``halfN`` (``halfN v = convert_halfN(e);``, then one store per
    component): as ``(schedule, raw source)``."""
    import re

    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.kernel_signature import native_half
    from thomas_tune.schedules import space_generator
    found = []
    for _ in range(draws):
        ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_generator(target),
                             search_strategy="replay-trace", task_name="t",
                             rand_state=int(rng.integers(1 << 20)), num_threads=1)
        for sch in ctx.generate_design_space():
            for post in ctx.space_generator.postprocs:
                post.apply(sch)
            try:
                with native_half():  # TVM's OpenCL C as it is
                    raw = tvm.compile(sch.mod, target).mod.imports[0].inspect_source()
            except tvm.error.InternalError as err:  # the pinned TVM's vectorizer check
                assert "eval_vec_" in str(err)
                continue
            if re.search(r"\bhalf\d+ \w+ = convert_half\d+\(", raw):
                found.append((sch, raw))
                if len(found) == want:
                    return found
    return found
