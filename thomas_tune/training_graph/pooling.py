"""Max pooling with small windows as one injective kernel, which fuses with its neighbours.

TVM legalizes ``relax.nn.max_pool2d`` as a reduction over the window (``topi.nn.pool2d``). A
reduction kernel fuses with nothing before or after it, and the default GPU rules schedule it
as one: AlexNet@224's 3x3 stride-2 pool of its first convolution's output (32x64x55x55 values
read, 32x64x27x27 written) took 0.12 ms on the H200 as a default-scheduled reduction, about 5%
of the card's memory bandwidth.

For a window of at most :data:`MAX_WINDOW` elements, :func:`legalize_max_pool2d` writes the
pool instead as a maximum of the window's loads in one expression, one output per work-item:
an injective kernel, scheduled as one by the default rules and the tuner. It keeps the fusion
pattern of a convolution (:data:`OUT_EWISE_FUSABLE`): element-wise work after it may join its
kernel, the kernel that makes its input never does. Fused after its producer, the pool would
compute each of that producer's values once per window that holds it (2.25 times for a 3x3
window at stride 2): a Winograd output transform, a sum of 16 or 36 products per value, and
its reads of the transformed products, which are 4 to 9 times the output's size. The maximum is
exact, so the values are those of the reduction form, bit for bit.
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax, te, tirx

#: relax's pattern kind (``tvm.relax.transform.AnnotateTIROpPattern``) of a kernel that fuses
#: with the element-wise kernels after it, never with those before it (a convolution's)
OUT_EWISE_FUSABLE = 4

#: the largest window (pool height x width) written as one expression; a larger one stays a
#: reduction (its loads would make one very long expression per output)
MAX_WINDOW = 16


def max_pool2d_te(data: te.Tensor, out_shape, pool_size, strides, padding) -> te.Tensor:
    """NCHW max pooling of ``data`` (float, shape (N, C, H, W)) into ``out_shape`` (N, C, OH,
    OW), window ``pool_size`` (kh, kw), ``strides`` (sh, sw), ``padding`` (top, left, bottom,
    right), dilation 1; window positions outside the input are skipped (a window wholly
    outside gives the dtype's lowest value, as ``topi.nn.pool2d``). One compute, no reduction
    axis: ``out[n, c, y, x] = max_{i < kh, j < kw} data[n, c, y*sh + i - top, x*sw + j - left]``.
    """
    kh, kw = (int(v) for v in pool_size)
    sh, sw = (int(v) for v in strides)
    top, left = int(padding[0]), int(padding[1])
    h, w = (int(v) for v in data.shape[2:])
    lowest = tirx.min_value(data.dtype)

    def element(n, c, y, x):
        loads = []
        for i in range(kh):
            for j in range(kw):
                r, s = y * sh + (i - top), x * sw + (j - left)
                # only the edges can fall outside: a test the simplifier drops where it cannot
                inside = tirx.all(r >= 0, r < h, s >= 0, s < w)
                loads.append(tirx.if_then_else(inside, data[n, c, r, s], lowest))
        return functools.reduce(tirx.max, loads)

    return te.compute(tuple(int(v) for v in out_shape), element, name="max_pool2d")


def legalize_max_pool2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``LegalizeOps``' rule for ``relax.nn.max_pool2d``: :func:`max_pool2d_te` (a kernel named
    ``max_pool2d``) for a static NCHW pool with dilation 1 and a window of at most
    :data:`MAX_WINDOW` elements; TVM's own legalization (a reduction) otherwise."""
    a = call.attrs
    shape = _static_shape(call)
    window = int(a.pool_size[0]) * int(a.pool_size[1])
    if (a.layout != "NCHW" or a.out_layout != "NCHW" or any(int(d) != 1 for d in a.dilation)
            or window > MAX_WINDOW or shape is None or _static_shape(call.args[0]) is None):
        return tvm.ir.Op.get("relax.nn.max_pool2d").get_attr("FLegalize")(bb, call)
    pool = bb.call_te(max_pool2d_te, call.args[0], shape, list(a.pool_size), list(a.strides),
                      list(a.padding), primfunc_name_hint="max_pool2d")
    gv = pool.args[0]
    bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OUT_EWISE_FUSABLE))
    return pool


def _static_shape(expr: relax.Expr) -> list[int] | None:
    """The shape of a tensor expression as ints; None where it is not known statically."""
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(v, tirx.IntImm) for v in values):
        return None
    return [int(v) for v in values]


#: ``LegalizeOps``' ``customize_legalize_map`` of :func:`thomas_tune.tasks.fuse`
LEGALIZE = {"relax.nn.max_pool2d": legalize_max_pool2d}
