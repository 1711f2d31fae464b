"""Memory of a training step, from the training graph (before any kernel is compiled).

For a model, batch and trainable set this counts, in bytes:

* ``parameters``: every parameter (frozen and trainable) and BatchNorm state, resident;
* ``gradients``: one gradient per trainable parameter;
* ``optimizer_state``: the optimizer's buffers (momentum: one per trainable parameter and a step
  counter; Adam: two per parameter);
* ``activations_kept``: tensors the forward pass computes that the backward pass reads (what
  training must keep that inference can drop), found in ``train_adjoint``: forward bindings
  used by a binding of the gradient pass (which begins at the first ``*_adjoint`` variable);
* ``peak``: the largest sum of live tensors over the whole step, by liveness over the bindings of
  ``train_adjoint`` in order (a tensor lives from its binding to its last use; inputs live all
  along; tuple items alias their tuple) and then over the optimizer update, which writes the new
  parameters and states over the old ones (in place: one copy of each). Kernel fusion and memory
  planning can only lower it, so this is an upper bound of what the compiled step allocates,
  and the right measure of what freezing saves.

With ``features`` the step is ``train --cache-features``'s: ``train_head_adjoint`` on a batch
of the frozen part's output (``input_batch`` is then that batch), the frozen parameters and
states resident beside it; the cached features themselves are held on the host, not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from tvm import relax

from .training_graph import graph as G


@dataclass
class TrainingMemory:
    """Bytes of one training step (module docstring)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations_kept: int
    input_batch: int
    peak: int

    def as_dict(self) -> dict:
        return asdict(self)


def _bytes(ty) -> int:
    """Bytes of a Relax tensor type, or of all tensors of a tuple type (0 for others)."""
    if isinstance(ty, relax.TensorType):
        if ty.shape is None:
            return 0
        n = int(np.prod([int(v) for v in ty.shape.values])) if ty.ndim else 1
        return n * np.dtype(str(ty.dtype)).itemsize
    if hasattr(ty, "fields"):
        return sum(_bytes(f) for f in ty.fields)
    return 0


def _vars_in(expr) -> list[relax.Var]:
    return list(relax.analysis.free_vars(expr))


def _liveness_peak(func: relax.Function) -> tuple[int, int]:
    """(peak bytes of live tensors, bytes of forward tensors read by the backward)."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    sizes, alias = {}, {}
    for b in bindings:
        v = b.value
        if isinstance(v, (relax.TupleGetItem, relax.Tuple, relax.Var)):
            sizes[b.var] = 0  # a view of tensors counted where they were computed
            alias[b.var] = _vars_in(v)
        else:
            sizes[b.var] = _bytes(b.var.ty)
    uses = [_vars_in(b.value) for b in bindings]
    # the gradient pass appends the backward after the forward: it starts at the first
    # "*_adjoint" binding, and its own intermediates are not all named so
    backward = next((i for i, b in enumerate(bindings) if b.var.name.endswith("_adjoint")),
                    len(bindings))
    last_use, read_by_backward = {}, set()
    for i, b in enumerate(bindings):
        for u in uses[i]:
            last_use[u] = i
            if i >= backward:
                read_by_backward.add(u)
    for u in _vars_in(func.body.body):
        last_use[u] = len(bindings)
    # an alias keeps what it aliases alive
    for i in reversed(range(len(bindings))):
        var = bindings[i].var
        for src in alias.get(var, []):
            last_use[src] = max(last_use.get(src, i), last_use.get(var, i))
    resident = sum(_bytes(p.ty) for p in func.params)
    live, peak = 0, resident
    ends: dict[int, list] = {}
    for var, i in last_use.items():
        ends.setdefault(i, []).append(var)
    for i, b in enumerate(bindings):
        live += sizes[b.var]
        peak = max(peak, resident + live)
        for var in ends.get(i, []):
            live -= sizes.get(var, 0)
    kept = sum(sizes[b.var] for b in bindings[:backward] if b.var in read_by_backward)
    return peak, kept


def training_memory(model, batch: int, trainable: str = "all",
                    optimizer: G.OptimizerConfig | None = None,
                    features: bool = False, winograd=None,
                    precision: str = "float32", rewrite=None) -> TrainingMemory:
    """Bytes a training step of ``model`` needs; see the module docstring.
    ``features``: the step on cached features (``train --cache-features``). ``winograd``: the
    convolutions a build computes in the Winograd form (a set of
    :class:`thomas_tune.training_graph.winograd_form.Conv`, as an export's manifest lists them;
    None: none): the step is counted with them rewritten, so their transformed inputs, weights and
    products (a 5x5 convolution's transformed input is 9x its size, a 3x3's 2.25x) are counted too.
    ``precision``: the step's tensors at that precision
    (:func:`thomas_tune.half_storage.training_precision`: with ``mixed16`` the layer outputs
    are float16, 2 bytes an element; parameters, gradients and optimizer state stay float32);
    ``rewrite``: the precision's function rewrite where it is not mixed16's
    (:func:`thomas_tune.half_arith.rewrite_for`).

    Raises ValueError for a bad ``trainable`` value (as :func:`graph.training_module`), and
    with ``features`` for a trainable set that cannot cache them (its message names the fix),
    for an unknown precision, and for a half precision with ``features`` (built in float32
    only).
    """
    from .models import spec
    if precision != "float32" and features:
        raise ValueError(f"the step on cached features is built in float32 only: drop "
                         f"--precision {precision} or --cache-features")
    tg = G.training_module(model, batch, trainable, optimizer, features=features)
    mod = tg.mod
    if precision != "float32":
        from .half_storage import training_precision
        mod = training_precision(precision, mod, batch, rewrite)
    if winograd:
        from .training_graph import winograd_form as W
        chosen = set(winograd)
        mod, _ = W.rewrite(mod, lambda call, conv: conv in chosen)
    func = mod[G.HEAD_ADJOINT if features else G.ADJOINT]
    peak_adjoint, kept = _liveness_peak(func)
    s = spec(model, batch)
    params = {p.name: 4 * int(np.prod(p.shape)) for p in s.params + s.states}  # float32
    weights = sum(params[n] for n in tg.frozen + tg.trainable + tg.states)
    taken = {p.name for p in func.params}
    # resident on the device, not arguments of the step function (the frozen part's)
    peak_adjoint += sum(params[n] for n in tg.frozen + tg.states if n not in taken)
    grads = sum(params[n] for n in tg.trainable)
    optim = int(sum(np.asarray(a).nbytes for a in tg.optim_state))
    x = _bytes(func.params[0].ty)
    # the update, in place: every parameter and state, the gradients, the optimizer state
    peak_update = weights + grads + optim
    return TrainingMemory(parameters=weights, gradients=grads, optimizer_state=optim,
                          activations_kept=kept, input_batch=x,
                          peak=max(peak_adjoint + optim, peak_update))
