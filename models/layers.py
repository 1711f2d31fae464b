"""Graph builder shared by the model definitions.

A model's ``forward(g, x)`` calls the methods of :class:`Graph`; each call emits Relax operators
into a :class:`tvm.relax.BlockBuilder` and creates the named parameters and states it needs the
first time it sees a name. The same ``forward`` is run once per mode:

* ``"infer"``: BatchNorm uses its running statistics, dropout is the identity;
* ``"train"``: BatchNorm normalises with the batch statistics and returns updated running
  statistics (PyTorch semantics: biased variance to normalise, unbiased variance into the running
  estimate, ``new = (1 - momentum) * old + momentum * batch``), dropout multiplies by a mask that
  the caller feeds as an input (``1 / (1 - p)`` where kept, 0 where dropped).

Every tensor is NCHW float32. Parameters belong to a *block* (a layer of the network as a user
counts layers when saying "fine-tune the last k layers"); the order of blocks is the order of
the forward pass.

In a process whose TVM loaded only its runtime library (``TVM_USE_RUNTIME_LIB=1``: running an
export, no compiling) there is no ``tvm.relax``: this module then imports without it, and
:class:`Graph` raises RuntimeError; ``models.spec`` traces shapes only there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import tvm


def compiler_available() -> bool:
    """True when this process's TVM has its compiler (``tvm.relax``); False when it loaded only
    the runtime library (``TVM_USE_RUNTIME_LIB=1`` set before ``import tvm``, or a runtime-only
    build of TVM)."""
    return not getattr(tvm.base, "_RUNTIME_ONLY", not hasattr(tvm, "relax"))


def require_compiler(what: str) -> None:
    """Raise RuntimeError saying that ``what`` needs TVM's compiler, in a process whose TVM
    loaded only its runtime library (see :func:`compiler_available`)."""
    if not compiler_available():
        raise RuntimeError(f"{what} needs TVM's compiler (tvm.relax), and this process loaded "
                           "only TVM's runtime library (TVM_USE_RUNTIME_LIB=1 was set before "
                           "TVM was imported): run it without TVM_USE_RUNTIME_LIB")


if compiler_available():
    from tvm import relax
    from tvm.relax import op as R

DTYPE = "float32"


@dataclass(frozen=True)
class ParamSpec:
    """A named tensor of the model: a parameter (trainable or frozen) or a state.

    ``init`` names the initialiser: ``kaiming_out`` (conv weights, He et al. 2015, fan-out mode
    as torchvision uses for MobileNet), ``linear`` (normal with std 0.01), ``ones``, ``zeros``.
    """

    name: str
    shape: tuple[int, ...]
    block: str
    init: str


def shape_of(x: relax.Expr) -> tuple[int, ...]:
    """Static shape of a Relax tensor expression as a tuple of ints."""
    return tuple(int(v) for v in x.ty.shape.values)


class Records:
    """What a forward pass records, whatever it emits: parameters, states and dropout masks by
    name (each with its value in the emitting graph), and the blocks in order of first use."""

    def __init__(self, mode: str, dtype: str = DTYPE):
        if mode not in ("train", "infer"):
            raise ValueError(f"Graph mode must be 'train' or 'infer', got {mode!r}")
        self.dtype = dtype
        self.training = mode == "train"
        self.params: dict[str, tuple] = {}
        self.states: dict[str, tuple] = {}
        self.masks: dict[str, tuple] = {}
        self.blocks: list[str] = []
        self._block = "stem"

    @contextlib.contextmanager
    def block(self, name: str):
        """Parameters created inside belong to block ``name``."""
        prev, self._block = self._block, name
        if name not in self.blocks:
            self.blocks.append(name)
        try:
            yield
        finally:
            self._block = prev

    def _var(self, table, name, shape, init):
        """The value of parameter or state ``name`` (recorded in ``table`` at first use, in the
        current block; later uses get the same value)."""
        if name in table:
            return table[name][1]
        if self._block not in self.blocks:
            self.blocks.append(self._block)
        shape = tuple(int(d) for d in shape)
        value = self._value(name, shape)
        table[name] = (ParamSpec(name, shape, self._block, init), value)
        return value

    def _value(self, name: str, shape: tuple[int, ...]):
        """What a new parameter or state is in the emitting graph."""
        raise NotImplementedError

    def param(self, name, shape, init):
        return self._var(self.params, name, shape, init)

    def state(self, name, shape, init):
        return self._var(self.states, name, shape, init)


class Graph(Records):
    """Emits one forward pass (see the module docstring) into ``bb`` and records what it needs
    (:class:`Records`: values are Relax variables)."""

    def __init__(self, bb: relax.BlockBuilder, mode: str, dtype: str = DTYPE):
        require_compiler("building a Relax graph")
        super().__init__(mode, dtype)
        self.bb = bb
        self.new_states: dict[str, relax.Expr] = {}
        # training-form BatchNorms whose new running statistics are still to be computed (by
        # the training graph, for all of them at once): name -> models.batchnorm.Running
        self.running: dict[str, tuple] = {}
        # convolutions without bias: (output, input, name, stride, padding, groups), for the
        # inference-form BatchNorm that may follow (folded into it)
        self._convs: list[tuple] = []

    # ---- bookkeeping -------------------------------------------------------------------------
    def _value(self, name, shape):
        return relax.Var(name, relax.TensorType(shape, self.dtype))

    def emit(self, expr):
        return self.bb.emit(expr)

    # ---- layers ------------------------------------------------------------------------------
    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        """2-D convolution, weight ``name.weight`` of shape (O, I/groups, k, k)."""
        in_channels = shape_of(x)[1]
        w = self.param(f"{name}.weight", (out_channels, in_channels // groups, kernel, kernel),
                       "kaiming_out")
        y = self.emit(R.nn.conv2d(x, w, strides=stride, padding=padding, groups=groups))
        if bias:
            b = self.param(f"{name}.bias", (out_channels,), "zeros")
            y = self.emit(R.add(y, R.reshape(b, (1, out_channels, 1, 1))))
        else:
            self._convs.append((y, x, name, stride, padding, groups))
        return y

    def may_fold(self, conv_name: str) -> bool:
        """Whether an inference-form BatchNorm after convolution ``conv_name`` is folded into
        it (:meth:`batch_norm`): always here; a training graph says no for a trainable
        convolution."""
        return True

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        """BatchNorm2d over axis 1 (Ioffe & Szegedy 2015) with PyTorch's running-stat rule,
        followed by ``act`` (None, ``"relu"`` or ``"relu6"``).

        In training mode the statistics, the normalisation and its activation are the kernels
        of :mod:`models.batchnorm` (two-level sums, the backward in three kernels). In
        inference mode the running statistics are used: after a convolution without bias
        (:meth:`may_fold`) the BatchNorm is folded into it (:func:`models.batchnorm.bn_fold`:
        the convolution again with the folded weight, plus a shift, then ``act``; the first
        one is left unused), else element-wise operators that fuse into what comes before."""
        n, c, h, w = shape_of(x)
        gamma = self.param(f"{name}.weight", (c,), "ones")
        beta = self.param(f"{name}.bias", (c,), "zeros")
        mean = self.state(f"{name}.running_mean", (c,), "zeros")
        var = self.state(f"{name}.running_var", (c,), "ones")
        if self.training:
            return self._batch_norm_train(name, x, gamma, beta, mean, var, eps, momentum, act)
        conv = next((cv for cv in self._convs if cv[0].same_as(x)), None)
        if conv is not None and self.may_fold(conv[2]):
            return self._folded(conv, gamma, beta, mean, var, eps, act)
        shape4 = (1, c, 1, 1)
        centred = R.subtract(x, R.reshape(mean, shape4))
        inv = R.divide(relax.const(1.0, self.dtype),
                       R.sqrt(R.add(R.reshape(var, shape4), relax.const(eps, self.dtype))))
        scale = self.emit(R.multiply(R.reshape(gamma, shape4), inv))
        return self._activate(self.emit(R.add(R.multiply(centred, scale),
                                              R.reshape(beta, shape4))), act)

    def _folded(self, conv, gamma, beta, mean, var, eps, act):
        from . import batchnorm as B
        _, x, conv_name, stride, padding, groups = conv
        w = self.params[f"{conv_name}.weight"][1]
        c = int(w.ty.shape.values[0])
        fold = self.emit(self.bb.call_te(B.bn_fold, w, gamma, beta, mean, var, float(eps),
                                         primfunc_name_hint="bn_fold"))
        # no gradient flows into the fold (a frozen or an inference-only convolution)
        folded, shift = (self.emit(R.grad.no_grad(self.emit(relax.TupleGetItem(fold, i))))
                         for i in range(2))
        y = self.emit(R.nn.conv2d(x, folded, strides=stride, padding=padding, groups=groups))
        return self._activate(self.emit(R.add(y, R.reshape(shift, (1, c, 1, 1)))), act)

    def _batch_norm_train(self, name, x, gamma, beta, mean, var, eps, momentum, act):
        """The training form (:mod:`models.batchnorm`): the statistics and ``act(normalised)``,
        whose gradient is registered under :data:`models.batchnorm.GRADIENT` (by
        ``thomas_tune.training_graph.gradients``); what the new running statistics need is kept in
        :attr:`running` (the training graph computes them all together,
        :func:`models.batchnorm.running_exprs`)."""
        from . import batchnorm as B

        bb = self.bb
        n, _, h, w = shape_of(x)
        stats = bb.emit_te(B.bn_stats, x, primfunc_name_hint="bn_stats")
        m2, mean_b = (self.emit(R.grad.no_grad(self.emit(relax.TupleGetItem(stats, i))))
                      for i in range(2))
        self.running[name] = B.Running(mean_b, m2, mean, var, n * h * w, momentum)
        # the statistics' own gradient is part of the one registered for bn_act (no_grad above)
        return self.emit(bb.call_te_with_grad(
            B.bn_act, x, mean_b, m2, gamma, beta, eps, act, primfunc_name_hint="bn_act",
            te_grad_name=B.GRADIENT, te_grad_kwargs={"eps": float(eps), "act": act or ""}))

    def _activate(self, x, act):
        if act is None:
            return x
        if act == "relu":
            return self.relu(x)
        if act == "relu6":
            return self.relu6(x)
        raise ValueError(f"BatchNorm activation {act!r}: use None, 'relu' or 'relu6'")

    def relu(self, x):
        return self.emit(R.nn.relu(x))

    def relu6(self, x):
        """min(max(x, 0), 6), as ``relax.clip`` (its gradient is registered by thomas_tune)."""
        return self.emit(R.clip(x, 0.0, 6.0))

    def max_pool2d(self, x, kernel, stride, padding=0):
        return self.emit(R.nn.max_pool2d(x, kernel, stride, padding))

    def adaptive_avg_pool2d(self, x, output_size):
        """Average pooling to ``output_size`` (an int or a pair); where the input already has
        that size (AlexNet at 224 px: 6x6 to 6x6) each window is one value and the pooling is
        the identity, so it is left out (no kernel launch)."""
        size = tuple(output_size) if isinstance(output_size, (tuple, list)) else \
            (output_size, output_size)
        if tuple(int(d) for d in x.ty.shape.values[2:]) == size:
            return x
        return self.emit(R.nn.adaptive_avg_pool2d(x, output_size))

    def flatten(self, x):
        """(N, C, H, W) -> (N, C*H*W), as torch.flatten(x, 1); ``relax.flatten`` flattens all."""
        n, *rest = shape_of(x)
        return self.emit(R.reshape(x, (n, int(np.prod(rest)))))

    def residual(self, a, b):
        return self.emit(R.add(a, b))

    def linear(self, name, x, out_features):
        """y = x W^T + b with W of shape (out, in), as torch.nn.Linear."""
        in_features = shape_of(x)[1]
        w = self.param(f"{name}.weight", (out_features, in_features), "linear")
        b = self.param(f"{name}.bias", (out_features,), "zeros")
        return self.emit(R.add(R.matmul(x, R.permute_dims(w)), b))

    def dropout(self, name, x, p):
        """Inverted dropout: in training ``x * mask`` with the mask an input of the graph."""
        if not self.training or p == 0.0:
            return x
        mask = relax.Var(f"{name}.mask", relax.TensorType(shape_of(x), self.dtype))
        self.masks[f"{name}.mask"] = (shape_of(x), p, mask)
        return self.emit(R.multiply(x, mask))
