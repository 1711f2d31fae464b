"""The training step in PyTorch on a :class:`thomas_tune.kinks.KinkGraph`: its forward pass
(float64 or float32, the step check's reference and yardstick), its loss and gradients with
its own decisions at every kink, and float64's gradients with PyTorch float32's decisions."""

from __future__ import annotations

import numpy as np

from .kinks import KinkGraph, numpy_of
from .models import spec


def follow_float32(loss64, graph: KinkGraph, graph32: KinkGraph, params: list,
                   names: list[str]) -> dict[str, np.ndarray]:
    """The float64 gradients with PyTorch float32's own decisions (read from ``graph32``'s
    kink inputs): the reference of the yardstick. Leaves ``graph``'s decisions so."""
    import torch
    for k, k32 in zip(graph.kinks, graph32.kinks):
        if k.kind == "pool":
            k.decision = k32.decision.clone()
        else:
            k.decision = k32.decision.to(k.decision.dtype)
    return numpy_of(names, torch.autograd.grad(loss64, params, retain_graph=True))


def torch_forward(model, tensors: dict[str, np.ndarray], trainable: list[str], x: np.ndarray,
                  y: np.ndarray, frozen_bn: bool | set = False, device: str | None = None,
                  dtype: str = "float64", masks: dict | None = None,
                  precision: str = "float32", halves: list | None = None):
    """The step's forward pass in PyTorch (``dtype``, BatchNorm in training form but where
    ``frozen_bn`` says, dropout ``masks`` name -> array or None for ones) on a
    :class:`KinkGraph`: returns (loss tensor, the graph, the trainable
    tensors, their names). ``device``: a torch device (default: CUDA when available, else
    the CPU). ``precision``: the build's (``float32``; ``mixed16``: layer outputs rounded to
    float16 where that step stores them, :mod:`thomas_tune.half_reference`); ``halves``
    (mixed16 only): the float16 tensors the build stored on this batch, in order
    (:func:`thomas_tune.step_run.stored_step`), whose roundings the graph follows within one
    float16 step (counted in the graph's ``aligned``). Raises ValueError for a precision with
    no reference (``autocast16``'s float16 arithmetic), and where ``halves`` are not one per
    place, shape for shape. Needs torch."""
    import torch
    import torch.nn.functional as F

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = spec(model)
    train = set(trainable)
    if torch.cuda.is_available() and dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
        torch.backends.cudnn.allow_tf32 = False
    params = {p.name: torch.tensor(np.asarray(tensors[p.name], dtype), device=dev,
                                   requires_grad=p.name in train) for p in s.params}
    states = {q.name: torch.tensor(np.asarray(tensors[q.name], dtype), device=dev)
              for q in s.states}
    tm = {name: torch.tensor(np.asarray((masks or {}).get(name, np.ones(shape)), dtype),
                             device=dev) for name, (shape, _) in s.masks.items()}
    if precision not in ("float32", "mixed16"):
        raise ValueError(f"precision {precision!r}: the step check has a reference of float32 "
                         "and mixed16 builds only (autocast16 computes in float16, which no "
                         "device here runs); check such a build's float32 or mixed16 twin")
    if halves is not None and precision != "mixed16":
        raise ValueError("the build's float16 tensors are followed by a mixed16 reference only")
    g = KinkGraph(params, states, tm, training=True, frozen_bn=frozen_bn,
                  half=precision == "mixed16", halves=halves)
    g.source = (model, torch.tensor(np.asarray(x, dtype), device=dev))
    logits = model.forward(g, g.source[1])
    if halves is not None and g.aligned.places != len(halves):
        raise ValueError(f"the build stored {len(halves)} float16 tensors where the reference "
                         f"rounds {g.aligned.places}: its places are not the build's")
    loss = F.cross_entropy(logits, torch.tensor(np.asarray(y, "int64"), device=dev))
    names = [n for n in params if n in train]
    return loss, g, [params[n] for n in names], names


def torch_step(model, tensors: dict[str, np.ndarray], trainable: list[str], x: np.ndarray,
               y: np.ndarray, frozen_bn: bool | set = False, device: str | None = None,
               dtype: str = "float64", bn_values: dict | None = None, masks: dict | None = None
               ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (float64 arrays) of ``trainable`` of the same step in PyTorch with
    its own decisions at every kink (:func:`torch_forward`). ``bn_values``: a dict that gets,
    per training-form BatchNorm layer, the values per channel it normalised (N*H*W)."""
    import torch
    loss, g, params, names = torch_forward(model, tensors, trainable, x, y, frozen_bn, device,
                                           dtype, masks)
    if bn_values is not None:
        bn_values.update(g.bn_values)
    return float(loss.detach()), numpy_of(names, torch.autograd.grad(loss, params))
