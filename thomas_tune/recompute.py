"""Recomputation in the backward pass (activation checkpointing) to fit a memory budget.

The gradient pass keeps every forward tensor the backward reads alive from where the forward
makes it to where the backward last reads it. For a tensor that is cheap to make again from
tensors kept anyway, the backward can compute it again where it needs it instead: the forward
copy then dies at its last forward use, the backward copy lives only between its first and
last backward use, and the build's memory planner (``StaticPlanBlockMemory``) lends the
storage to other tensors. The gradients are the same expressions of the same inputs.

What this module recomputes:

* ``elementwise``: the output of each training-form BatchNorm with its activation
  (:func:`thomas_tune.models.batchnorm.bn_act`: normalise, scale, shift, ReLU6), which the
  next convolution's weight gradient reads. Its input (the convolution's output) and the
  batch's statistics are kept anyway (the BatchNorm's own backward reads them), so it is made
  again from them by one element-wise kernel: about 7 operations per element.
* ``segments:k@p`` (``segments`` is ``segments:2@0``, ``segments:k`` is ``segments:k@0``): on
  top, the convolutions that make those inputs, for every BatchNorm layer but those at
  positions p, p + k, p + 2k, ... (counted from 0 in forward order): segments of k - 1 layers
  recomputed from the kept output of the layer before (PyTorch's ``torch.utils.checkpoint`` on
  such segments). Each costs the convolution's forward FLOPs again. The copies of a segment
  live together from where the backward reaches it, and which layers are kept decides which
  segment is live at the step's peak (MobileNetV2's stages differ in size by 4x), so the
  compiled peak depends on p as much as on k, and not monotonically on either.

:func:`thomas_tune.memory_plan.plan_for_budget` tries :data:`LEVELS` from the least work added
to the most, the phases of one ``k`` together, and takes the first ``k`` one of whose phases
fits a budget (measured by :func:`thomas_tune.memory_plan.compiled_step_memory`, the compiled
step's own memory plan), the fitting phase that adds the fewest FLOPs; it raises
:class:`BudgetError` naming the smallest budget any of them fits when none does.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import tvm
from tvm import relax

#: the longest segment a budget's plan tries (k of ``segments:k@p``): up to 4 recomputed
#: convolutions in a row
MAX_SEGMENT = 4
#: the plans a budget tries, from the cheapest in added work to the most recomputed
#: (``segments:k@p``: every BatchNorm layer's convolution output but those at positions p, p + k,
#: ...; a larger k recomputes a larger share, (k - 1) / k)
LEVELS = ("none", "elementwise") + tuple(
    f"segments:{k}@{p}" for k in range(2, MAX_SEGMENT + 1) for p in range(k))
_SEGMENTS = re.compile(r"segments(?::(\d+)(?:@(\d+))?)?")
#: operations per element of the BatchNorm-with-activation kernel made again (subtract,
#: multiply by the inverse deviation, scale, shift, clip at 0 and 6): its FLOPs
BN_ACT_FLOPS_PER_ELEMENT = 7


class BudgetError(ValueError):
    """No plan fits the budget; ``smallest`` is the smallest budget one fits (bytes);
    ``tried``: the figures of every level tried (as ``plan_for_budget`` returns them)."""

    def __init__(self, message: str, smallest: int, tried: list[dict] | None = None):
        super().__init__(message)
        self.smallest = smallest
        self.tried = tried or []


@dataclass
class Recomputed:
    """One forward tensor made again in the backward: its name, shape, bytes, the kernel that
    makes it, and the FLOPs that adds."""

    name: str
    shape: list[int]
    bytes: int
    op: str
    flops: int


@dataclass
class RecomputePlan:
    """What a training step recomputes (``level``, one of :data:`LEVELS`); ``recomputed`` is
    filled by :func:`apply_plan`."""

    level: str = "none"
    recomputed: list[Recomputed] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def flops_added(self) -> int:
        return sum(r.flops for r in self.recomputed)


def _kernel_name(value) -> str | None:
    """The PrimFunc a ``call_tir*`` binding calls, or the op's name; None for others."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        if value.op.name.startswith("relax.call_tir"):
            return value.args[0].name_hint
        return value.op.name
    return None


def _args(value) -> list:
    if _kernel_name(value) and value.op.name.startswith("relax.call_tir"):
        return list(value.args[1].fields)
    return list(value.args)


def _shape(var) -> list[int]:
    return [int(v) for v in var.ty.shape.values]


def _nbytes(var) -> int:
    return int(np.prod(_shape(var), dtype=np.int64)) * np.dtype(str(var.ty.dtype)).itemsize


def _conv_flops(value, out) -> int:
    """2 * output elements * (input channels per group) * kernel area."""
    w = _shape(value.args[1])
    return 2 * int(np.prod(_shape(out), dtype=np.int64)) * int(np.prod(w[1:]))


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Replaces variables by others (a mapping of vars)."""

    def __init__(self, mapping):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var):
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.mapping.get(var, var)


def segment_of(level: str) -> tuple[int, int] | None:
    """(k, p) of a ``segments``, ``segments:k`` or ``segments:k@p`` level (module docstring;
    ``segments`` is (2, 0), ``segments:k`` is (k, 0)); None for ``none`` and ``elementwise``.
    Raises ValueError for another level, or k < 2, or p not in [0, k)."""
    if level in ("none", "elementwise"):
        return None
    m = _SEGMENTS.fullmatch(level)
    k, p = (int(m.group(1) or 2), int(m.group(2) or 0)) if m else (0, 0)
    if not m or k < 2 or p >= k:
        raise ValueError(f"recomputation level {level!r}: none, elementwise, segments, "
                         "segments:K (K >= 2) or segments:K@P (0 <= P < K)")
    return k, p


def _choose(bindings, backward: int, level: str) -> dict:
    """The forward variables to recompute at ``level``: var -> (binding, op, flops)."""
    forward = {b.var: b for b in bindings[:backward]}
    read = set()
    for b in bindings[backward:]:
        read.update(v for v in relax.analysis.free_vars(b.value) if v in forward)
    chosen = {}
    bn_inputs = []
    for var in read:
        b = forward[var]
        name = _kernel_name(b.value) or ""
        if name.startswith("bn_act") and isinstance(var.ty, relax.TensorType):
            n = int(np.prod(_shape(var), dtype=np.int64))
            chosen[var] = (b, name, BN_ACT_FLOPS_PER_ELEMENT * n)
            bn_inputs.append(_args(b.value)[0])
    segment = segment_of(level)
    if segment is not None:
        # of the BatchNorm layers' convolution outputs, in forward order, all but those at
        # positions p, p + k, ...
        order = {b.var: i for i, b in enumerate(bindings[:backward])}
        convs = sorted((v for v in bn_inputs if v in forward
                        and _kernel_name(forward[v].value) == "relax.nn.conv2d"),
                       key=order.__getitem__)
        k, p = segment
        for var in (v for i, v in enumerate(convs) if (i - p) % k):
            b = forward[var]
            chosen[var] = (b, "relax.nn.conv2d", _conv_flops(b.value, var))
    # a copy reads only what the backward holds anyway: arguments, kept tensors, other copies
    held = read | set(chosen)
    while True:
        bad = [v for v, (b, _, _) in chosen.items()
               if any(a in forward and a not in held for a in relax.analysis.free_vars(b.value))]
        if not bad:
            return chosen
        for v in bad:
            del chosen[v]
            if v not in read:
                held.discard(v)


def recompute_function(func: relax.Function, level: str) -> tuple[relax.Function, list]:
    """``func`` (a ``train_adjoint``: the forward's bindings, then the backward's from the
    first ``*_adjoint`` variable) with the forward tensors of ``level`` (module docstring)
    computed again before their first use in the backward, that use and every later one
    reading the new copy; a copy's inputs that are themselves recomputed are read from their
    copies. Returns (function, [:class:`Recomputed`]). Raises ValueError for an unknown
    level."""
    segment_of(level)  # ValueError for an unknown level
    blocks = list(func.body.blocks)
    bindings = [b for bl in blocks for b in bl.bindings]
    backward = next((i for i, b in enumerate(bindings) if b.var.name.endswith("_adjoint")),
                    len(bindings))
    chosen = _choose(bindings, backward, level) if level != "none" else {}
    if not chosen:
        return func, []
    mapping, done, seen, new_blocks = {}, [], 0, []

    def emit_copy(var, out: list, dataflow: bool) -> None:
        b = chosen[var][0]
        for a in relax.analysis.free_vars(b.value):
            if a in chosen and a not in mapping:
                emit_copy(a, out, dataflow)
        cls = relax.DataflowVar if dataflow else relax.Var
        new = cls(f"{var.name}_recomputed", var.ty)
        out.append(relax.VarBinding(new, _Substitute(mapping).visit_expr(b.value)))
        mapping[var] = new
        done.append(Recomputed(var.name, _shape(var), _nbytes(var), chosen[var][1],
                               int(chosen[var][2])))

    for bl in blocks:
        dataflow = isinstance(bl, relax.DataflowBlock)
        out = []
        for b in bl.bindings:
            if seen >= backward:
                for v in relax.analysis.free_vars(b.value):
                    if v in chosen and v not in mapping:
                        emit_copy(v, out, dataflow)
                b = relax.VarBinding(b.var, _Substitute(mapping).visit_expr(b.value)) \
                    if mapping else b
            out.append(b)
            seen += 1
        new_blocks.append(relax.DataflowBlock(out) if dataflow else relax.BindingBlock(out))
    body = relax.SeqExpr(new_blocks, func.body.body)
    new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
    return new, done


def apply_plan(tg, plan: RecomputePlan):
    """The training graph ``tg`` (:class:`thomas_tune.training_graph.graph.TrainingGraph`) with its
    ``train_adjoint`` recomputing what ``plan.level`` says; fills ``plan.recomputed``."""
    from .training_graph.graph import ADJOINT
    func, done = recompute_function(tg.mod[ADJOINT], plan.level)
    plan.recomputed = done
    if not done:
        return tg
    mod = tg.mod.clone() if hasattr(tg.mod, "clone") else tvm.IRModule(dict(tg.mod.functions))
    mod[ADJOINT] = func
    return replace(tg, mod=mod)
