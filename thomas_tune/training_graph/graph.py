"""Training graph: model -> Relax module with ``predict``, ``train_adjoint`` and ``optimizer``.

``train_adjoint`` is built by ``relax.training.SetupTrainer`` (loss appended, ``Gradient`` pass)
from a backbone whose arguments are ordered

    x, dropout masks..., frozen parameters..., trainable parameters..., states...

so that frozen parameters are ordinary inputs: they get no gradient and no update, and the
backward pass stops where no trainable parameter needs it (the "fine-tune the last k layers"
case pays only for the backward of those layers). It returns ``((loss, new_states...),
(grads...))``. ``optimizer(params, grads, optim_state)`` returns ``(new_params, new_state)``.
``predict(x, params..., states...)`` is the inference graph (BatchNorm on running statistics).

With ``features=True`` (``--cache-features``, ``last:K`` only) the module also holds the step
split at the one tensor the last K layers read from the frozen part: ``features(x, frozen
params..., frozen states...)``, the frozen part alone, and ``train_head_adjoint(features,
masks..., trainable params..., head states..., targets)``, the step of the last K layers on it
(:class:`FeatureSplit`). Each is traced from the model's own forward pass, the other part's
operators emitted only for their shapes (:class:`_PartGraph`), so the two compose to the
full step, operator for operator. Only a frozen part that computes the same function at every
step can be cut so (:func:`check_cache_features`).

BatchNorm in the training step takes one of three modes
(:data:`thomas_tune.trainable.BATCHNORM_MODES`):

* ``frozen-part`` (the default): the BatchNorms of frozen layers in the inference form (below),
  those of trainable layers in the training form. A frozen layer then computes what it computes
  at inference, conv + BatchNorm + activation in one kernel, and keeps nothing for a backward
  that never runs: fine-tuning the last layers pays for little more than their own work. With
  ``all`` it is ``train``.
* ``train``: every BatchNorm normalised with the batch statistics, running statistics updated
  (Ioffe & Szegedy 2015, Algorithm 1; PyTorch's ``BatchNorm2d`` in ``train()`` mode), frozen
  layers included: their statistics adapt to the new data. A ``,train-bn`` suffix of the
  trainable set (``last:2,train-bn``).
* ``frozen``: every BatchNorm in the inference form, ``gamma * (x - running_mean) /
  sqrt(running_var + eps) + beta``, running statistics used and returned unchanged (PyTorch's
  ``BatchNorm2d`` in ``eval()`` mode while the rest of the network trains). ``gamma`` and
  ``beta`` stay trainable when their layer is. A ``,frozen-bn`` suffix (``all,frozen-bn``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.training import SetupTrainer

from . import gradients  # noqa: F401  (registers the missing gradients)
from . import multi_tensor as MT
from .lift import ATTR as LIFT
from .loss import CrossEntropyLoss, batch_sums
from ..manifest import (ADJOINT, FEATURES, HEAD_ADJOINT, OPTIMIZER,  # the exported functions'
                       PREDICT, TRAIN_STEP)  # names
from ..models import ShapeGraph, spec, trace
from ..models.layers import Graph
from .optimizers import OptimizerConfig, tensor_shape
from ..trainable import TRAIN_BN, frozen_batchnorms, parse_trainable, select_trainable

def _emit_running_statistics(bb: relax.BlockBuilder, g: Graph, states: list[str]) -> None:
    """Put the new running statistics of the training-form BatchNorms among ``states`` into
    ``g.new_states``: multi-tensor kernels
    (:func:`thomas_tune.training_graph.multi_tensor.emit_update`, not in place), one per group of
    BatchNorms with the same values per channel and momentum, instead of a kernel each
    (:func:`models.batchnorm.running_exprs`)."""
    from ..models.batchnorm import running_exprs
    names = [n for n in dict.fromkeys(s.rsplit(".", 1)[0] for s in states)
             if n in g.running and f"{n}.running_mean" not in g.new_states]
    groups: dict[tuple, list[str]] = {}
    for n in names:
        groups.setdefault((g.running[n].count, g.running[n].momentum), []).append(n)
    for (count, momentum), members in groups.items():
        tensors = [[r.running_mean, r.running_var, r.mean, r.m2]
                   for r in (g.running[n] for n in members)]
        dtype = str(tensors[0][0].ty.dtype)
        outs, _ = MT.emit_update(bb, "bn_running", tensors, [tensor_shape(t[0]) for t in tensors],
                                 ("rm", "rv", "mean", "m2"),
                                 running_exprs(count, momentum, dtype), dtype, inplace=False)
        for n, (rm, rv) in zip(members, outs):
            g.new_states[f"{n}.running_mean"], g.new_states[f"{n}.running_var"] = rm, rv


class FrozenBatchNormGraph(Graph):
    """A training-mode :class:`models.layers.Graph` whose BatchNorms named in ``frozen`` are
    in inference form: running statistics used, not updated (each new running statistic is the
    old one), dropout still in its training form (masks). See the module docstring."""

    def __init__(self, bb, mode, dtype, frozen: set[str], trainable=frozenset()):
        super().__init__(bb, mode, dtype)
        self.frozen = frozen
        self.trainable = set(trainable)

    def may_fold(self, conv_name: str) -> bool:
        """A frozen BatchNorm is folded into the convolution before it when that one is frozen
        too (a trainable one's weight gradient reads its own output)."""
        return f"{conv_name}.weight" not in self.trainable

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        if name not in self.frozen:
            return super().batch_norm(name, x, eps, momentum, act)
        self.training = False
        try:
            y = super().batch_norm(name, x, eps, momentum, act)
        finally:
            self.training = True
        for k in ("running_mean", "running_var"):
            self.new_states[f"{name}.{k}"] = self.states[f"{name}.{k}"][1]
        return y


def _trace_training(model, batch: int, dtype: str, frozen: set[str], trainable: set[str]):
    """``models.trace(model, batch, "train", dtype)``, with :class:`FrozenBatchNormGraph` when
    some BatchNorms (``frozen``) are in inference form (``trainable``: the trainable
    parameters' names)."""
    if not frozen:
        return trace(model, batch, "train", dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(model.input_shape(batch), dtype))
    return bb, FrozenBatchNormGraph(bb, "train", dtype, frozen, trainable), x


class _PartGraph(FrozenBatchNormGraph):
    """One part of the training step's forward pass (:class:`FrozenBatchNormGraph`, training
    mode): the frozen part (``part="features"``: images -> the one tensor the trainable layers
    read) or the trainable part (``"head"``: that tensor -> logits). ``head_blocks``: the
    blocks of the trainable part. The other part's operators go to a scratch builder, for their
    shapes only; in the head, each value of the frozen part is a stand-in variable, and the one
    the head reads becomes its input (:meth:`cut`). :func:`check_cache_features` first."""

    def __init__(self, bb, dtype, frozen: set[str], blocks: list[str], k: int, part: str, x,
                 trainable=frozenset()):
        super().__init__(bb, "train", dtype, frozen, trainable)
        self.all_blocks, self.head_blocks, self.part = list(blocks), set(blocks[-k:]), part
        self.scratch = relax.BlockBuilder()
        self.scratch._begin_binding_block()  # a block to emit into, never closed into a function
        self.frozen_values = [x]  # the frozen part's values (the images too)
        self.read: list[relax.Var] = []  # the values of the frozen part the head reads

    def _in_head(self) -> bool:
        return self._block in self.head_blocks

    def emit(self, expr):
        if self._in_head():
            for v in relax.analysis.free_vars(expr):
                if any(v.same_as(f) for f in self.frozen_values) and not any(
                        v.same_as(r) for r in self.read):
                    self.read.append(v)
            return (self.bb if self.part == "head" else self.scratch).emit(expr)
        if self.part == "features":
            value = self.bb.emit(expr)
        else:  # a stand-in: the head's input where the head reads it, else unused
            value = relax.Var("features", self.scratch.emit(expr).ty)
        self.frozen_values.append(value)
        return value

    def close(self) -> None:
        """End the scratch builder's block (the trace is over)."""
        if self.scratch is not None:
            self.scratch._end_block()
            self.scratch = None

    def cut(self) -> relax.Var:
        """The one value of the frozen part the head reads. Raises ValueError when the head
        reads the images themselves or several values of the frozen part."""
        if len(self.read) != 1 or self.read[0].same_as(self.frozen_values[0]):
            what = ("the input images" if self.read and self.read[0].same_as(
                self.frozen_values[0]) else f"{len(self.read)} tensors of the frozen part")
            raise ValueError(f"--cache-features: the trainable layers read {what}, not one "
                             "tensor of features: train fewer layers (last:K, smaller K)")
        return self.read[0]


@dataclass
class FeatureSplit:
    """The training step split at the cut of ``last:K`` (``training_module(...,
    features=True)``): ``FEATURES(x, frozen params..., frozen_states...) -> features`` (float32
    ``(batch, *shape)``), and ``HEAD_ADJOINT(features, masks..., trainable params...,
    head_states..., targets)``, the training step of the trainable layers on the features, laid
    out as ``train_adjoint``: ``((loss, new head states...), (grads...))``. ``frozen_states``
    and ``head_states``: the running statistics of each part, in graph order (together: every
    state)."""

    shape: tuple[int, ...]
    frozen_states: list[str]
    head_states: list[str]

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "frozen_states": self.frozen_states,
                "head_states": self.head_states}


class _DropoutBlocks(ShapeGraph):
    """A shape-only trace (:class:`models.ShapeGraph`) that records the block of each
    dropout: (mask name, block) in order."""

    def __init__(self):
        super().__init__("train")
        self.dropouts: list[tuple[str, str]] = []

    def dropout(self, name, x, p):
        if p != 0.0:
            self.dropouts.append((name, self._block))
        return super().dropout(name, x, p)


def check_cache_features(model, trainable: str) -> int:
    """K of a ``--trainable last:K`` whose frozen part computes the same function of each image
    at every step, so that ``--cache-features`` can compute it once per image. Raises
    ValueError naming the fix for another trainable set (``all``, a list), a frozen BatchNorm
    in training form (``,train-bn``) or a dropout in the frozen part."""
    base, mode = parse_trainable(trainable) if isinstance(trainable, str) else ("", "")
    blocks = spec(model).blocks
    n = len(blocks)
    k = int(base[5:]) if base.startswith("last:") and base[5:].isdigit() else 0
    if not 1 <= k < n:
        raise ValueError(f"--cache-features needs --trainable last:K with K in 1..{n - 1} "
                         f"(a frozen part to compute once per image), not {trainable!r}")
    names = select_trainable(model, trainable)
    frozen_bn = frozen_batchnorms(model, names, mode)
    head = set(blocks[-k:])
    varying = [q.name.rsplit(".", 1)[0] for q in spec(model).states
               if q.block not in head and q.name.endswith(".running_mean")
               and q.name[:-len(".running_mean")] not in frozen_bn]
    if varying:
        raise ValueError(f"--cache-features: BatchNorm {varying[0]} of the frozen part runs in "
                         f"training form (',{TRAIN_BN}'): its output changes with every batch, "
                         "so it cannot be computed once per image; drop ',train-bn' (frozen "
                         "layers' BatchNorms in inference form) or train without "
                         "--cache-features")
    g = _DropoutBlocks()
    model.forward(g, tuple(model.input_shape(1)))
    for name, block in g.dropouts:
        if block not in head:
            least = n - blocks.index(block)
            raise ValueError(f"--cache-features: dropout {name} lies in the frozen part "
                             f"(layer {block}): its mask changes at every step, so that part "
                             "cannot be computed once per image; train from that layer on "
                             f"(--trainable last:{least} or more), or train without "
                             "--cache-features")
    return k


def _feature_functions(model, batch: int, dtype: str, k: int, frozen_bn: set[str],
                       trainable: list[str]):
    """(features module, head backbone module for SetupTrainer, :class:`FeatureSplit`): the two
    parts of the step of ``last:k`` (:class:`_PartGraph`); the features module holds the
    function ``FEATURES`` and the kernels it calls."""
    blocks = spec(model).blocks
    parts = {}
    for part in ("features", "head"):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(model.input_shape(batch), dtype))
        g = _PartGraph(bb, dtype, frozen_bn, blocks, k, part, x, set(trainable))
        head = g.head_blocks
        name = FEATURES if part == "features" else "backbone"
        with bb.function(name):
            with bb.dataflow():
                try:
                    logits = model.forward(g, x)
                finally:
                    g.close()
                cut = g.cut()
                states = [n for n, (q, _) in g.states.items() if (q.block in head) == (
                    part == "head")]
                if part == "features":
                    out = bb.emit_output(cut)
                else:
                    logits = bb.emit_output(logits)
                    _emit_running_statistics(bb, g, states)
                    new = [bb.emit_output(g.new_states[n]) for n in states]
                    out = relax.Tuple([logits, *new]) if states else logits
            params = [v for _, (q, v) in g.params.items() if (q.block in head) == (
                part == "head")]
            inputs = [x] if part == "features" else [cut, *(v for _, _, v in g.masks.values())]
            bb.emit_func_output(out, params=[*inputs, *params,
                                             *(g.states[n][1] for n in states)])
        func = bb.get()  # the function and the kernels it calls (a frozen BatchNorm's fold)
        if part == "head":  # the module SetupTrainer takes
            func = bb.get().with_attrs({"param_num": len(params), "state_num": len(states)})
            if [n for n, (q, _) in g.params.items() if q.block in head] != trainable:
                raise ValueError(f"--cache-features: the trainable parameters {trainable} are "
                                 "not those of the last layers")
        parts[part] = (func, states, tuple(int(d) for d in cut.ty.shape.values)[1:])
    split = FeatureSplit(parts["features"][2], parts["features"][1], parts["head"][1])
    return parts["features"][0], parts["head"][0], split


def _add_functions(out: tvm.IRModule, mod: tvm.IRModule, name: str, symbol: str) -> None:
    """Put ``mod[name]`` into ``out`` as ``symbol``, with the kernels it calls: a kernel
    structurally equal to one of ``out`` is that one; one whose name ``out`` already uses for
    another gets a new name."""
    rename = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        same = [g for g, f in out.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
                and tvm_ffi.structural_equal(f, func)]
        if same:
            rename[gv] = same[0]
            continue
        taken = {g.name_hint for g in out.get_global_vars()}
        new_name, i = gv.name_hint, 1
        while new_name in taken:
            new_name, i = f"{gv.name_hint}_{i}", i + 1
        rename[gv] = tvm.ir.GlobalVar(new_name)
        from tvm.relax.expr import _update_type
        _update_type(rename[gv], gv.ty)
        out[rename[gv]] = func

    @relax.expr_functor.mutator
    class _Rename(relax.PyExprMutator):
        def visit_global_var_(self, op):
            return rename.get(op, op)

    out[symbol] = _Rename().visit_expr(mod[name]).with_attr("global_symbol", symbol)


@dataclass
class TrainingGraph:
    """The Relax module of one model, batch size, trainable set and optimizer, with its layout.

    ``inputs`` lists the argument names of ``train_adjoint`` in order (``targets`` last, int64 of
    shape (batch,)); ``optim_state`` the optimizer state's initial values (float32/int64 arrays);
    ``batchnorm`` the BatchNorm mode of the step (module docstring), ``frozen_bn`` the
    BatchNorms it runs in inference form (:func:`frozen_batchnorms`).
    """

    mod: tvm.IRModule
    model: object
    batch: int
    trainable: list[str]
    frozen: list[str]
    states: list[str]
    masks: dict[str, tuple[tuple[int, ...], float]]
    optimizer: OptimizerConfig
    optim_state: list[np.ndarray] = field(default_factory=list)
    batchnorm: str = "frozen-part"
    frozen_bn: set[str] = field(default_factory=set)
    features: FeatureSplit | None = None

    @property
    def params(self) -> list[str]:
        return [p.name for p in spec(self.model).params]


def inference_module(model, batch: int, dtype: str = "float32") -> tvm.IRModule:
    """Module with ``predict(x, params..., states...) -> logits (batch, classes)`` and the
    kernels it calls (the BatchNorms' folds)."""
    bb, g, x = trace(model, batch, "infer", dtype)
    with bb.function(PREDICT):
        with bb.dataflow():
            y = bb.emit_output(model.forward(g, x))
        args = [x] + [v for _, v in g.params.values()] + [v for _, v in g.states.values()]
        bb.emit_func_output(y, params=args)
    return bb.get()


def add_train_step(mod: tvm.IRModule, trainable_at: int, n_trainable: int) -> tvm.IRModule:
    """``mod`` (a training module: ``ADJOINT`` and ``OPTIMIZER``) plus ``TRAIN_STEP``: the two
    inlined into one function, ``(ADJOINT's parameters..., optimizer state) -> (ADJOINT's first
    output, new trainable parameters, new optimizer state)`` (and, for a loss-scaled step whose
    optimizer takes the loss scale, ``ADJOINT``'s last input, the flag it returns last:
    :mod:`thomas_tune.half_grads`), the trainable parameters being
    ``ADJOINT``'s parameters ``trainable_at`` to ``trainable_at + n_trainable``.

    Why: between the two functions the gradients are outputs of ``ADJOINT``, allocated apart
    from the step's own buffers and alive with them; inside one function they are buffers of the
    step, which the static memory planner places in the storage of tensors already dead by the
    backward pass (the frozen part's activations, the Winograd form's tiles). A step then holds
    up to the trainable parameters' bytes less at its peak. ``ADJOINT`` stays for the checks
    that read the gradients (``step_check``). The optimizer updates the parameters in place as
    it does alone. ``TRAIN_STEP`` takes ``ADJOINT``'s parameters in the same places, so it
    carries ``ADJOINT``'s lifting mark (:data:`thomas_tune.training_graph.lift.ATTR`) where it has
    one."""
    adj, opt = mod[ADJOINT], mod[OPTIMIZER]
    bb = relax.BlockBuilder(mod)
    # private copies (no global symbol), which InlinePrivateFunctions inlines and drops
    adj_gv = bb.add_func(adj.without_attr("global_symbol").without_attr(LIFT),
                         f"{TRAIN_STEP}_adjoint")
    opt_gv = bb.add_func(opt.without_attr("global_symbol"), f"{TRAIN_STEP}_optimizer")
    params = [relax.Var(p.name, p.ty) for p in adj.params]
    state = relax.Var("optimizer_state", opt.params[2].ty)
    # a loss-scaled step (thomas_tune.half_grads): the optimizer takes the loss scale, the
    # adjoint's last input, and returns whether it skipped the update, the step's fourth output
    scale = params[-1:] if len(opt.params) == 4 else []
    with bb.function(TRAIN_STEP, params + [state]):
        out = bb.emit(relax.Call(adj_gv, params))
        first, grads = (bb.emit(relax.TupleGetItem(out, i)) for i in range(2))
        trained = bb.emit(relax.Tuple(params[trainable_at:trainable_at + n_trainable]))
        new = bb.emit(relax.Call(opt_gv, [trained, grads, state, *scale]))
        bb.emit_func_output(relax.Tuple([first, relax.TupleGetItem(new, 0),
                                         relax.TupleGetItem(new, 1),
                                         *(relax.TupleGetItem(new, 2) for _ in scale)]))
    out = relax.transform.InlinePrivateFunctions()(bb.get())
    if adj.attrs and LIFT in adj.attrs:
        out[TRAIN_STEP] = out[TRAIN_STEP].with_attr(LIFT, adj.attrs[LIFT])
    return out


def training_module(model, batch: int, trainable: str | list[str] = "all",
                    optimizer: OptimizerConfig | None = None,
                    dtype: str = "float32", batchnorm: str | None = None,
                    features: bool = False) -> TrainingGraph:
    """Build the training graph (see the module docstring) for ``model`` at ``batch``.

    ``trainable``: a ``--trainable`` string (:func:`parse_trainable`) or a list of parameter
    names; ``dtype``: float32, or float64 for reference computations; ``batchnorm``: ``train``
    ``frozen`` or ``frozen-part`` (default: the trainable string's, :func:`parse_trainable`;
    ``frozen-part`` for a list). The adjoint returns every running statistic after the loss,
    those of BatchNorms in inference form unchanged. ``features``: also the two functions of
    the step split at the frozen part's output (:class:`FeatureSplit`; ``train
    --cache-features``), for a ``last:K`` string whose frozen part computes the same at every
    step. Raises ValueError when no parameter is trainable, a name is unknown, or the BatchNorm
    mode is unknown; with ``features``, for another trainable set, a frozen BatchNorm in
    training form or a dropout in the frozen part (the message names the fix).
    """
    optimizer = optimizer or OptimizerConfig()
    k = check_cache_features(model, trainable) if features else 0
    bn_mode = parse_trainable(trainable)[1] if isinstance(trainable, str) else "frozen-part"
    batchnorm = batchnorm or bn_mode
    names = select_trainable(model, trainable) if isinstance(trainable, str) else list(trainable)
    frozen_bn = frozen_batchnorms(model, names, batchnorm)
    s = spec(model, batch)
    known = {p.name for p in s.params}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"trainable parameters {unknown or names} are not parameters of "
                         f"{model.arch} (it has {len(known)}, e.g. {sorted(known)[:3]})")
    train_set = set(names)
    bb, g, x = _trace_training(model, batch, dtype, frozen_bn, train_set)
    with bb.function("backbone"):
        with bb.dataflow():
            logits = bb.emit_output(model.forward(g, x))
            _emit_running_statistics(bb, g, list(g.states))
            new_states = [bb.emit_output(g.new_states[n]) for n in g.states]
        masks = [v for _, _, v in g.masks.values()]
        frozen = [v for n, (_, v) in g.params.items() if n not in train_set]
        trained = [v for n, (_, v) in g.params.items() if n in train_set]
        states = [v for _, v in g.states.values()]
        bb.emit_func_output(relax.Tuple([logits, *new_states]) if states else logits,
                            params=[x, *masks, *frozen, *trained, *states])
    backbone = bb.get().with_attrs({"param_num": len(trained), "state_num": len(states)})
    classes = model.num_classes
    opt = optimizer.build()
    loss_types = [relax.TensorType((batch, classes), dtype), relax.TensorType((batch,), "int64")]
    loss = CrossEntropyLoss(*loss_types)
    mod = SetupTrainer(loss, opt, loss_types, legalize=False)(loss.add_kernel(backbone))
    mod = batch_sums(gradients.transpose_free_matmuls(mod))
    out = tvm.IRModule({
        ADJOINT: mod["backbone_loss_adjoint"].with_attr("global_symbol", ADJOINT),
        OPTIMIZER: mod["optimizer"],
    })
    for gv, func in mod.functions.items():  # kernels the gradients add (depthwise backward)
        if isinstance(func, tvm.tirx.PrimFunc):
            out[gv] = func
    for gv, func in getattr(opt, "kernels", {}).items():  # the optimizer's own kernels
        out[gv] = func
    _add_functions(out, inference_module(model, batch, dtype), PREDICT, PREDICT)
    split, entries = None, [ADJOINT, OPTIMIZER, PREDICT]
    if features:
        feat, head, split = _feature_functions(model, batch, dtype, k, frozen_bn,
                                               [n for n in g.params if n in train_set])
        _add_functions(out, feat, FEATURES, FEATURES)
        head_mod = batch_sums(gradients.transpose_free_matmuls(SetupTrainer(
            loss, optimizer.build(), loss_types, legalize=False)(loss.add_kernel(head))))
        _add_functions(out, head_mod, "backbone_loss_adjoint", HEAD_ADJOINT)
        entries += [FEATURES, HEAD_ADJOINT]
    out = relax.transform.DeadCodeElimination(entries)(out)
    return TrainingGraph(
        mod=out, model=model, batch=batch,
        trainable=[n for n in g.params if n in train_set],
        frozen=[n for n in g.params if n not in train_set],
        states=list(g.states), masks={k: (v[0], v[1]) for k, v in g.masks.items()},
        optimizer=optimizer, optim_state=[t.numpy() for t in opt.state], batchnorm=batchnorm,
        frozen_bn=frozen_bn, features=split)
