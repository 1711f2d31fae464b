"""Mutants of the training step's backward pass and of its optimizer update, for proving the
step checks.

Each mutant is a context manager under which a build (``export``, ``replay``, the tuner's
candidate builds) makes one kind of gradient wrong: a gradient function of a Relax operator
(``FPrimalGradient``) or of the project's fused kernels (BatchNorm with its activation, the
loss) is wrapped, and its result multiplied by a factor (1.01: 1% too large; -1: the wrong
sign), everywhere or only on some data (one label, one sample of the batch, values above a
threshold). The right gradient is registered again on exit. A mutant changes what the build
computes, its kernels and all: the check sees only the export's outputs.

Which call of a gradient function is mutated: the first (``which=0``), i.e. the network's last
layer of that kind (the backward pass meets it first), so the error flows into every
trainable layer before it; ``which=None``: every call.

The update's mutants (:data:`UPDATE_MUTANTS`, :func:`optimizer_update`) change the expressions
of the optimizer's multi-tensor kernels (:mod:`thomas_tune.training_graph.multi_tensor`) the build
compiles.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.relax.op.base import register_gradient

from thomas_tune.training_graph import gradients, loss as L
from thomas_tune.models import batchnorm as B

_LEVEL = itertools.count(100)  # each registration above the last one


def _const(v, dt="float32"):
    return relax.const(v, dt)


@contextlib.contextmanager
def op_gradient(op_name: str, transform, which: int | None = 0, select=None):
    """``op_name``'s registered gradient with ``transform(parts, call, ctx)`` (-> new parts)
    applied to its ``which``-th call among those ``select(call)`` accepts."""
    op = tvm.ir.Op.get(op_name)
    original = op.get_attr("FPrimalGradient")
    calls = itertools.count()

    def grad(orig_var, call, output_grad, ctx):
        parts = list(original(orig_var, call, output_grad, ctx))
        if select is not None and not select(call):
            return parts
        if which is not None and next(calls) != which:
            return parts
        return transform(parts, call, ctx)

    register_gradient(op_name, grad, level=next(_LEVEL))
    try:
        yield
    finally:
        register_gradient(op_name, original, level=next(_LEVEL))


@contextlib.contextmanager
def te_gradient(te_name: str, original, transform, which: int | None = 0):
    """The same for a fused kernel's gradient registered under ``te_name`` (a tuple of
    parts)."""
    handler = "tvm.relax.te_grad._register." + te_name
    calls = itertools.count()

    def grad(orig_var, call, output_grad, ctx):
        out = original(orig_var, call, output_grad, ctx)
        if which is not None and next(calls) != which:
            return out
        n = len(out.ty.fields)
        parts = [ctx.emit(relax.TupleGetItem(out, i)) for i in range(n)]
        return ctx.emit(relax.Tuple(transform(parts, call, ctx)))

    tvm.register_global_func(handler, grad, override=True)
    try:
        yield
    finally:
        tvm.register_global_func(handler, original, override=True)


def _bound(ctx, expr):
    """``expr`` bound to a variable in ``ctx`` (so that its type is known)."""
    return expr if isinstance(expr, relax.Var) else ctx.emit(expr)


def scaled(i: int, factor: float):
    """A transform multiplying part ``i`` by ``factor``."""
    def t(parts, call, ctx):
        v = _bound(ctx, parts[i])
        parts[i] = ctx.emit(R.multiply(v, _const(factor, str(v.ty.dtype))))
        return parts
    return t


def _is_depthwise(call):
    return gradients.is_depthwise(call)


def _is_dropout(call):
    b = call.args[1]
    return isinstance(b, relax.Var) and str(b.name).endswith(".mask")


def _is_bias_add(call):
    b = call.args[1]
    shape = [int(v) for v in b.ty.shape.values] if hasattr(b.ty, "shape") else []
    return len(shape) in (1, 4) and int(np.prod(shape)) == max(shape or [0])


@contextlib.contextmanager
def act_derivative(kind: str):
    """The BatchNorm's ReLU6 derivative without its lower (``kind`` "below0": the gradient
    passes where y <= 0) or upper clip ("above6": it passes where y >= 6), in every
    BatchNorm."""
    original = B._act_grad

    def wrong(dz, y, act, dt):
        if act != "relu6":
            return original(dz, y, act, dt)
        from tvm import tirx
        zero = tirx.const(0.0, dt)
        keep = y < tirx.const(6.0, dt) if kind == "below0" else y > zero
        return tirx.Select(keep, dz, zero)

    B._act_grad = wrong
    try:
        yield
    finally:
        B._act_grad = original


def _loss_rows(factor_of_row):
    """A loss-gradient transform multiplying row i of dlogits by ``factor_of_row(y)`` (a
    Relax expression of the labels ``y``, shape (N,), giving the factor per row)."""
    def t(parts, call, ctx):
        _, y = call.args[1].fields
        f = ctx.emit(R.expand_dims(factor_of_row(y), 1))
        parts[0] = ctx.emit(R.multiply(parts[0], f))
        return parts
    return t


def _one_label(label: int, factor: float):
    return _loss_rows(lambda y: R.where(R.equal(y, relax.const(label, "int64")),
                                        _const(factor), _const(1.0)))


def _one_sample(parts, call, ctx):
    """The data gradient of the first sample of the batch 1% too large."""
    dx = _bound(ctx, parts[0])
    n = int(dx.ty.shape.values[0])
    f = np.ones((n,) + (1,) * (len(dx.ty.shape.values) - 1), "float32")
    f[0] = 1.01
    parts[0] = ctx.emit(R.multiply(dx, relax.const(f)))
    return parts


def _above(threshold: float, factor: float):
    """The BatchNorm's input gradient ``factor`` times too large where its input is above
    ``threshold``."""
    def t(parts, call, ctx):
        x = call.args[1].fields[0]
        parts[0] = ctx.emit(R.where(R.greater(x, _const(threshold)),
                                    R.multiply(parts[0], _const(factor)), parts[0]))
        return parts
    return t


def _bn(transform, which=0):
    return te_gradient(B.GRADIENT, gradients._bn_act_grad, transform, which)


def _loss(transform):
    return te_gradient(L.GRADIENT, L._gradient, transform, None)


def _conv(part, factor, depthwise):
    return op_gradient("relax.nn.conv2d", scaled(part, factor),
                       select=lambda c: _is_depthwise(c) == depthwise)


#: name -> (what it breaks, a function of the factor giving the context manager); the data
#: gradients of each kind of layer (parameters' own gradients: see ``param_mutant``)
DATA_MUTANTS = {
    "conv data": lambda f: _conv(0, f, False),
    "conv weight": lambda f: _conv(1, f, False),
    "depthwise data": lambda f: _conv(0, f, True),
    "depthwise weight": lambda f: _conv(1, f, True),
    "BatchNorm input": lambda f: _bn(scaled(0, f)),
    "BatchNorm weight": lambda f: _bn(scaled(3, f)),
    "BatchNorm bias": lambda f: _bn(scaled(4, f)),
    "ReLU": lambda f: op_gradient("relax.nn.relu", scaled(0, f)),
    "max pool": lambda f: op_gradient("relax.nn.max_pool2d", scaled(0, f)),
    "linear data": lambda f: op_gradient("relax.matmul", scaled(0, f)),
    "linear weight": lambda f: op_gradient("relax.matmul", scaled(1, f)),
    "bias (conv, linear)": lambda f: op_gradient("relax.add", scaled(1, f),
                                                 select=_is_bias_add),
    "loss": lambda f: _loss(scaled(0, f)),
    "dropout": lambda f: op_gradient("relax.multiply", scaled(0, f), select=_is_dropout),
}
#: mutants wrong on some data only
DEPENDENT_MUTANTS = {
    "ReLU6 below 0 (no lower clip)": lambda: act_derivative("below0"),
    "ReLU6 above 6 (no upper clip)": lambda: act_derivative("above6"),
    "loss, last class x1.1": lambda: _loss(_one_label(4, 1.1)),
    "conv data, sample 0 x1.01": lambda: op_gradient("relax.nn.conv2d", _one_sample),
    "BatchNorm input above 1 x1.01": lambda: _bn(_above(1.0, 1.01)),
}
#: the network each kind needs: MobileNetV2 has no ReLU, max pool or conv bias; AlexNet no
#: depthwise convolution or BatchNorm
NEEDS_ALEXNET = {"ReLU", "max pool", "bias (conv, linear)", "conv data, sample 0 x1.01"}
NEEDS_MOBILENET = {"depthwise data", "depthwise weight", "BatchNorm input", "BatchNorm weight",
                   "BatchNorm bias", "ReLU6 below 0 (no lower clip)",
                   "ReLU6 above 6 (no upper clip)", "BatchNorm input above 1 x1.01"}


def param_mutant(grads: dict[str, np.ndarray], name: str, factor: float) -> dict:
    """A build's gradients (name -> array) with parameter ``name``'s multiplied by
    ``factor``: what a reduction kernel writing that gradient 1% too large or with the wrong
    sign returns (the cheap form of the parameter mutants; no build)."""
    out = dict(grads)
    out[name] = grads[name] * factor
    return out


@contextlib.contextmanager
def forward_conv(factor: float, layer: str):
    """The forward pass built wrong: convolution ``layer`` (its name, e.g. ``features.0.0``)
    computes the first image of the batch ``factor`` times too large (its input scaled on that
    image; a kernel reading one image wrong), in every graph built under it. The gradients
    are those of that wrong forward (built from it), so only the forward's values and what
    follows from them are off: a training-form BatchNorm after it does not undo it (its
    statistics are the batch's), so the stored tensors, the loss and the gradients move."""
    from thomas_tune.models.layers import Graph, shape_of
    original = Graph.conv2d

    def wrong(self, name, x, *args, **kwargs):
        if name == layer:
            n = shape_of(x)[0]
            s = np.ones((n, 1, 1, 1), "float32")
            s[0] = factor
            x = self.emit(R.multiply(x, relax.const(s)))
        return original(self, name, x, *args, **kwargs)

    Graph.conv2d = wrong
    try:
        yield
    finally:
        Graph.conv2d = original


#: the forward pass built wrong (its gradients those of the wrong forward)
FORWARD_MUTANTS = {
    "first conv forward, image 0 x1.01": lambda layer: forward_conv(1.01, layer),
}


@contextlib.contextmanager
def optimizer_update(output: str, factor: float, optimizer: str = "momentum_sgd"):
    """``optimizer``'s update kernels (:mod:`thomas_tune.training_graph.multi_tensor`) built wrong:
    ``output`` ``p_new`` with its step ``p_new - p`` times ``factor`` (1.01: the learning rate 1%
    too large; -1: the update's sign wrong), or a state output (``v_new``: momentum SGD's new
    momentum buffer, Adam's second moment; ``m_new``: Adam's first moment) times
    ``factor``; the expressions after it read the wrong value."""
    from thomas_tune.training_graph import multi_tensor as MT
    attr = f"{optimizer}_exprs"
    original = getattr(MT, attr)

    def wrong(*args, **kwargs):
        exprs = dict(original(*args, **kwargs))
        if output == "p_new":
            exprs[output] = f"p + T.float32({factor!r}) * (({exprs[output]}) - p)"
        else:
            exprs[output] = f"T.float32({factor!r}) * ({exprs[output]})"
        return exprs

    setattr(MT, attr, wrong)
    try:
        yield
    finally:
        setattr(MT, attr, original)


#: the momentum SGD update built wrong (what the optimizer's kernels compute; the gradients
#: are right)
UPDATE_MUTANTS = {
    "momentum update x1.01 (learning rate)": lambda: optimizer_update("p_new", 1.01),
    "momentum update wrong sign": lambda: optimizer_update("p_new", -1.0),
    "momentum buffer x1.01": lambda: optimizer_update("v_new", 1.01),
    "momentum buffer wrong sign": lambda: optimizer_update("v_new", -1.0),
}
