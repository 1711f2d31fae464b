"""Gradients that the pinned TVM lacks, registered as Relax ``FPrimalGradient`` attributes.

Importing this module registers them for: ``relax.clip`` (ReLU6), ``relax.nn.batch_norm``,
``relax.nn.dropout``, ``relax.nn.adaptive_avg_pool2d`` and ``relax.flatten``. Each is checked
against float64 finite differences in ``tests/test_gradients.py``. Registration is idempotent and
never replaces a gradient that TVM itself registers (see :func:`missing_gradients`), with two
exceptions: depthwise convolutions get their own backward kernels (:func:`_conv2d_grad`), since
TVM's form of them (a transposed and a grouped convolution over batch x channels) held most of
a MobileNet training step on a GPU and its schedule space had no valid GPU schedule; ReLU's
gradient reads its output, not its input (:func:`_relu_grad`); and max pooling's backward is
one element-wise kernel (:func:`max_pool2d_grad_te`) where TVM's takes three launches. Three
more are new: ``relax.grad.no_grad`` (no gradient passes), the backward of the training-form
BatchNorm (:mod:`models.batchnorm`, :func:`_bn_act_grad`) and that of the loss
(:mod:`thomas_tune.training_graph.loss`).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax import op as R
from tvm.relax.op.base import register_gradient
from tvm.relax.op.grad import no_grad

OPS = ("relax.clip", "relax.nn.batch_norm", "relax.nn.dropout", "relax.nn.adaptive_avg_pool2d",
       "relax.flatten")


def _shape(expr):
    return [int(v) for v in expr.ty.shape.values]


def _dtype(expr):
    return str(expr.ty.dtype)


def _clip_grad(orig_var, orig_call, output_grad, ctx):
    """y = clip(x, lo, hi): dx = dy where lo < x < hi, else 0 (PyTorch's hardtanh_backward)."""
    x, lo, hi = orig_call.args
    dt = _dtype(x)
    inside = R.logical_and(R.greater(x, relax.const(float(lo.value), dt)),
                           R.less(x, relax.const(float(hi.value), dt)))
    return [R.where(inside, output_grad, relax.const(0.0, dt)), no_grad(lo), no_grad(hi)]


def _relu_grad(orig_var, orig_call, output_grad, ctx):
    """y = relu(x): dx = dy where y > 0, else 0, read from the output as PyTorch's
    ``threshold_backward`` does. TVM's own reads the input, which then stays alive for the
    backward beside the output and keeps the ReLU out of the kernel that makes its input
    (a matmul or convolution with its bias): one launch and one tensor more per ReLU."""
    dt = _dtype(orig_var)
    return [R.where(R.greater(orig_var, relax.const(0.0, dt)), output_grad,
                    relax.const(0.0, dt))]


def _flatten_grad(orig_var, orig_call, output_grad, ctx):
    """y = flatten(x): dx = reshape(dy, shape(x))."""
    return [R.reshape(output_grad, _shape(orig_call.args[0]))]


def _dropout_grad(orig_var, orig_call, output_grad, ctx):
    """(y, mask) = dropout(x): dx = dy[0] * mask.

    The op's lowering in this TVM is the identity with an all-ones mask, so dx = dy[0] there;
    thomas_tune's own models apply training dropout as ``x * mask`` with the mask as an input.
    """
    dy = relax.TupleGetItem(output_grad, 0)
    mask = relax.TupleGetItem(orig_var, 1)
    return [R.multiply(dy, mask)]


def adaptive_pool_matrix(in_size: int, out_size: int) -> np.ndarray:
    """(out_size, in_size) averaging matrix of adaptive average pooling along one axis.

    Bin i covers [floor(i * in / out), ceil((i + 1) * in / out)), the rule of PyTorch's and TVM's
    adaptive pooling; each row sums to 1.
    """
    p = np.zeros((out_size, in_size), dtype="float64")
    for i in range(out_size):
        start = (i * in_size) // out_size
        end = -((-(i + 1) * in_size) // out_size)
        p[i, start:end] = 1.0 / (end - start)
    return p


def _adaptive_avg_pool2d_grad(orig_var, orig_call, output_grad, ctx):
    """y[n,c] = Ph x[n,c] Pw^T (separable), so dx[n,c] = Ph^T dy[n,c] Pw (NCHW only)."""
    x = orig_call.args[0]
    if orig_call.attrs.layout != "NCHW" or (orig_call.attrs.out_layout or "NCHW") != "NCHW":
        raise ValueError("adaptive_avg_pool2d gradient: only the NCHW layout is supported")
    _, _, h, w = _shape(x)
    _, _, oh, ow = _shape(orig_var)
    dt = _dtype(x)
    ph = relax.const(adaptive_pool_matrix(h, oh).T.astype(dt), dt)  # (H, oh)
    pw = relax.const(adaptive_pool_matrix(w, ow).astype(dt), dt)  # (ow, W)
    return [R.matmul(R.matmul(ph, output_grad), pw)]


def _batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient of (y, mean', var') = batch_norm(x, gamma, beta, mean, var).

    Training (Ioffe & Szegedy 2015, section 3): with xhat = (x - mu_B) / sqrt(var_B + eps) over the
    m = N*H*W elements of a channel, dx = gamma / sqrt(var_B + eps) / m * (m dy - sum(dy)
    - xhat sum(dy xhat)); dgamma = sum(dy xhat); dbeta = sum(dy). Inference: the statistics are
    constants, dx = dy * gamma / sqrt(var + eps). Running statistics get no gradient.
    """
    x, gamma, beta, mean, var = orig_call.args
    attrs = orig_call.attrs
    shape = _shape(x)
    axis = int(attrs.axis) % len(shape)
    axes = [i for i in range(len(shape)) if i != axis]
    bshape = [shape[i] if i == axis else 1 for i in range(len(shape))]
    dt = _dtype(x)
    eps = relax.const(float(attrs.epsilon), dt)
    dy = relax.TupleGetItem(output_grad, 0)
    if attrs.training:
        mu = R.reshape(R.mean(x, axis=axes), bshape)
        sigma2 = R.reshape(R.variance(x, axis=axes), bshape)
    else:
        mu, sigma2 = R.reshape(mean, bshape), R.reshape(var, bshape)
    inv = ctx.emit(R.divide(relax.const(1.0, dt), R.sqrt(R.add(sigma2, eps))))
    xhat = ctx.emit(R.multiply(R.subtract(x, mu), inv))
    g = R.reshape(gamma, bshape) if attrs.scale else relax.const(1.0, dt)
    sum_dy = ctx.emit(R.sum(dy, axis=axes, keepdims=True))
    sum_dy_xhat = ctx.emit(R.sum(R.multiply(dy, xhat), axis=axes, keepdims=True))
    if attrs.training:
        m = relax.const(float(np.prod([shape[i] for i in axes])), dt)
        inner = R.subtract(R.subtract(R.multiply(dy, m), sum_dy), R.multiply(xhat, sum_dy_xhat))
        dx = R.divide(R.multiply(R.multiply(g, inv), inner), m)
    else:
        dx = R.multiply(dy, R.multiply(g, inv))
    dgamma = R.reshape(sum_dy_xhat, [shape[axis]]) if attrs.scale else no_grad(gamma)
    dbeta = R.reshape(sum_dy, [shape[axis]]) if attrs.center else no_grad(beta)
    return [dx, dgamma, dbeta, no_grad(mean), no_grad(var)]


def depthwise_weight_grad_te(x, dy, kernel, strides, padding, dilation):
    """TE compute of the weight gradient of a depthwise conv2d (NCHW, OIHW, multiplier 1).

    x: (N, C, H, W), dy: (N, C, OH, OW) -> dw: (C, 1, KH, KW) with
    dw[c, 0, kh, kw] = sum over n, oh, ow of dy[n, c, oh, ow] * xpad[n, c, oh*sh + kh*dh,
    ow*sw + kw*dw] (the definition of the convolution, differentiated by the weight). One
    reduction kernel with C*KH*KW outputs and N*OH*OW terms each, which GPU schedules split
    across threads; TVM's own gradient computes it as a grouped convolution over a
    (N*C)-channel tensor whose only parallel axes are C, KH and KW.
    """
    from tvm import te, topi
    _, _, oh_n, ow_n = dy.shape
    n_n = x.shape[0]
    kh_n, kw_n = kernel
    (sh, sw), (dh, dw) = strides, dilation
    pt, pl, pb, pr = padding
    xp = topi.nn.pad(x, [0, 0, pt, pl], [0, 0, pb, pr], name="depthwise_grad_pad")
    rn = te.reduce_axis((0, n_n), name="rn")
    rh = te.reduce_axis((0, oh_n), name="rh")
    rw = te.reduce_axis((0, ow_n), name="rw")
    return te.compute(
        (x.shape[1], 1, kh_n, kw_n),
        lambda c, _, kh, kw: te.sum(
            dy[rn, c, rh, rw] * xp[rn, c, rh * sh + kh * dh, rw * sw + kw * dw],
            axis=[rn, rh, rw]),
        name="depthwise_weight_grad")


def depthwise_data_grad_te(dy, w, in_hw, strides, padding, dilation):
    """TE compute of the data gradient of a depthwise conv2d (NCHW, OIHW, multiplier 1).

    dy: (N, C, OH, OW), w: (C, 1, KH, KW) -> dx: (N, C, H, W) with
    dx[n, c, h, w] = sum over kh, kw of w[c, 0, kh, kw] * dy[n, c, oh, ow] where
    oh = (h + pt - kh*dh) / sh and ow likewise are whole numbers inside the output (the
    transposed convolution written as a gather: each output element reads KH*KW terms, no
    dilated copy of dy). With stride 1 (most depthwise layers) it is the plain convolution of
    the padded dy with the flipped filter, free of the divisibility tests.
    """
    import tvm
    from tvm import te, topi
    n_n, c_n, oh_n, ow_n = dy.shape
    _, _, kh_n, kw_n = w.shape
    h_n, w_n = in_hw
    (sh, sw), (dh, dw) = strides, dilation
    pt, pl = padding[0], padding[1]
    rkh = te.reduce_axis((0, kh_n), name="rkh")
    rkw = te.reduce_axis((0, kw_n), name="rkw")
    if sh == sw == 1:
        # stride 1: a depthwise convolution of dy, padded by d*(K-1)-p before, with the
        # flipped filter (dx[h] = sum_k dyp[h + d*(K-1-k)] w[k]); no division, no branch
        # but the padding's
        bt, bl = dh * (int(kh_n) - 1) - pt, dw * (int(kw_n) - 1) - pl
        bb = int(h_n) + dh * (int(kh_n) - 1) - int(oh_n) - bt
        br = int(w_n) + dw * (int(kw_n) - 1) - int(ow_n) - bl
        if min(bt, bl, bb, br) >= 0:
            dyp = topi.nn.pad(dy, [0, 0, bt, bl], [0, 0, bb, br], name="depthwise_grad_dy_pad")
            return te.compute(
                (n_n, c_n, h_n, w_n),
                lambda n, c, h, x_: te.sum(
                    dyp[n, c, h + dh * (kh_n - 1 - rkh), x_ + dw * (kw_n - 1 - rkw)]
                    * w[c, 0, rkh, rkw], axis=[rkh, rkw]),
                name="depthwise_data_grad")
    fdiv, fmod = tvm.tirx.floordiv, tvm.tirx.floormod

    def term(n, c, h, x_):
        th, tw = h + pt - rkh * dh, x_ + pl - rkw * dw
        oh, ow = fdiv(th, sh), fdiv(tw, sw)
        ok = tvm.tirx.all(th >= 0, tw >= 0, fmod(th, sh) == 0, fmod(tw, sw) == 0,
                          oh < oh_n, ow < ow_n)
        safe_oh = tvm.tirx.max(tvm.tirx.min(oh, oh_n - 1), 0)
        safe_ow = tvm.tirx.max(tvm.tirx.min(ow, ow_n - 1), 0)
        return tvm.tirx.if_then_else(ok, dy[n, c, safe_oh, safe_ow] * w[c, 0, rkh, rkw],
                                     tvm.tirx.const(0.0, dy.dtype))

    return te.compute((n_n, c_n, h_n, w_n),
                      lambda n, c, h, x_: te.sum(term(n, c, h, x_), axis=[rkh, rkw]),
                      name="depthwise_data_grad")


def is_depthwise(call) -> bool:
    """True for a conv2d call that is depthwise with multiplier 1 in NCHW/OIHW layouts."""
    a = call.attrs
    x, w = call.args
    c_in, c_out = _shape(x)[1], _shape(w)[0]
    return (a.data_layout == "NCHW" and a.kernel_layout == "OIHW"
            and (a.out_layout or "NCHW") == "NCHW" and int(a.groups) == c_in == c_out
            and _shape(w)[1] == 1 and c_in > 1)


def _conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient of conv2d: depthwise layers (multiplier 1) get the two kernels above, every
    other convolution TVM's own gradient (transposed convolution and grouped convolution)."""
    if not is_depthwise(orig_call):
        return _tvm_conv2d_grad(orig_var, orig_call, output_grad, ctx)
    a = orig_call.attrs
    x, w = orig_call.args
    strides = [int(v) for v in a.strides]
    dilation = [int(v) for v in a.dilation]
    padding = [int(v) for v in a.padding]
    kernel = _shape(w)[2:]
    dw = ctx.call_te(depthwise_weight_grad_te, x, output_grad, kernel, strides, padding,
                     dilation, primfunc_name_hint="depthwise_weight_grad")
    dx = ctx.call_te(depthwise_data_grad_te, output_grad, w, _shape(x)[2:], strides, padding,
                     dilation, primfunc_name_hint="depthwise_data_grad")
    return [dx, dw]


def max_pool2d_grad_te(dy, x, kernel, strides, padding):
    """The gradient of max pooling (NCHW, dilation 1) with respect to its input ``x``
    (N, C, H, W), from ``dy`` (N, C, OH, OW): one element-wise kernel.

    Each input element gathers ``dy`` from the windows that contain it (at most
    ceil(kh / sh) x ceil(kw / sw) of them) and keeps a window's value where it is that window's
    maximum, the first in row-major order on ties (PyTorch's rule: its CPU and CUDA kernels
    scan the window and take a value only when it is larger). The window's maximum is
    recomputed in place (kh x kw comparisons per window) instead of being stored, so no
    reduction and no index tensor: one launch, against three for TVM's ``pool_grad`` (window
    argmax, then scatter), and the ReLU mask of the layer before fuses into it. Padding
    (``padding``: top, left, bottom, right) never holds a maximum, as in PyTorch (-inf)."""
    n_n, c_n, h_n, w_n = (int(v) for v in x.shape)
    oh_n, ow_n = int(dy.shape[2]), int(dy.shape[3])
    kh, kw = (int(v) for v in kernel)
    sh, sw = (int(v) for v in strides)
    pt, pl = int(padding[0]), int(padding[1])
    rh, rw = -(-kh // sh), -(-kw // sw)

    def clamp(v, hi):
        return tvm.tirx.max(tvm.tirx.min(v, hi - 1), 0)

    def grad(n, c, h, w):
        xv = x[n, c, h, w]
        total = tvm.tirx.const(0.0, dy.dtype)
        for i in range(rh):
            for j in range(rw):
                # the window (oh, ow) and where (h, w) sits in it, (a0, b0)
                a0 = tvm.tirx.floormod(h + pt, sh) + i * sh
                b0 = tvm.tirx.floormod(w + pl, sw) + j * sw
                oh = tvm.tirx.floordiv(h + pt, sh) - i
                ow = tvm.tirx.floordiv(w + pl, sw) - j
                holds = tvm.tirx.all(oh >= 0, oh < oh_n, a0 < kh, ow >= 0, ow < ow_n, b0 < kw)
                first_max = []
                for a in range(kh):
                    for b in range(kw):
                        hh, ww = oh * sh - pt + a, ow * sw - pl + b
                        v = x[n, c, clamp(hh, h_n), clamp(ww, w_n)]
                        earlier = a * kw + b < a0 * kw + b0
                        first_max.append(tvm.tirx.any(
                            hh < 0, hh >= h_n, ww < 0, ww >= w_n,
                            tvm.tirx.all(a == a0, b == b0),
                            tvm.tirx.Select(earlier, v < xv, v <= xv)))
                total = total + tvm.tirx.Select(
                    tvm.tirx.all(holds, *first_max),
                    dy[n, c, clamp(oh, oh_n), clamp(ow, ow_n)],
                    tvm.tirx.const(0.0, dy.dtype))
        return total

    return te.compute((n_n, c_n, h_n, w_n), grad, name="max_pool2d_backward")


def _max_pool2d_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient of max pooling: :func:`max_pool2d_grad_te` for NCHW without dilation, TVM's
    own (``relax.grad.max_pool2d_backward``) otherwise."""
    a = orig_call.attrs
    if (a.layout != "NCHW" or (a.out_layout or "NCHW") != "NCHW"
            or any(int(d) != 1 for d in a.dilation)):
        return _tvm_max_pool2d_grad(orig_var, orig_call, output_grad, ctx)
    x = orig_call.args[0]
    return [ctx.call_te(max_pool2d_grad_te, output_grad, x, [int(v) for v in a.pool_size],
                        [int(v) for v in a.strides], [int(v) for v in a.padding],
                        primfunc_name_hint="max_pool2d_backward")]


def matmul_tn_te(a, b):
    """``a^T @ b`` for ``a`` (K, M) and ``b`` (K, N): (M, N), each output a sum over K of
    ``a[k, m] * b[k, n]``, read in place (no transposed copy of ``a``)."""
    k = te.reduce_axis((0, a.shape[0]), "k")
    return te.compute((a.shape[1], b.shape[1]),
                      lambda m, n: te.sum(a[k, m] * b[k, n], axis=k), name="matmul_tn")


@relax.expr_functor.mutator
class _TransposeFree(relax.PyExprMutator):
    """Rewrites ``matmul(permute_dims(a), b)`` of 2-D tensors as one :func:`matmul_tn_te`."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        a = call.args[0]
        bound = self.lookup_binding(a) if isinstance(a, relax.Var) else None
        if not (isinstance(bound, relax.Call)
                and bound.op == tvm.ir.Op.get("relax.permute_dims")
                and len(_shape(bound.args[0])) == 2 and len(_shape(call.args[1])) == 2
                and (bound.attrs.axes is None or [int(v) for v in bound.attrs.axes] == [1, 0])):
            return call
        return self.builder_.call_te(matmul_tn_te, bound.args[0], call.args[1],
                                     primfunc_name_hint="matmul_tn")


def transpose_free_matmuls(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``matmul(permute_dims(a), b)`` of 2-D tensors in its Relax functions
    computed by one kernel reading ``a`` in place (:func:`matmul_tn_te`). The gradient of a
    linear layer's weight, ``dy^T @ x``, is of this form: one launch and one copy of ``dy``
    fewer per layer. The transposes left unused are removed."""
    mutator = _TransposeFree(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    out = mutator.builder_.get()
    return relax.transform.DeadCodeElimination(
        [gv.name_hint for gv, f in out.functions.items() if isinstance(f, relax.Function)])(out)


def _no_grad_grad(orig_var, orig_call, output_grad, ctx):
    """y = no_grad(x): no gradient reaches x (the op is the identity in the forward pass)."""
    return [no_grad(orig_call.args[0])]


def _bn_act_grad(orig_var, call, output_grad, ctx):
    """The backward of :func:`models.batchnorm.bn_act` (``call`` is its
    ``call_tir_with_grad``, arguments x, the batch's sum of squared deviations and mean,
    gamma, beta): two kernels, ``bn_act_reduce`` (the gradients of beta and gamma) and
    ``bn_act_dx``. The statistics get zero partials that nothing reads: their gradient is
    inside ``bn_act_dx``, and they are marked ``no_grad`` where they are made. Returns the
    tuple of the five partials, bound in ``ctx``."""
    from ..models import batchnorm as B

    x, mean, m2, gamma, beta = call.args[1].fields
    kwargs = call.attrs.te_grad_kwargs
    eps, act = float(kwargs["eps"]), (str(kwargs["act"]) or None)
    c, dt = _shape(x)[1], _dtype(x)
    r = ctx.emit_te(B.bn_act_reduce, output_grad, x, mean, m2, gamma, beta, eps, act,
                    primfunc_name_hint="bn_act_reduce")
    dbeta = ctx.emit(relax.TupleGetItem(r, 0))
    dgamma = ctx.emit(relax.TupleGetItem(r, 1))
    dx = ctx.emit_te(B.bn_act_dx, output_grad, x, mean, m2, gamma, beta, dbeta, dgamma, eps,
                     act, primfunc_name_hint="bn_act_dx")
    zeros = relax.const(np.zeros((c,), dt))
    return ctx.emit(relax.Tuple([dx, zeros, zeros, dgamma, dbeta]))


_tvm_conv2d_grad = None
_tvm_max_pool2d_grad = None
_relu_grad_registered = False  # ours replaces TVM's, once


_GRADIENTS = {
    "relax.clip": _clip_grad,
    "relax.nn.batch_norm": _batch_norm_grad,
    "relax.nn.dropout": _dropout_grad,
    "relax.nn.adaptive_avg_pool2d": _adaptive_avg_pool2d_grad,
    "relax.flatten": _flatten_grad,
}


def missing_gradients(op_names=OPS) -> list[str]:
    """Names among ``op_names`` whose op has no ``FPrimalGradient`` registered (yet)."""
    return [n for n in op_names if tvm.ir.Op.get(n).get_attr("FPrimalGradient") is None]


def register() -> None:
    """Register every gradient of :data:`OPS` that is still missing, the depthwise form of
    conv2d's gradient (:func:`_conv2d_grad`, which keeps TVM's for other convolutions), ReLU's
    from its output (:func:`_relu_grad`), max pooling's in one kernel
    (:func:`_max_pool2d_grad`), the gradient of ``relax.grad.no_grad`` (none reaches its
    input), the backward of the training-form BatchNorm (:func:`_bn_act_grad`) and of the loss
    (:func:`thomas_tune.training_graph.loss.register`); safe to call twice."""
    global _tvm_conv2d_grad, _tvm_max_pool2d_grad, _relu_grad_registered
    from . import loss
    from ..models import batchnorm as B

    loss.register()

    if tvm.ir.Op.get("relax.grad.no_grad").get_attr("FPrimalGradient") is None:
        register_gradient("relax.grad.no_grad", _no_grad_grad)
    handler = "tvm.relax.te_grad._register." + B.GRADIENT
    if tvm.get_global_func(handler, allow_missing=True) is None:
        tvm.register_global_func(handler, _bn_act_grad)
    for name in missing_gradients():
        register_gradient(name, _GRADIENTS[name])
    op = tvm.ir.Op.get("relax.nn.conv2d")
    current = op.get_attr("FPrimalGradient")
    if _tvm_conv2d_grad is None:
        _tvm_conv2d_grad = current
        register_gradient("relax.nn.conv2d", _conv2d_grad, level=11)
    if _tvm_max_pool2d_grad is None:
        _tvm_max_pool2d_grad = tvm.ir.Op.get("relax.nn.max_pool2d").get_attr("FPrimalGradient")
        register_gradient("relax.nn.max_pool2d", _max_pool2d_grad, level=11)
    if not _relu_grad_registered:
        _relu_grad_registered = True
        register_gradient("relax.nn.relu", _relu_grad, level=11)


register()
