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
