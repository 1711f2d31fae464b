"""BatchNorm in its training form as seven kernels: four in the forward pass, three backward.

Written out of Relax's generic operators (mean, subtract, divide, ...), the training form of one
BatchNorm followed by its activation costs about seventeen kernel launches per step once the
gradient pass has differentiated each operator: a device that pays for every launch and every
byte (a phone's GPU) wants fewer. Here, for ``x`` of shape (N, C, H, W), float32 or float64, and
M = N * H * W values per channel:

forward
  ``bn_psum``         per sample and channel, the sum of its (H, W) values, ``p[n, c]``; the
                      sample's mean ``m[n, c] = p[n, c] / (H * W)``;
  ``bn_stats``        per sample and channel, the sums of the deviations from the sample's own
                      mean and of their squares over (H, W): ``s0[n, c] = sum(x - m[n, c])``,
                      ``s1[n, c] = sum((x - m[n, c])^2)`` (a tuple reduction: two sums in one
                      pass; ``s0`` is the rounding error of ``m`` times H * W);
  ``bn_combine``      per channel, the samples joined (Chan, Golub & LeVeque 1983, eq. 2.1):
                      with the shift ``mu[c] = m[0, c]`` (the first sample's mean, a value near
                      the channel's mean) and each sample's mean's offset from it
                      ``e[n] = (m[n] - mu) + s0[n] / (H * W)``, the channel's shifted sums
                      ``S0[c] = sum(x - mu) = H * W * sum(e)`` and ``S1[c] = sum((x - mu)^2) =
                      sum(s1 - s0^2 / (H * W)) + H * W * sum(e^2)``;
  running statistics  PyTorch's rule (biased variance to normalise, unbiased into the running
                      estimate, ``new = (1 - m) * old + m * batch``): not a kernel per
                      BatchNorm but :func:`running_exprs`, which the training graph computes
                      for every BatchNorm of the step in a few multi-tensor kernels;
  ``bn_act``          ``z = act(gamma * xhat + beta)`` (one element-wise pass);
backward
  ``bn_act_reduce``   per sample and channel, one pass over ``x`` and ``dz``: the sums of
                      ``dy`` and ``dy * xhat`` over (H, W) with ``dy = dz * act'(y)``;
  ``bn_sums``         their sums over the samples: the gradients of beta and gamma;
  ``bn_act_dx``       ``dx = gamma * rstd * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M)``
                      (Ioffe & Szegedy 2015, section 3, the backward of Algorithm 1).

Every channel sum is taken in two levels, over each sample's H * W values and then over the N
samples: float32's error in a sum grows with the length of the chains that add into one
accumulator, and one sum of N * H * W values (8,192 in a test's 32x32 layer at batch 8, 401,408
in MobileNetV2's first layer at 224 px and batch 32) left the normalised values several times
further from float64 than two-level sums (measured kernel by kernel,
``experiments/kernel_precision.py``). Each sample's variance is a two-pass one, its deviations
taken from its own rounded mean and corrected by their mean (Chan, Golub & LeVeque 1983,
"Algorithms for computing the sample variance", eq. 1.7); the samples are then joined by the
pairwise formula of the same paper (eq. 2.1), so no pass over ``x`` waits for the channel's
mean. The consumers see the channel through ``mu, S0, S1``: with ``m1 = S0 / M`` (the
channel mean's offset from the shift, small against the spread), ``var = S1 / M - m1^2`` and
``xhat = ((x - mu) - m1) * rstd``, where ``x - mu`` is an exact float32 difference for values
near the shift. A one-pass variance shifted by one value of the channel, which saves the pass
of the sample means, was 2-5x further from float64 in the normalised values. Every kernel
recomputes the mean and ``rstd`` from ``mu, S0, S1`` per element: a few operations, where a
separate kernel would cost a launch.

``act`` is ``None`` (identity), ``"relu"`` or ``"relu6"``; its derivative is PyTorch's
(``threshold_backward``: 0 where y <= 0; ``hardtanh_backward``: 0 outside 0 < y < 6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tvm import te, tirx

ACTIVATIONS = (None, "relu", "relu6")
GRADIENT = "thomas_tune.bn_act"  # the te_grad_name of bn_act's call_tir_with_grad


def _check_act(act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"BatchNorm activation {act!r}: use one of {ACTIVATIONS}")


def _count(x: te.Tensor) -> int:
    """N * H * W of an (N, C, H, W) tensor: the values of one channel."""
    n, _, h, w = (int(d) for d in x.shape)
    return n * h * w


def _sum2(a, b):
    return a[0] + b[0], a[1] + b[1]


def _zero2(t0, t1):
    return tirx.const(0.0, t0), tirx.const(0.0, t1)


_SUM2 = te.comm_reducer(_sum2, _zero2, name="sum2")  # two sums in one pass


class _Channel:
    """Per-channel mean and 1/sqrt(var + eps) of ``x`` from its sums ``s`` (S0, S1) shifted by
    ``shift`` (C,)."""

    def __init__(self, x: te.Tensor, shift: te.Tensor, s, eps: float):
        self.x, self.shift, self.s, self.eps = x, shift, s, eps
        self.dt = x.dtype
        self.inv_m = tirx.const(1.0 / _count(x), self.dt)

    def _m1_var(self, c):
        """The mean of the deviations from the shift, S0/M, and the biased variance."""
        m1 = self.s[0][c] * self.inv_m
        return m1, tirx.max(self.s[1][c] * self.inv_m - m1 * m1, tirx.const(0.0, self.dt))

    def mean_var(self, c):
        m1, var = self._m1_var(c)
        return self.shift[c] + m1, var

    def normalized(self, n, c, h, w):
        # (x - shift) - S0/M, not x - mean: the difference from the shift is exact for values
        # near it, and a channel whose mean is large against its spread keeps the rounding of
        # its mean (the shift's rounding, which S0/M is) out of every normalised value
        m1, var = self._m1_var(c)
        rstd = tirx.const(1.0, self.dt) / tirx.sqrt(var + tirx.const(self.eps, self.dt))
        return ((self.x[n, c, h, w] - self.shift[c]) - m1) * rstd, rstd


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


def _plane_axes(x: te.Tensor):
    """Reduction axes over one sample's plane (H, W) of an (N, C, H, W) tensor."""
    _, _, h, w = x.shape
    return te.reduce_axis((0, h), "h"), te.reduce_axis((0, w), "w")


def bn_psum(x: te.Tensor) -> te.Tensor:
    """(N, C, H, W) -> (N, C): the sum of each sample's values of each channel."""
    rh, rw = _plane_axes(x)
    return te.compute((x.shape[0], x.shape[1]),
                      lambda n, c: te.sum(x[n, c, rh, rw], axis=[rh, rw]), name="bn_psum")


def _sample_mean(p: te.Tensor, hw: int, n, c):
    """The mean of sample ``n``'s values of channel ``c`` from their sum ``p`` (N, C)."""
    return p[n, c] * tirx.const(1.0 / hw, p.dtype)


def bn_stats(x: te.Tensor, p: te.Tensor):
    """(N, C, H, W), (N, C) sums of each sample's plane (:func:`bn_psum`) -> (s0, s1), each
    (N, C): the sums of each sample's deviations from its own mean and of their squares, per
    channel (module docstring)."""
    rh, rw = _plane_axes(x)
    hw = int(x.shape[2]) * int(x.shape[3])

    def body(n, c):
        d = x[n, c, rh, rw] - _sample_mean(p, hw, n, c)
        return _SUM2((d, d * d), axis=[rh, rw])

    return te.compute((x.shape[0], x.shape[1]), body, name="bn_stats")


def _sum3(a, b):
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _zero3(t0, t1, t2):
    return tirx.const(0.0, t0), tirx.const(0.0, t1), tirx.const(0.0, t2)


_SUM3 = te.comm_reducer(_sum3, _zero3, name="sum3")  # three sums in one pass


def bn_combine(p: te.Tensor, s0: te.Tensor, s1: te.Tensor, hw: int):
    """(N, C) per-sample sums (:func:`bn_psum`) and deviation sums (:func:`bn_stats`) of
    samples of ``hw`` (H * W) values each -> (mu, S0, S1), each (C,): the shift and the
    channel's sums of the deviations from it and of their squares (module docstring), as one
    reduction over the samples; the shift, the first sample's mean, is picked by that same
    reduction (the other samples add exact zeros), so the three come out of one kernel."""
    dt = p.dtype
    rn = te.reduce_axis((0, p.shape[0]), "n")
    inv_hw, weight, zero = (tirx.const(v, dt) for v in (1.0 / hw, float(hw), 0.0))

    def body(c):
        first = _sample_mean(p, hw, 0, c)
        e = (_sample_mean(p, hw, rn, c) - first) + s0[rn, c] * inv_hw
        within = tirx.max(s1[rn, c] - s0[rn, c] * s0[rn, c] * inv_hw, zero)
        return _SUM3((tirx.Select(rn == 0, first, zero), weight * e, within + weight * e * e),
                     axis=[rn])

    return te.compute((p.shape[1],), body, name="bn_combine")


def bn_sums(a: te.Tensor, b: te.Tensor):
    """(N, C), (N, C) -> (A, B), each (C,): the sums over the samples (axis 0), in one pass
    (the backward's gradients of beta and gamma)."""
    rn = te.reduce_axis((0, a.shape[0]), "n")

    def body(c):
        return _SUM2((a[rn, c], b[rn, c]), axis=[rn])

    return te.compute((a.shape[1],), body, name="bn_sums")


class Running(NamedTuple):
    """What the new running statistics of one training-form BatchNorm are computed from
    (:func:`running_exprs`): the graph's values of the shift ``mu`` and the shifted sums
    ``s0``, ``s1`` (C,), of the running mean and variance, and the values per channel
    (``count``, M) and momentum."""

    mu: Any
    s0: Any
    s1: Any
    running_mean: Any
    running_var: Any
    count: int
    momentum: float


def running_exprs(count: int, momentum: float, dtype: str) -> dict[str, str]:
    """The new running statistics of a BatchNorm over ``count`` values per channel (M), as
    element-wise update expressions in TVMScript (for ``thomas_tune.multi_tensor``'s
    ``update_kernel``, one element per channel): inputs ``rm``, ``rv`` (the running mean and
    variance), ``mu`` (the shift), ``s0``, ``s1`` (the batch's shifted sums, ``bn_combine``);
    outputs ``rm_new = (1 - momentum) * rm + momentum * mean`` and ``rv_new = (1 - momentum)
    * rv + momentum * var * M / (M - 1)``, with the mean and biased variance of
    :class:`_Channel` (PyTorch's rule: the unbiased variance goes into the estimate)."""
    def f(v):
        return f"T.{dtype}({float(v)!r})"

    m1 = f"(s0 * {f(1.0 / count)})"
    var = f"T.max(s1 * {f(1.0 / count)} - {m1} * {m1}, {f(0.0)})"
    return {"rm_new": f"{f(1.0 - momentum)} * rm + {f(momentum)} * (mu + {m1})",
            "rv_new": f"{f(1.0 - momentum)} * rv + {f(momentum)} * "
                      f"({var} * {f(count / max(count - 1, 1))})"}


def bn_act(x: te.Tensor, mu: te.Tensor, s0: te.Tensor, s1: te.Tensor, gamma: te.Tensor,
           beta: te.Tensor, eps: float, act: str | None) -> te.Tensor:
    """(N, C, H, W) -> (N, C, H, W): ``act(gamma * xhat + beta)`` with the batch statistics."""
    _check_act(act)
    ch = _Channel(x, mu, (s0, s1), eps)

    def body(n, c, h, w):
        xhat, _ = ch.normalized(n, c, h, w)
        return _activate(gamma[c] * xhat + beta[c], act, x.dtype)

    return te.compute(x.shape, body, name="bn_act")


def _dy(ch: _Channel, dz, gamma, beta, act, n, c, h, w):
    xhat, rstd = ch.normalized(n, c, h, w)
    return _act_grad(dz[n, c, h, w], gamma[c] * xhat + beta[c], act, ch.dt), xhat, rstd


def bn_act_reduce(dz: te.Tensor, x: te.Tensor, mu: te.Tensor, s0: te.Tensor, s1: te.Tensor,
                  gamma: te.Tensor, beta: te.Tensor, eps: float, act: str | None):
    """(sum(dy), sum(dy * xhat)) over each sample's (H, W), each (N, C); their sums over the
    samples (:func:`bn_sums`) are the gradients of beta and gamma."""
    ch = _Channel(x, mu, (s0, s1), eps)
    rh, rw = _plane_axes(x)

    def body(n, c):
        dy, xhat, _ = _dy(ch, dz, gamma, beta, act, n, c, rh, rw)
        return _SUM2((dy, dy * xhat), axis=[rh, rw])

    return te.compute((x.shape[0], x.shape[1]), body, name="bn_act_reduce")


def bn_act_dx(dz: te.Tensor, x: te.Tensor, mu: te.Tensor, s0: te.Tensor, s1: te.Tensor,
              gamma: te.Tensor, beta: te.Tensor, dbeta: te.Tensor, dgamma: te.Tensor, eps: float,
              act: str | None) -> te.Tensor:
    """(N, C, H, W): the gradient of ``x`` through the batch statistics (module docstring)."""
    ch = _Channel(x, mu, (s0, s1), eps)

    def body(n, c, h, w):
        dy, xhat, rstd = _dy(ch, dz, gamma, beta, act, n, c, h, w)
        return gamma[c] * rstd * (dy - (dbeta[c] + xhat * dgamma[c]) * ch.inv_m)

    return te.compute(x.shape, body, name="bn_act_dx")



def bn_fold(w: te.Tensor, gamma: te.Tensor, beta: te.Tensor, mean: te.Tensor, var: te.Tensor,
            eps: float):
    """A BatchNorm in inference form folded into the convolution before it (no bias):
    ``w`` (O, I/groups, kh, kw) and the BatchNorm's four (O,) tensors -> (``w * s[o]``, ``beta
    - mean * s``) with ``s = gamma / sqrt(var + eps)``, so that ``conv(x, w') + shift`` is
    ``gamma * (conv(x, w) - mean) / sqrt(var + eps) + beta``. One kernel (two outputs); with
    frozen weights and statistics, computed once per load (``thomas_tune.lift``)."""
    dt = w.dtype
    one, e = tirx.const(1.0, dt), tirx.const(eps, dt)

    def scale(o):
        return gamma[o] * (one / tirx.sqrt(var[o] + e))

    folded = te.compute(w.shape, lambda o, i, kh, kw: w[o, i, kh, kw] * scale(o),
                        name="bn_fold_weight")
    shift = te.compute(beta.shape, lambda o: beta[o] - mean[o] * scale(o), name="bn_fold_shift")
    return folded, shift
