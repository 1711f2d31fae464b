"""BatchNorm in its training form as five kernels: three for the forward pass, two for the backward.

Written out of Relax's generic operators (mean, variance, subtract, divide, ...), the training
form of one BatchNorm followed by its activation costs about twenty kernel launches per step once
the gradient pass has differentiated each operator: a device that pays for every launch and every
byte (a phone's GPU) wants fewer. Here, for ``x`` of shape (N, C, H, W), float32 or float64, and
M = N * H * W values per channel:

forward
  ``bn_stats``        one reduction over (N, H, W), one pass over ``x``: the shifted sums
                      ``S0[c] = sum(d)`` and ``S1[c] = sum(d * d)``, ``d = x - x[0, c, 0, 0]``;
  ``bn_running``      the new running statistics, PyTorch's rule (biased variance to normalise,
                      unbiased into the running estimate, ``new = (1 - m) * old + m * batch``);
  ``bn_act``          ``z = act(gamma * (x - mean) * rstd + beta)`` (one element-wise pass);
backward
  ``bn_act_reduce``   one pass over ``x`` and ``dz``: ``sum(dy)`` and ``sum(dy * xhat)`` per
                      channel with ``dy = dz * act'(y)``, the gradients of beta and gamma;
  ``bn_act_dx``       ``dx = gamma * rstd * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M)``
                      (Ioffe & Szegedy 2015, section 3, the backward of Algorithm 1).

Both reductions sum two quantities at once (a tuple reduction: two outputs, one pass).
The mean and the variance come from one pass over ``x``. Shifting by one value of the channel
(``x[0, c, 0, 0]``) before summing keeps the one-pass variance ``S1 / M - (S0 / M)^2`` from
cancelling: its relative error is about ``eps * (1 + (mean - shift)^2 / var)``, and a sample of
the channel is within a few standard deviations of its mean (Chan, Golub & LeVeque 1983,
"Algorithms for computing the sample variance", the shifted-data algorithm). Every kernel
recomputes ``mean`` and ``rstd`` from ``S0, S1`` per element: a few operations, where a separate
kernel would cost a launch and a pass.

``act`` is ``None`` (identity), ``"relu"`` or ``"relu6"``; its derivative is PyTorch's
(``threshold_backward``: 0 where y <= 0; ``hardtanh_backward``: 0 outside 0 < y < 6).
"""

from __future__ import annotations

from tvm import te, tirx

ACTIVATIONS = (None, "relu", "relu6")
GRADIENT = "thomas_tune.bn_act"  # the te_grad_name of bn_act's call_tir_with_grad


def _check_act(act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"BatchNorm activation {act!r}: use one of {ACTIVATIONS}")


def _reduce_axes(x: te.Tensor):
    n, _, h, w = x.shape
    return (te.reduce_axis((0, n), "n"), te.reduce_axis((0, h), "h"),
            te.reduce_axis((0, w), "w"))


def _count(x: te.Tensor) -> int:
    n, _, h, w = (int(d) for d in x.shape)
    return n * h * w


def _sum2(a, b):
    return a[0] + b[0], a[1] + b[1]


def _zero2(t0, t1):
    return tirx.const(0.0, t0), tirx.const(0.0, t1)


_SUM2 = te.comm_reducer(_sum2, _zero2, name="sum2")  # two sums in one pass


class _Channel:
    """Per-channel mean and 1/sqrt(var + eps) of ``x`` from its shifted sums ``s`` (S0, S1)."""

    def __init__(self, x: te.Tensor, s, eps: float):
        self.x, self.s, self.eps = x, s, eps
        self.dt = x.dtype
        self.inv_m = tirx.const(1.0 / _count(x), self.dt)

    def mean_var(self, c):
        m1 = self.s[0][c] * self.inv_m
        var = tirx.max(self.s[1][c] * self.inv_m - m1 * m1, tirx.const(0.0, self.dt))
        return self.x[0, c, 0, 0] + m1, var

    def normalized(self, n, c, h, w):
        # (x - shift) - S0/M, not x - mean: the difference from the shift is exact for values
        # near it, and a channel whose mean is large against its spread keeps the rounding of
        # its mean out of every normalised value
        m1 = self.s[0][c] * self.inv_m
        var = tirx.max(self.s[1][c] * self.inv_m - m1 * m1, tirx.const(0.0, self.dt))
        rstd = tirx.const(1.0, self.dt) / tirx.sqrt(var + tirx.const(self.eps, self.dt))
        return ((self.x[n, c, h, w] - self.x[0, c, 0, 0]) - m1) * rstd, rstd


def _activate(y, act, dt):
    if act == "relu":
        return tirx.max(y, tirx.const(0.0, dt))
    if act == "relu6":
        return tirx.min(tirx.max(y, tirx.const(0.0, dt)), tirx.const(6.0, dt))
    return y


def _act_grad(dz, y, act, dt):
    zero = tirx.const(0.0, dt)
    if act == "relu":
        return tirx.Select(y > zero, dz, zero)
    if act == "relu6":
        return tirx.Select(tirx.all(y > zero, y < tirx.const(6.0, dt)), dz, zero)
    return dz


def bn_stats(x: te.Tensor):
    """(N, C, H, W) -> (S0, S1), each (C,): the shifted sums of each channel (module
    docstring)."""
    rn, rh, rw = _reduce_axes(x)

    def body(c):
        d = x[rn, c, rh, rw] - x[0, c, 0, 0]
        return _SUM2((d, d * d), axis=[rn, rh, rw])

    return te.compute((x.shape[1],), body, name="bn_stats")


def bn_running(x: te.Tensor, s0: te.Tensor, s1: te.Tensor, running_mean: te.Tensor,
               running_var: te.Tensor, momentum: float):
    """The new (running_mean, running_var), each (C,), from the batch's shifted sums."""
    ch = _Channel(x, (s0, s1), 0.0)
    m = _count(x)
    keep, mom = tirx.const(1.0 - momentum, x.dtype), tirx.const(momentum, x.dtype)
    unbias = tirx.const(m / max(m - 1, 1), x.dtype)

    def body(c):
        mean, var = ch.mean_var(c)
        return (keep * running_mean[c] + mom * mean,
                keep * running_var[c] + mom * (var * unbias))

    return te.compute(running_mean.shape, body, name="bn_running")


def bn_act(x: te.Tensor, s0: te.Tensor, s1: te.Tensor, gamma: te.Tensor, beta: te.Tensor,
           eps: float, act: str | None) -> te.Tensor:
    """(N, C, H, W) -> (N, C, H, W): ``act(gamma * xhat + beta)`` with the batch statistics."""
    _check_act(act)
    ch = _Channel(x, (s0, s1), eps)

    def body(n, c, h, w):
        xhat, _ = ch.normalized(n, c, h, w)
        return _activate(gamma[c] * xhat + beta[c], act, x.dtype)

    return te.compute(x.shape, body, name="bn_act")


def _dy(ch: _Channel, dz, gamma, beta, act, n, c, h, w):
    xhat, rstd = ch.normalized(n, c, h, w)
    return _act_grad(dz[n, c, h, w], gamma[c] * xhat + beta[c], act, ch.dt), xhat, rstd


def bn_act_reduce(dz: te.Tensor, x: te.Tensor, s0: te.Tensor, s1: te.Tensor, gamma: te.Tensor,
                  beta: te.Tensor, eps: float, act: str | None):
    """(sum(dy), sum(dy * xhat)), each (C,): the gradients of beta and gamma."""
    ch = _Channel(x, (s0, s1), eps)
    rn, rh, rw = _reduce_axes(x)

    def body(c):
        dy, xhat, _ = _dy(ch, dz, gamma, beta, act, rn, c, rh, rw)
        return _SUM2((dy, dy * xhat), axis=[rn, rh, rw])

    return te.compute((x.shape[1],), body, name="bn_act_reduce")


def bn_act_dx(dz: te.Tensor, x: te.Tensor, s0: te.Tensor, s1: te.Tensor, gamma: te.Tensor,
              beta: te.Tensor, dbeta: te.Tensor, dgamma: te.Tensor, eps: float,
              act: str | None) -> te.Tensor:
    """(N, C, H, W): the gradient of ``x`` through the batch statistics (module docstring)."""
    ch = _Channel(x, (s0, s1), eps)

    def body(n, c, h, w):
        dy, xhat, rstd = _dy(ch, dz, gamma, beta, act, n, c, h, w)
        return gamma[c] * rstd * (dy - (dbeta[c] + xhat * dgamma[c]) * ch.inv_m)

    return te.compute(x.shape, body, name="bn_act_dx")

