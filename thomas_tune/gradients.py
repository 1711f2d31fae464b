"""Gradients that the pinned TVM lacks, registered as Relax ``FPrimalGradient`` attributes.

Importing this module registers them for: ``relax.clip`` (ReLU6), ``relax.nn.batch_norm``,
``relax.nn.dropout``, ``relax.nn.adaptive_avg_pool2d`` and ``relax.flatten``. Each is checked
against float64 finite differences in ``tests/test_gradients.py``. Registration is idempotent and
never replaces a gradient that TVM itself registers (see :func:`missing_gradients`).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
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
    """Register every gradient of :data:`OPS` that is still missing; safe to call twice."""
    for name in missing_gradients():
        register_gradient(name, _GRADIENTS[name])


register()
