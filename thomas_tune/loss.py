"""The training step's loss: softmax cross-entropy, averaged over the batch, in three kernels.

The generic form (``relax.training.loss.CrossEntropyLoss``: ``log_softmax`` then ``nll_loss``,
and their gradients) takes about ten kernel launches a step for what is, on a batch of logits,
a few microseconds of arithmetic; on a phone each launch costs more than that. Here:

* ``cross_entropy`` (forward, two kernels): per row ``i`` of the logits ``x`` (N, C), the
  running maximum and the sum of ``exp(x_ij - max)`` in one pass, in 16 lanes of a tuple
  reduction ("online softmax", Milakov & Gimelshein 2018, arXiv:1805.02867), joined into
  ``m_i`` and ``s_i``; then ``loss = sum_i (m_i + log s_i - x_{i,y_i}) / N``. The lanes are
  outputs too, kept for the backward.
* ``cross_entropy_grad`` (backward, one kernel): from the forward's lanes,
  ``dx_ij = dloss * (exp(x_ij - m_i) / s_i - [j = y_i]) / N`` (the gradient of the mean
  softmax cross-entropy: softmax minus the one-hot target).

Each is a TE function in one PrimFunc (its two blocks are two launches once scheduled for a
GPU); the backward is registered as the gradient of the forward's ``call_tir_with_grad``
(:data:`GRADIENT`, by :func:`register`). The same arithmetic as PyTorch's
``F.cross_entropy(x, y)`` (reduction "mean", no class weights, every target counted): targets
are class indices in ``[0, C)``; one outside it reads outside the row, so the runtime checks
labels against the model's classes before they reach the device (``Session``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.training import loss as rloss

GRADIENT = "thomas_tune.cross_entropy"  # the te_grad_name of the forward's call_tir_with_grad


LANES = 16  # partial sums per row (below)


def _combine(a, b):
    """Two (running maximum, sum of exp(x - maximum)) pairs as one."""
    m = te.max(a[0], b[0])
    return m, a[1] * te.exp(a[0] - m) + b[1] * te.exp(b[0] - m)


def _lanes(x: te.Tensor):
    """(m, s), each (N, LANES): per row ``i`` and lane ``l`` the largest of the logits
    ``x[i, k * LANES + l]`` and the sum of their ``exp(x - m)``, in one tuple reduction
    ("online softmax", Milakov & Gimelshein 2018, arXiv:1805.02867). A float32 sum of C terms
    in one chain loses about sqrt(C) roundings (1,000 classes: 2e-6 of the sum, ten times
    PyTorch's on a CPU, whose sums run in vector lanes); sixteen chains of C/16 terms, joined
    pairwise by :func:`_row`, lose about a quarter of that, whatever the schedule. (A
    compensated sum would do better, but TVM's simplifier folds its error term away.)"""
    n, c = (int(d) for d in x.shape)
    dt = x.dtype
    low, one, zero = tvm.tirx.min_value(dt), tvm.tirx.const(1, dt), tvm.tirx.const(0, dt)

    def identity(t0, t1):  # the lowest finite value, so that exp(identity - m) is 0, not NaN
        return tvm.tirx.min_value(t0), tvm.tirx.const(0, t1)

    reducer = te.comm_reducer(_combine, identity, name="logsumexp")
    k = te.reduce_axis((0, -(-c // LANES)), "k")

    def body(i, lane):
        j = k * LANES + lane
        inside = j < c
        return reducer((te.if_then_else(inside, x[i, te.min(j, c - 1)], low),
                        te.if_then_else(inside, one, zero)), axis=k)

    return te.compute((n, LANES), body, name="ce_lanes")


def _row(lanes, i):
    """(m_i, s_i): row ``i``'s largest logit and sum of ``exp(x_ij - m_i)``, its lanes joined
    pairwise (an expression of 2 x LANES loads)."""
    m, s = lanes
    parts = [(m[i, lane], s[i, lane]) for lane in range(LANES)]
    while len(parts) > 1:
        parts = [_combine(parts[j], parts[j + 1]) if j + 1 < len(parts) else parts[j]
                 for j in range(0, len(parts), 2)]
    return parts[0]


def cross_entropy(x: te.Tensor, y: te.Tensor):
    """The mean softmax cross-entropy of logits ``x`` (N, C) float against class indices ``y``
    (N,) int: (loss, m, s), the loss a 0-d tensor of ``x``'s dtype and ``m``, ``s`` (N,
    :data:`LANES`) the rows' lanes (:func:`_lanes`), which the backward reads (module
    docstring)."""
    n = int(x.shape[0])
    lanes = _lanes(x)
    j = te.reduce_axis((0, n), "j")
    inv_n = tvm.tirx.const(1.0 / n, x.dtype)

    def term(r):
        m, s = _row(lanes, r)
        return (m + te.log(s) - x[r, y[r]]) * inv_n

    return te.compute((), lambda: te.sum(term(j), axis=j), name="ce_loss"), lanes[0], lanes[1]


def cross_entropy_grad(dloss: te.Tensor, x: te.Tensor, y: te.Tensor, m: te.Tensor,
                       s: te.Tensor) -> te.Tensor:
    """The gradient of :func:`cross_entropy` with respect to ``x`` (N, C), for the loss's
    gradient ``dloss`` (0-d), from the forward's lanes ``m``, ``s``: ``dloss * (softmax(x) -
    onehot(y)) / N``, one element-wise kernel."""
    n, c = (int(d) for d in x.shape)
    dt = x.dtype
    inv_n = tvm.tirx.const(1.0 / n, dt)

    def body(i, j):
        mi, si = _row((m, s), i)
        hit = tvm.tirx.Select(y[i] == j.astype(y.dtype), tvm.tirx.const(1, dt),
                              tvm.tirx.const(0, dt))
        return dloss[()] * (te.exp(x[i, j] - mi) / si - hit) * inv_n

    return te.compute((n, c), body, name="ce_dx")


def _gradient(orig_var, call, output_grad, ctx):
    """The registered backward of the forward's ``call_tir_with_grad`` (arguments logits and
    targets; outputs the loss and the rows' lanes): the logits' gradient from the lanes, and
    zeros for the integer targets (no gradient)."""
    x, y = call.args[1].fields
    dloss = ctx.emit(relax.TupleGetItem(output_grad, 0))
    m, s = (ctx.emit(relax.TupleGetItem(orig_var, i)) for i in (1, 2))
    dx = ctx.emit_te(cross_entropy_grad, dloss, x, y, m, s,
                     primfunc_name_hint="cross_entropy_grad")
    n = int(y.ty.shape.values[0])
    return ctx.emit(relax.Tuple([dx, relax.const(np.zeros((n,), str(y.ty.dtype)))]))


def register() -> None:
    """Register :func:`_gradient` under :data:`GRADIENT`; safe to call twice."""
    handler = "tvm.relax.te_grad._register." + GRADIENT
    if tvm.get_global_func(handler, allow_missing=True) is None:
        tvm.register_global_func(handler, _gradient)


class CrossEntropyLoss(rloss.Loss):
    """The mean softmax cross-entropy as a ``relax.training`` loss (for ``SetupTrainer``):
    ``(predictions (N, C) float, targets (N,) int64) -> loss ()``, one ``call_tir_with_grad``
    of :func:`cross_entropy`. Its kernel must be in the module the loss is appended to:
    :meth:`add_kernel` puts it there."""

    def __init__(self, predictions: relax.TensorType, targets: relax.TensorType):
        super().__init__("cross_entropy_loss", 1, "mean")
        register()
        self.predictions, self.targets = predictions, targets
        x = te.placeholder([int(d) for d in predictions.shape.values], str(predictions.dtype),
                           "x")
        y = te.placeholder([int(d) for d in targets.shape.values], str(targets.dtype), "y")
        self.kernel = te.create_prim_func([x, y, *cross_entropy(x, y)]).with_attr(
            "global_symbol", "cross_entropy")
        self.gv = relax.BlockBuilder().add_func(self.kernel, "cross_entropy")  # typed

    def add_kernel(self, mod: tvm.IRModule) -> tvm.IRModule:
        """``mod`` with the forward kernel under this loss's GlobalVar."""
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out[self.gv] = self.kernel
        return out

    def __call__(self, predictions=None, targets=None, weights=None) -> relax.Function:
        """The loss function ``cross_entropy_loss(predictions, targets) -> ()``, of the types
        given at construction (``SetupTrainer`` passes the same ones). Raises ValueError for
        class ``weights``, which this loss does not take."""
        if weights is not None:
            raise ValueError("CrossEntropyLoss: class weights are not supported")
        p = relax.Var("predictions", self.predictions)
        t = relax.Var("targets", self.targets)
        bb = relax.BlockBuilder()
        with bb.function(self._loss_name, [p, t]):
            with bb.dataflow():
                dt = str(self.predictions.dtype)
                n = int(self.predictions.shape.values[0])
                lanes = relax.TensorType((n, LANES), dt)
                out = bb.emit(relax.call_tir_with_grad(
                    self.gv, relax.Tuple([p, t]), [relax.TensorType((), dt), lanes, lanes],
                    te_grad_name=GRADIENT))
                loss = bb.emit_output(relax.TupleGetItem(out, 0))
            bb.emit_func_output(loss)
        return bb.get()[self._loss_name]
