"""The optimizers of the training step, as multi-tensor kernels.

Each keeps the function signature and state layout of ``relax.training.optimizer`` (so that
``SetupTrainer``'s optimizer slot takes it) while its update of all parameters is a few
multi-tensor kernels (:mod:`thomas_tune.training_graph.multi_tensor`), one launch per group of
parameters.
:class:`OptimizerConfig` names one (``momentum_sgd``, ``sgd``, ``adam``) with its
hyperparameters; :func:`optimizer_module` makes the module of its function and kernels that
the training graph (:mod:`thomas_tune.training_graph.graph`) adds under ``optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.training import optimizer as ropt

from . import multi_tensor as MT
from ..manifest import OPTIMIZER


def tensor_shape(p: relax.Var) -> tuple[int, ...]:
    """The static shape of Relax variable ``p`` (a tensor), as ints."""
    return tuple(int(d) for d in p.ty.shape.values)


class _MultiTensor:
    """Mixin of the optimizers whose update of all parameters is a few multi-tensor kernels
    (:mod:`thomas_tune.training_graph.multi_tensor`), with the function signature and state layout
    of ``relax.training.optimizer``: ``(params, grads, (steps int64, scalars..., buffers...)) ->
    (new params, (steps + 1, new scalars..., new buffers...))``. ``scalars``: 0-d states, each
    multiplied by its factor at every step and read by every update under its name (Adam's
    beta1^t, beta2^t); ``buffers``: the per-parameter state tensors (momentum: one per
    parameter; Adam: two; SGD: none), one run of all parameters each."""

    buffers: tuple[str, ...] = ()

    def scalars(self) -> dict[str, float]:
        return {}

    def exprs(self) -> dict[str, str]:
        raise NotImplementedError

    def get_function(self) -> relax.Function:
        self._check_init()
        plist = self.param_list
        dtype = str(plist[0].ty.dtype)
        scalars = self.scalars()
        param_var = relax.Var("params", relax.TupleType([p.ty for p in plist]))
        grad_var = relax.Var("gradients", relax.TupleType([p.ty for p in plist]))
        state_var = relax.Var("optim_states", relax.TupleType(
            [relax.TensorType((), "int64")] + [relax.TensorType((), dtype) for _ in scalars]
            + [p.ty for _ in self.buffers for p in plist]))
        n, first = len(plist), 1 + len(scalars)
        bb = relax.BlockBuilder()
        with bb.function(self.name, [param_var, grad_var, state_var]):
            with bb.dataflow():
                steps = bb.emit(relax.TupleGetItem(state_var, 0), "num_steps")
                shared = {name: bb.emit(relax.op.multiply(relax.TupleGetItem(state_var, 1 + i),
                                                          relax.const(factor, dtype)), name)
                          for i, (name, factor) in enumerate(scalars.items())}
                tensors = [[bb.emit(relax.TupleGetItem(param_var, j)),
                            bb.emit(relax.TupleGetItem(grad_var, j)),
                            *(bb.emit(relax.TupleGetItem(state_var, first + b * n + j))
                              for b in range(len(self.buffers)))] for j in range(n)]
                outs, steps_new = MT.emit_update(
                    bb, self.name + "_update", tensors, [tensor_shape(p) for p in plist],
                    ("p", "g", *self.buffers), self.exprs(), dtype, shared, counter=steps)
                # outputs: the new buffers in order, then the new parameter (exprs' order)
                params_out = bb.emit_output(relax.Tuple([o[-1] for o in outs]), "params_new")
                state_out = bb.emit_output(relax.Tuple(
                    [steps_new,
                     *shared.values(),
                     *(o[b] for b in range(len(self.buffers)) for o in outs)]),
                    "optim_states_new")
            bb.emit_func_output((params_out, state_out))
        built = bb.get()
        self.kernels = {gv: f for gv, f in built.functions.items()
                        if isinstance(f, tvm.tirx.PrimFunc)}
        return built[self.name]


class _MomentumSGD(_MultiTensor, ropt.MomentumSGD):
    """``relax.training.optimizer.MomentumSGD`` (no dampening, no Nesterov: PyTorch's SGD
    with ``momentum``) as multi-tensor kernels: the same signature, state layout ``(steps
    int64, v...)`` and arithmetic
    (:func:`thomas_tune.training_graph.multi_tensor.momentum_sgd_exprs`)."""

    buffers = ("v",)

    def exprs(self) -> dict[str, str]:
        return MT.momentum_sgd_exprs(self.lr, self.momentum, self.weight_decay,
                                     str(self.param_list[0].ty.dtype))


class _SGD(_MultiTensor, ropt.SGD):
    """``relax.training.optimizer.SGD`` as multi-tensor kernels: state ``(steps int64,)``,
    ``p -= lr * (g + weight_decay * p)``."""

    def exprs(self) -> dict[str, str]:
        return MT.sgd_exprs(self.lr, self.weight_decay, str(self.param_list[0].ty.dtype))


class _Adam(_MultiTensor, ropt.Adam):
    """``relax.training.optimizer.Adam`` as multi-tensor kernels
    (:func:`thomas_tune.training_graph.multi_tensor.adam_exprs`), with a working ``init``: the
    pinned TVM builds its scalar states with ``np.ones((), self.dtype)``, and ``self.dtype`` is a
    TVM type numpy cannot read. Same state layout: (steps int64, beta1^t, beta2^t, first
    moments..., second moments...)."""

    buffers = ("m", "v")

    def scalars(self) -> dict[str, float]:
        return {"b1t": self.beta1, "b2t": self.beta2}

    def exprs(self) -> dict[str, str]:
        return MT.adam_exprs(self.lr, self.beta1, self.beta2, self.eps, self.weight_decay,
                             str(self.param_list[0].ty.dtype))

    def init(self, params):
        params = params if isinstance(params, list) else [params]
        self._set_params_and_dtype(params)
        dtype = str(self.dtype.dtype)

        def zeros(p):
            return tvm.runtime.tensor(np.zeros([int(d) for d in p.ty.shape.values], dtype))

        self.state = (tvm.runtime.tensor(np.zeros((), "int64")),
                      tvm.runtime.tensor(np.ones((), dtype)),
                      tvm.runtime.tensor(np.ones((), dtype)),
                      *(zeros(p) for p in self.param_list),
                      *(zeros(p) for p in self.param_list))
        return self


def optimizer_module(opt: ropt.Optimizer, name: str = OPTIMIZER) -> tvm.IRModule:
    """A module of ``opt``'s function (``init`` called) under ``name``, with the kernels it
    calls (:class:`_MomentumSGD` builds its update as kernels of its own)."""
    mod = tvm.IRModule({name: opt.get_function().with_attr("global_symbol", name)})
    for gv, func in getattr(opt, "kernels", {}).items():
        mod[gv] = func
    return mod


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer of the training step: ``momentum_sgd``, ``sgd`` or ``adam``, each as
    multi-tensor kernels, one launch per group of parameters
    (:mod:`thomas_tune.training_graph.multi_tensor`).

    ``momentum_sgd``: v = momentum * v + g + weight_decay * p; p -= lr * v (PyTorch's SGD);
    ``sgd``: p -= lr * (g + weight_decay * p);
    ``adam``: Kingma & Ba 2015, Algorithm 1, with ``betas`` and ``eps``.
    """

    name: str = "momentum_sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def build(self) -> ropt.Optimizer:
        if self.name == "momentum_sgd":
            return _MomentumSGD(self.lr, self.momentum, weight_decay=self.weight_decay)
        if self.name == "sgd":
            return _SGD(self.lr, weight_decay=self.weight_decay)
        if self.name == "adam":
            return _Adam(self.lr, self.betas, self.eps, weight_decay=self.weight_decay)
        raise ValueError(f"unknown optimizer {self.name!r}; use momentum_sgd, sgd or adam")
