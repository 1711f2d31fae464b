"""The Relax module a training library is compiled from: the training graph's functions with the
packing functions (tensors -> one tuple, the optimizer's input form over RPC), ``draw_masks`` for
a model with dropout, ``TRAIN_STEP`` in one function, and what is computed from constant inputs
alone marked for lifting (:mod:`thomas_tune.training_graph.lift`).

This is the graph stage's last word: :mod:`thomas_tune.compiler.export` compiles exactly this module
into ``train.so``, and :mod:`thomas_tune.memory_plan` and the kernel benchmarks fuse the same
module, so the kernel names they report are the library's.
"""

from __future__ import annotations

import tvm
from tvm import relax

from . import graph as G, lift
from .dropout import draw_masks_function
from ..manifest import ADJOINT, FEATURES, PACK_OPTIMIZER_STATE, PACK_TRAINABLE
from ..models import spec


def _with_packing_functions(mod: tvm.IRModule, trainable_shapes, optim_state) -> tvm.IRModule:
    """``mod`` plus the two packing functions: each takes tensors (the trainable parameters;
    the optimizer state) and returns copies of them as one tuple, the optimizer's input form.
    Copies (``x + 0``), because a tensor argument that arrived over RPC is only borrowed for
    the call."""
    specs = {PACK_TRAINABLE: [(tuple(s), "float32") for s in trainable_shapes],
             PACK_OPTIMIZER_STATE: [(tuple(a.shape), str(a.dtype)) for a in optim_state]}
    bb = relax.BlockBuilder(mod)
    for name, shapes in specs.items():
        args = [relax.Var(f"t{i}", relax.TensorType(shape, dtype))
                for i, (shape, dtype) in enumerate(shapes)]
        with bb.function(name, args):
            # outside a dataflow block: inside one, the build turns a kernel that copies
            # (``x + 0`` once simplified) into a view of its input (RewriteDataflowReshape)
            copies = [bb.emit(relax.op.add(a, relax.const(0, dtype)))
                      for a, (_, dtype) in zip(args, shapes)]
            bb.emit_func_output(relax.Tuple(copies))
    return bb.get()


def _marked_for_lifting(tg: G.TrainingGraph) -> tvm.IRModule:
    """``tg.mod`` with what ``ADJOINT`` and ``FEATURES`` compute from their constant inputs
    alone (the frozen parameters' Winograd transforms, the frozen BatchNorms folded into their
    convolutions) marked for lifting (:data:`thomas_tune.training_graph.lift.ATTR`): it runs once
    per load."""
    mod = tg.mod.clone()  # tg's own module stays as it is
    if tg.frozen:
        mod[ADJOINT] = mod[ADJOINT].with_attr(lift.ATTR, lift_request(tg)[0])
    if tg.features:  # the frozen part alone reads constants only, but for the images
        n = len(tg.frozen) + len(tg.features.frozen_states)
        mod[FEATURES] = mod[FEATURES].with_attr(lift.ATTR, [1, n])
    return mod


def lift_request(tg: G.TrainingGraph) -> tuple[list[int], list[str]]:
    """What ``ADJOINT`` of ``tg`` lifts (:mod:`thomas_tune.training_graph.lift`): the value of its
    :data:`thomas_tune.training_graph.lift.ATTR` (the frozen parameters' positions, then those of
    the running statistics of its BatchNorms in inference form, constant too) and the names of the
    tensors its lifting function takes, in order. For a graph with frozen parameters."""
    first = 1 + len(tg.masks)
    states_at = first + len(tg.frozen) + len(tg.trainable)
    constant_states = [n for n in tg.states if n.rsplit(".", 1)[0] in tg.frozen_bn]
    attr = [first, len(tg.frozen), *(states_at + tg.states.index(n) for n in constant_states)]
    return attr, tg.frozen + constant_states


def training_library_module(tg: G.TrainingGraph) -> tuple[tvm.IRModule, list[str] | None]:
    """The Relax module that :func:`thomas_tune.compiler.export.export` compiles into ``train.so``
    for the training graph ``tg`` (kernel names in the library come from fusing exactly this
    module), and the names of the tensors ``ADJOINT_FROZEN`` takes (None without frozen
    parameters): the graph's functions with what is to be lifted marked
    (:mod:`thomas_tune.training_graph.lift`), the packing functions, ``TRAIN_STEP``
    (``graph.add_train_step``, marked as ``ADJOINT`` is) and, for a model with dropout,
    ``draw_masks`` (:func:`thomas_tune.training_graph.dropout.draw_masks_function`)."""
    shapes = {p.name: p.shape for p in spec(tg.model).params}
    lift_inputs = lift_request(tg)[1] if tg.frozen else None
    train_mod = _with_packing_functions(_marked_for_lifting(tg),
                                        [shapes[n] for n in tg.trainable], tg.optim_state)
    # the step in one function, its gradients buffers of the step (graph.add_train_step)
    train_mod = G.add_train_step(train_mod, 1 + len(tg.masks) + len(tg.frozen),
                                 len(tg.trainable))
    if tg.masks:
        train_mod = draw_masks_function(train_mod, list(tg.masks.values()))
    return train_mod, lift_inputs
