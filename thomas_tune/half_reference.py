"""The reference of a half-storage step (``--precision mixed16``): where PyTorch rounds.

A mixed16 step computes in float32 on layer outputs stored as float16
(:mod:`thomas_tune.half_storage`), so its gradients differ from a plain float64 step by the
rounding of every stored tensor (about 2^-11 of each value), far more than float32's own
rounding. Its reference is the float64 step with the same values rounded to float16 at the
same places, each rounding passed through unchanged by the backward (the build's gradient is
built before the storage is rounded, so no gradient passes through a cast). Then the build
and the reference differ by float32 rounding, and by one float16 step where a value lies
within float32 rounding of the midpoint between two float16 values.

The places are stated here from the model's layers, in PyTorch, not read from the project's
graph rewrite (an independent statement of the same rule, which ``tests/test_half_reference.py``
compares with the build):

* a convolution's output, and with a bias the sum with its bias too (two stores);
* a training-form BatchNorm's output after its activation (one kernel computes both in
  float32 and stores the result);
* an inference-form (frozen) BatchNorm's output before its activation (the activation reads
  the stored value), and where it follows a frozen convolution without bias, that convolution
  computed again with the BatchNorm folded into its weight (``w * gamma / sqrt(var + eps)``,
  shift ``beta - mean * gamma / sqrt(var + eps)``: the convolution's output and the sum with
  the shift, each stored; PyTorch's ``fuse_conv_bn_eval`` states the same fold);
* the ReLU or ReLU6 of a stored value (a frozen BatchNorm's, a convolution's or a linear
  layer's with its bias): stored again, the same float16 values, as rounding commutes with
  them (so that the next convolution reads a stored tensor);
* a residual sum, a linear layer's output (its bias added), an average pooling that is not
  the identity, a dropout's output;
* not a max pooling's output (the largest of float16 values is one) nor a flatten.

Used by :class:`thomas_tune.kinks.KinkGraph` with ``half=True``.
"""

from __future__ import annotations


def round_half(t):
    """``t`` (a float tensor) with each value rounded to the nearest float16 (ties to even,
    IEEE 754-2008), in ``t``'s dtype; its gradient (and its forward-mode tangent) passes
    unchanged, as the build's does."""
    import torch
    r = t.detach().to(torch.float16).to(t.dtype)
    # t + (r - t) is r exactly: r - t is exact (Sterbenz), and r is representable
    return t + (r - t.detach())


def conv2d(g, name, x, stride, padding, groups, bias, rounded=True):
    """The convolution ``name`` of graph ``g`` (a :class:`thomas_tune.reference.TorchGraph`)
    on ``x`` with its output rounded (unless not ``rounded``), and with ``bias`` its sum with
    the bias rounded too."""
    y = g.F.conv2d(x, g.p[f"{name}.weight"], None, stride, padding, 1, groups)
    y = round_half(y) if rounded else y
    if bias:
        y = round_half(y + g.p[f"{name}.bias"].reshape(1, -1, 1, 1))
    return y


def inference_batch_norm(g, name, x, eps, conv):
    """The inference form of BatchNorm ``name`` on ``x`` (before its activation), rounded:
    folded into ``conv`` when that is the record ``(output, input, name, stride, padding,
    groups)`` of the frozen convolution without bias that made ``x``, else the running
    statistics' affine map (module docstring)."""
    c = x.shape[1]
    s = g.p[f"{name}.weight"] / (g.s[f"{name}.running_var"] + eps).sqrt()
    shift = g.p[f"{name}.bias"] - g.s[f"{name}.running_mean"] * s
    if conv is not None:
        _, x_in, conv_name, stride, padding, groups = conv
        w = g.p[f"{conv_name}.weight"] * s.reshape(-1, 1, 1, 1)
        y = round_half(g.F.conv2d(x_in, w, None, stride, padding, 1, groups))
        return round_half(y + shift.reshape(1, c, 1, 1))
    return round_half(x * s.reshape(1, c, 1, 1) + shift.reshape(1, c, 1, 1))
