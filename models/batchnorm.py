"""BatchNorm in its training form as four kernels: two in the forward pass, two backward.

Written out of Relax's generic operators (mean, subtract, divide, ...), the training form of one
BatchNorm followed by its activation costs about seventeen kernel launches per step once the
gradient pass has differentiated each operator: a device that pays for every launch and every
byte (a phone's GPU) wants fewer. Here, for ``x`` of shape (N, C, H, W), float32 or float64, and
M = N * H * W values per channel:

forward
  ``bn_stats``        per channel, in one pass over ``x``: the sum of squared deviations from
                      the mean ``m2[c]``, the mean ``mean[c]`` and the count M, as one reduction
                      whose combiner is Chan, Golub & LeVeque's pairwise update (1983,
                      "Algorithms for computing the sample variance", eq. 2.1; with one value
                      at a time it is Welford's 1962 update): ``(m2, mean, n) + (m2', mean',
                      n') = (m2 + m2' + d^2 n n' / (n + n'), mean + d n' / (n + n'), n + n')``,
                      ``d = mean' - mean``;
  running statistics  PyTorch's rule (biased variance to normalise, unbiased into the running
                      estimate, ``new = (1 - m) * old + m * batch``): not a kernel per
                      BatchNorm but :func:`running_exprs`, which the training graph computes
                      for every BatchNorm of the step in a few multi-tensor kernels;
  ``bn_act``          ``z = act(gamma * xhat + beta)``, ``xhat = (x - mean) * rstd``,
                      ``rstd = 1 / sqrt(m2 / M + eps)`` (one element-wise pass);
backward
  ``bn_act_reduce``   per channel, one pass over ``x`` and ``dz``: ``sum(dy)`` and
                      ``sum(dy * xhat)`` over (N, H, W) with ``dy = dz * act'(y)``, the
                      gradients of beta and gamma;
  ``bn_act_dx``       ``dx = gamma * rstd * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M)``
                      (Ioffe & Szegedy 2015, section 3, the backward of Algorithm 1).

The statistics' combiner is registered with TVM's schedule primitives
(:func:`register_reducer`), so that a GPU schedule splits each channel's pass across a
work-group's threads (cross-thread reduction) and a CPU one into partial results (``rfactor``):
each thread's or part's values are taken one at a time, and the partial results are joined in
a tree by the same pairwise formula, so neither the mean nor the variance is a long chain of
float32 roundings and no pass over ``x`` waits for the channel's mean. The combiner's outputs
are ordered ``(m2, mean, n)`` because TVM's cross-thread lowering writes them back one by one:
each reads only the partial results of those after it, which are still unchanged when it is
written. The backward's two sums are split the same way by the same schedules.

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


def _pairwise(a, b):
    """Chan, Golub & LeVeque's pairwise join of two partial results ``(m2, mean, n)``. The same
    tree, node for node, is the combiner registered with TVM in C++ (``thomas_tune/csrc``,
    :func:`register_reducer`)."""
    n = a[2] + b[2]
    frac = b[2] / tirx.max(n, tirx.const(1.0, str(n.ty)))
    d = b[1] - a[1]
    return a[0] + b[0] + d * d * a[2] * frac, a[1] + d * frac, n


def _pairwise_identity(*dtypes):
    return tuple(tirx.const(0.0, t) for t in dtypes)


def register_reducer() -> None:
    """Register the statistics' combiner (:func:`bn_stats`, any float type) with TVM's schedule
    primitives, once per process: rfactor and cross-thread reduction apply only to reductions
    whose combiner TVM's registry knows (``s_tir.schedule.RegisterReducer``); a process that
    schedules or builds these kernels (the tuner, its build workers, ``export``) needs it
    before it does. The callbacks are C++ (``thomas_tune/csrc``, loaded with the OpenCL
    sidecar): a Python one, reached from the threads on which MetaSchedule's ``JSONDatabase``
    replays a log's records while the calling thread holds the interpreter lock, waits for that
    lock forever. ``thomas_tune``'s import calls this where the compiler and the sidecar are
    present; without the sidecar the statistics are one unsplit reduction per channel (right,
    with longer chains of roundings). Raises RuntimeError when the sidecar is not loaded."""
    import tvm_ffi
    register = tvm_ffi.get_global_func("thomas_tune.register_pairwise_reducer",
                                       allow_missing=True)
    if register is None:
        raise RuntimeError("BatchNorm's combiner is registered by thomas_tune's OpenCL sidecar, "
                           "which is not loaded (thomas_tune.opencl.load())")
    register()


_PAIRWISE = te.comm_reducer(_pairwise, _pairwise_identity, name="pairwise_variance")


class _Channel:
    """Per-channel mean and 1/sqrt(var + eps) of ``x`` from its mean and sum of squared
    deviations ``m2`` (C,)."""

    def __init__(self, x: te.Tensor, mean: te.Tensor, m2: te.Tensor, eps: float):
        self.x, self.mean, self.m2, self.eps = x, mean, m2, eps
        self.dt = x.dtype
        self.inv_m = tirx.const(1.0 / _count(x), self.dt)

    def normalized(self, n, c, h, w):
        var = self.m2[c] * self.inv_m
        rstd = tirx.const(1.0, self.dt) / tirx.sqrt(var + tirx.const(self.eps, self.dt))
        return (self.x[n, c, h, w] - self.mean[c]) * rstd, rstd


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


def _channel_axes(x: te.Tensor):
    """Reduction axes over one channel's values (N, H, W) of an (N, C, H, W) tensor."""
    n, _, h, w = x.shape
    return te.reduce_axis((0, n), "n"), te.reduce_axis((0, h), "h"), te.reduce_axis((0, w), "w")


def bn_stats(x: te.Tensor):
    """(N, C, H, W) -> (m2, mean, count), each (C,): per channel the sum of squared deviations
    from the mean, the mean and the number of values M (float), in one reduction (module
    docstring; :func:`register_reducer` before scheduling it)."""
    rn, rh, rw = _channel_axes(x)
    zero, one = tirx.const(0.0, x.dtype), tirx.const(1.0, x.dtype)
    return te.compute((x.shape[1],),
                      lambda c: _PAIRWISE((zero, x[rn, c, rh, rw], one), axis=[rn, rh, rw]),
                      name="bn_stats")


class Running(NamedTuple):
    """What the new running statistics of one training-form BatchNorm are computed from
    (:func:`running_exprs`): the graph's values of the batch's mean and sum of squared
    deviations ``m2`` (C,), of the running mean and variance, and the values per channel
    (``count``, M) and momentum."""

    mean: Any
    m2: Any
    running_mean: Any
    running_var: Any
    count: int
    momentum: float


def running_exprs(count: int, momentum: float, dtype: str) -> dict[str, str]:
    """The new running statistics of a BatchNorm over ``count`` values per channel (M), as
    element-wise update expressions in TVMScript (for ``thomas_tune.training_graph.multi_tensor``'s
    ``update_kernel``, one element per channel): inputs ``rm``, ``rv`` (the running mean and
    variance), ``mean``, ``m2`` (the batch's, :func:`bn_stats`); outputs ``rm_new = (1 -
    momentum) * rm + momentum * mean`` and ``rv_new = (1 - momentum) * rv + momentum * m2 /
    (M - 1)`` (PyTorch's rule: the unbiased variance goes into the estimate)."""
    def f(v):
        return f"T.{dtype}({float(v)!r})"

    return {"rm_new": f"{f(1.0 - momentum)} * rm + {f(momentum)} * mean",
            "rv_new": f"{f(1.0 - momentum)} * rv + {f(momentum / max(count - 1, 1))} * m2"}


def bn_act(x: te.Tensor, mean: te.Tensor, m2: te.Tensor, gamma: te.Tensor, beta: te.Tensor,
           eps: float, act: str | None) -> te.Tensor:
    """(N, C, H, W) -> (N, C, H, W): ``act(gamma * xhat + beta)`` with the batch statistics
    (:func:`bn_stats`)."""
    _check_act(act)
    ch = _Channel(x, mean, m2, eps)

    def body(n, c, h, w):
        xhat, _ = ch.normalized(n, c, h, w)
        return _activate(gamma[c] * xhat + beta[c], act, x.dtype)

    return te.compute(x.shape, body, name="bn_act")


def _dy(ch: _Channel, dz, gamma, beta, act, n, c, h, w):
    xhat, rstd = ch.normalized(n, c, h, w)
    return _act_grad(dz[n, c, h, w], gamma[c] * xhat + beta[c], act, ch.dt), xhat, rstd


def bn_act_reduce(dz: te.Tensor, x: te.Tensor, mean: te.Tensor, m2: te.Tensor,
                  gamma: te.Tensor, beta: te.Tensor, eps: float, act: str | None):
    """(dbeta, dgamma), each (C,): ``sum(dy)`` and ``sum(dy * xhat)`` over each channel's
    (N, H, W), in one pass over ``dz`` (N, C, H, W) and ``x``: the gradients of beta and
    gamma."""
    ch = _Channel(x, mean, m2, eps)
    rn, rh, rw = _channel_axes(x)

    def body(c):
        dy, xhat, _ = _dy(ch, dz, gamma, beta, act, rn, c, rh, rw)
        return _SUM2((dy, dy * xhat), axis=[rn, rh, rw])

    return te.compute((x.shape[1],), body, name="bn_act_reduce")


def bn_act_dx(dz: te.Tensor, x: te.Tensor, mean: te.Tensor, m2: te.Tensor, gamma: te.Tensor,
              beta: te.Tensor, dbeta: te.Tensor, dgamma: te.Tensor, eps: float,
              act: str | None) -> te.Tensor:
    """(N, C, H, W): the gradient of ``x`` through the batch statistics (module docstring)."""
    ch = _Channel(x, mean, m2, eps)

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
    frozen weights and statistics, computed once per load (``thomas_tune.training_graph.lift``)."""
    dt = w.dtype
    one, e = tirx.const(1.0, dt), tirx.const(eps, dt)

    def scale(o):
        return gamma[o] * (one / tirx.sqrt(var[o] + e))

    folded = te.compute(w.shape, lambda o, i, kh, kw: w[o, i, kh, kw] * scale(o),
                        name="bn_fold_weight")
    shift = te.compute(beta.shape, lambda o: beta[o] - mean[o] * scale(o), name="bn_fold_shift")
    return folded, shift
