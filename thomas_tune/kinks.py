"""A float64 reference step that takes the build's side of every kink.

The gradient of a network of ReLUs, ReLU6s and max pools is discontinuous: where a ReLU's
input lies within float32 rounding of 0 (a ReLU6's of 0 or 6), or a pool window's two largest
values lie within rounding of each other, a float32 step may take the other side of the kink
than the float64 step, and the gradient of that element moves by its whole size. Compared
with float64's own decisions, a right float32 build is then off by 1e-2..3e-1 on some batches
(docs/journal/precision.md); checks that forgave that (the smallest error over several
batches, a floor under each gradient's scale) let real errors pass.

Here the float64 step (PyTorch, the :class:`thomas_tune.reference.TorchGraph` layout) runs its
kinks through custom autograd functions whose backward reads an explicit decision: a 0/1 mask
per ReLU / ReLU6 element (PyTorch's rules, ``threshold_backward``: 1 where x > 0;
``hardtanh_backward``: 1 where 0 < x < 6) and, per max-pool window, the input position that
gets its gradient (the first maximum in row-major order, PyTorch's rule and the build's,
:func:`thomas_tune.gradients.max_pool2d_grad_te`). The forward pass records every kink's input
and marks as **ambiguous** the elements within ``delta`` of the kink: ``delta`` per kink layer
is :data:`DELTA_FACTOR` times the largest difference between PyTorch float32's and float64's
input of that kink over the batch (a measurement of the forward's rounding there).

The build's decisions are read from its gradients (:func:`follow`): only an ambiguous element
may be decided otherwise than float64 decides it; the effect of deciding one otherwise (its
*flip*) on every parameter gradient is computed exactly in float64 (the backward of the
moved output gradient from that kink's input), and the flips that bring the float64 gradients
closer to the build's are taken, one at a time, largest first. Past :data:`MAX_FLIPS`
candidates (a 224-px step has tens of thousands: ReLU6 inputs within rounding of 0 or 6, pool
windows whose constant squares tie), they are weighed all at once first: a flip's effect on
the gradients is linear in it for fixed output gradients, so the flips that explain the
residual solve a least-squares problem over every candidate, whose matrix is applied by one
backward pass and its transpose by one Jacobian-vector product
(:func:`thomas_tune.flip_solve.follow_bulk`); the flips it takes, what it leaves
half-explained and the candidates nearest their kink are then weighed one at a time; the same
where one flip at a time leaves a parameter over the bounds' floor (flips that explain the
build only together). The reference is the float64 step with those decisions, recomputed
whole; it and the build differ by rounding only, on every batch. A mutant cannot hide behind
this: the flips it could use are single elements within rounding of a kink, and each flip
taken is listed (:attr:`Following.flips`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .flip_solve import POLISH, follow_bulk, weighted_residual
from .reference import TorchGraph

#: an element is ambiguous when float64's input of its kink lies within this many times the
#: largest float32 - float64 difference of that kink layer's input (PyTorch float32 as the
#: measure of the forward's rounding; the build's own rounding is of the same order: its
#: errors against float64 are within a few times PyTorch float32's, docs/journal/precision.md)
DELTA_FACTOR = 8.0
#: the most flips computed per batch (each costs one backward pass of part of the network),
#: the nearest to their kink first; the others are counted (``Following.unresolved``)
MAX_FLIPS = 400


@dataclass
class Kink:
    """One kink layer of a forward pass: ``kind`` ("relu", "relu6", "pool"), its input ``x``
    (the graph's tensor), ``decision`` (relu/relu6: a 0/1 tensor of x's shape; pool: int64
    flat input positions per output, (N, C, OH*OW)), ``alt`` (pool: the second-best
    position per window), ``gap`` (pool: largest minus second largest per window, float64),
    ``dy`` (the gradient that reached the output in the last backward pass)."""

    kind: str
    x: object
    decision: object
    alt: object = None
    gap: object = None
    dy: object = None
    dy0: object = None
    layer: str | None = None  # the BatchNorm before it, if any


def _functions():
    import torch
    import torch.nn.functional as F

    class Masked(torch.autograd.Function):
        """relu / relu6 whose backward multiplies by ``kink.decision``, read at backward time."""

        @staticmethod
        def forward(ctx, x, kink, hi):
            ctx.kink = kink
            return x.clamp(0.0, hi) if hi is not None else x.clamp_min(0.0)

        @staticmethod
        def backward(ctx, dy):
            ctx.kink.dy = dy
            return dy * ctx.kink.decision, None, None

    class Pool(torch.autograd.Function):
        """max_pool2d whose backward scatters each window's gradient to ``kink.decision``."""

        @staticmethod
        def forward(ctx, x, kink, kernel, stride, padding):
            out, _ = F.max_pool2d(x, kernel, stride, padding, return_indices=True)
            ctx.kink, ctx.shape = kink, x.shape
            return out

        @staticmethod
        def backward(ctx, dy):
            ctx.kink.dy = dy
            n, c, h, w = ctx.shape
            dx = dy.new_zeros((n, c, h * w))
            dx.scatter_add_(2, ctx.kink.decision, dy.reshape(n, c, -1))
            return dx.reshape(n, c, h, w), None, None, None, None

    return Masked, Pool


def _pool_windows(x, kernel, stride, padding):
    """Per window of max pooling ``x`` (N, C, H, W): the first maximum's flat position, the
    second-best position and the gap between their values, each (N, C, OH*OW)."""
    import torch
    import torch.nn.functional as F
    n, c, h, w = x.shape
    p = padding if isinstance(padding, (tuple, list)) else (padding, padding)
    xp = F.pad(x.detach().reshape(n * c, 1, h, w), (p[1], p[1], p[0], p[0]),
               value=float("-inf"))
    pos = torch.arange(h * w, dtype=x.dtype, device=x.device).reshape(1, 1, h, w)
    posp = F.pad(pos, (p[1], p[1], p[0], p[0]), value=-1.0)
    vals = F.unfold(xp, kernel, stride=stride)  # (N*C, k*k, L)
    where = F.unfold(posp, kernel, stride=stride)[0]  # (k*k, L)
    best = vals.argmax(1)  # the first maximum (argmax returns the first)
    vmax = vals.gather(1, best[:, None])[:, 0]
    rest = vals.scatter(1, best[:, None], float("-inf"))
    second = rest.argmax(1)
    gap = vmax - rest.gather(1, second[:, None])[:, 0]
    cols = torch.arange(where.shape[1], device=x.device)
    first_pos = where[best, cols[None, :].expand_as(best)].long()
    alt_pos = where[second, cols[None, :].expand_as(second)].long()
    shape = (n, c, -1)
    return first_pos.reshape(shape), alt_pos.reshape(shape), gap.reshape(shape)


class KinkGraph(TorchGraph):
    """:class:`TorchGraph` whose ReLU, ReLU6 and max pools record their inputs and take their
    decisions from :attr:`kinks` (float64's own unless changed), and which keeps, per bias
    (``<layer>.bias``), the tensor it is added into (:attr:`bias_outputs`, for the bias's
    natural scale, :func:`bias_sums`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kinks: list[Kink] = []
        self.bias_outputs: dict[str, object] = {}
        self._masked, self._pool = _functions()

    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        y = super().conv2d(name, x, out_channels, kernel, stride, padding, groups, bias)
        if bias:
            self.bias_outputs[f"{name}.bias"] = y
        return y

    def linear(self, name, x, out_features):
        y = super().linear(name, x, out_features)
        self.bias_outputs[f"{name}.bias"] = y
        return y

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        y = super().batch_norm(name, x, eps, momentum, None)
        self.bias_outputs[f"{name}.bias"] = y
        out = self._activate(y, act)
        if act is not None:
            self.kinks[-1].layer = name
        return out

    def _masked_kink(self, x, kind, hi):
        d = (x > 0) if hi is None else (x > 0) & (x < hi)
        k = Kink(kind, x, d.to(x.dtype))
        self.kinks.append(k)
        return self._masked.apply(x, k, hi)

    def relu(self, x):
        return self._masked_kink(x, "relu", None)

    def relu6(self, x):
        return self._masked_kink(x, "relu6", 6.0)

    def max_pool2d(self, x, kernel, stride, padding=0):
        first, alt, gap = _pool_windows(x, kernel, stride, padding)
        k = Kink("pool", x, first, alt, gap)
        self.kinks.append(k)
        return self._pool.apply(x, k, kernel, stride, padding)


def bias_sums(loss, graph: KinkGraph) -> dict[str, np.ndarray]:
    """Per bias, the sum over (N, H, W) of |the gradient of the tensor it is added into| per
    channel: the sum of absolute terms of the bias's gradient, its natural scale (float64)."""
    import torch
    names = [n for n, t in graph.bias_outputs.items() if t.requires_grad]
    outs = torch.autograd.grad(loss, [graph.bias_outputs[n] for n in names], retain_graph=True)
    return {n: g.abs().sum(dim=[d for d in range(g.dim()) if d != 1]).detach().cpu().numpy()
            for n, g in zip(names, outs)}


@dataclass
class Flip:
    """A kink element decided otherwise than float64 decides it: ``layer`` (index in the
    forward's kinks), ``kind``, ``index`` (flat index of the element, or of the pool window),
    ``distance`` (float64's input's distance from the kink, or the pool window's gap)."""

    layer: int
    kind: str
    index: int
    distance: float


@dataclass
class Following:
    """The float64 reference of one batch with the build's decisions: ``loss``, ``grads``
    (name -> float64 array), ``flips`` (the decisions taken otherwise than float64's),
    ``ambiguous`` (elements within delta of their kink that a gradient flows through),
    ``unresolved`` (ambiguous elements past :data:`MAX_FLIPS`: not followed)."""

    loss: float
    grads: dict[str, np.ndarray]
    flips: list[Flip] = field(default_factory=list)
    ambiguous: int = 0
    unresolved: int = 0


def ambiguous_masks(kinks64: list[Kink], rounding: list[float]) -> list:
    """Per kink layer of the float64 pass, a boolean tensor of its elements (relu / relu6: of
    the input's shape; pool: per window, (N, C, OH*OW)) within ``delta`` of their kink whose
    output gradient is not zero (module docstring; ``rounding``: per kink layer, the largest
    PyTorch float32 - float64 difference of its input), or None for a kink no gradient passes
    through (in the frozen part) or with no such element."""
    out = []
    for k, r in zip(kinks64, rounding):
        if not k.x.requires_grad or k.dy0 is None:
            out.append(None)  # in the frozen part: no gradient passes through it
            continue
        m = (_distance(k) <= DELTA_FACTOR * r) & (k.dy0.reshape(k.gap.shape if k.kind == "pool"
                                                                else k.x.shape) != 0)
        out.append(m if bool(m.any()) else None)
    return out


def _distance(k: Kink):
    """Per element of ``k`` (per window of a pool), float64's distance from the kink."""
    if k.kind == "pool":
        return k.gap
    x64 = k.x.detach()
    return x64.abs() if k.kind == "relu" else x64.abs().minimum((x64 - 6.0).abs())


def ambiguous_elements(kinks64: list[Kink], rounding: list[float],
                       masks: list | None = None, nearest: int | None = None) -> list[Flip]:
    """The elements of :func:`ambiguous_masks` (or of ``masks``, already made by it), each as
    a :class:`Flip` with its distance; with ``nearest``, only that many, the nearest to their
    kink first (chosen on the device: a 224-px batch has a million)."""
    import torch
    found = [(i, m.reshape(-1).nonzero().reshape(-1), _distance(k).reshape(-1))
             for i, (k, m) in enumerate(zip(kinks64, ambiguous_masks(kinks64, rounding)
                                            if masks is None else masks)) if m is not None]
    if not found:
        return []
    layers = torch.cat([torch.full_like(j, i) for i, j, _ in found])
    index = torch.cat([j for _, j, _ in found])
    dist = torch.cat([d[j] for _, j, d in found])
    order = torch.sort(dist, stable=True).indices
    if nearest is not None:
        order = order[:nearest]
    return [Flip(i, kinks64[i].kind, j, d) for i, j, d in
            zip(layers[order].tolist(), index[order].tolist(), dist[order].tolist())]


def flip_effect(kink: Kink, flip: Flip, params: list, sign: float = 1.0):
    """The change of every parameter gradient (a list of tensors, in ``params``' order) when
    ``flip``'s element is decided otherwise (``sign`` -1: the change undone), from the output
    gradient of the last backward pass (float64, exact up to rounding)."""
    import torch
    x = kink.x
    delta = torch.zeros_like(x)
    if kink.kind == "pool":
        n, c, _, _ = x.shape
        per = kink.dy0.reshape(n, c, -1)
        nc, j = divmod(flip.index, per.shape[2])
        b, ch = divmod(nc, c)
        g = per[b, ch, j]
        d = delta.reshape(n, c, -1)
        d[b, ch, kink.decision[b, ch, j]] -= sign * g
        d[b, ch, kink.alt[b, ch, j]] += sign * g
    else:
        now = kink.decision.reshape(-1)[flip.index]
        delta.reshape(-1)[flip.index] = sign * (1.0 - 2.0 * now) * kink.dy0.reshape(-1)[flip.index]
    grads = torch.autograd.grad(x, params, grad_outputs=delta, retain_graph=True,
                                allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]


def apply_flip(kink: Kink, flip: Flip) -> None:
    """Decide ``flip``'s element otherwise in ``kink`` (a pool window's gradient goes to its
    second-best position, a mask element is inverted)."""
    if kink.kind == "pool":
        n, c, _, _ = kink.x.shape
        nc, j = divmod(flip.index, kink.decision.shape[2])
        b, ch = divmod(nc, c)
        a, d = kink.alt[b, ch, j].clone(), kink.decision[b, ch, j].clone()
        kink.decision[b, ch, j], kink.alt[b, ch, j] = a, d
    else:
        m = kink.decision.reshape(-1)
        m[flip.index] = 1.0 - m[flip.index]


def follow(loss, graph: KinkGraph, rounding: list[float], params: list, names: list[str],
           target: dict[str, np.ndarray], scales: dict[str, float],
           within: float = 0.0) -> Following:
    """The float64 step of ``graph`` (its forward done, ``loss`` its loss tensor; ``params``
    the trainable tensors, ``names`` theirs) with the decisions that explain ``target`` (the
    build's gradients, name -> array) best: see the module docstring. ``rounding``: per kink
    layer, the largest PyTorch float32 - float64 difference of its input. ``scales``: name ->
    the scale a parameter's error is judged on (the same as the check's). ``within``: where
    every parameter's error against float64's own decisions is at most this, those decisions
    explain the build already and none is changed (no flip computed). Up to
    :data:`MAX_FLIPS` candidates, each flip's exact effect is weighed one at a time; past it,
    or where that leaves an error above ``within``, all candidates at once
    (:func:`thomas_tune.flip_solve.follow_bulk`)."""
    import torch
    base = torch.autograd.grad(loss, params, retain_graph=True)
    for k in graph.kinks:  # the output gradients of the pass with float64's decisions
        k.dy0 = k.dy
    want = [torch.as_tensor(target[n], dtype=base[i].dtype, device=base[i].device)
            for i, n in enumerate(names)]
    resid = [w - b for w, b in zip(want, base)]
    inv = [1.0 / max(scales[n], 1e-300) for n in names]
    if max((float(r.abs().max()) * s for r, s in zip(resid, inv) if r.numel()),
           default=0.0) <= within:
        return Following(float(loss.detach()), numpy_of(names, base))
    masks = ambiguous_masks(graph.kinks, rounding)
    count = sum(int(m.sum()) for m in masks if m is not None)
    start = [k.decision.clone() for k in graph.kinks]

    def worst():
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        return grads, max((float((w - g).abs().max()) * s
                           for w, g, s in zip(want, grads, inv) if g.numel()), default=0.0)

    if count <= MAX_FLIPS:
        _follow_exact(loss, graph, ambiguous_elements(graph.kinks, rounding), params, want,
                      inv, start)
        grads, err = worst()
        if err <= within or count == 0:  # (no candidate: nothing else to follow)
            return Following(float(loss.detach()), numpy_of(names, grads),
                             _changed(graph, start), count, 0)
        # one flip at a time did not explain the build (flips whose effects only add up
        # together): all at once, from float64's own decisions again
        for k, d in zip(graph.kinks, start):
            _restore(k, d)
    for _ in range(ATTEMPTS):  # each from the decisions the one before left
        # what the solve half-explains, and the flips taken so far (each may be undone)
        half = [Flip(i, graph.kinks[i].kind, j, 0.0)
                for i, j in follow_bulk(loss, graph, masks, params, want, inv)]
        near = ambiguous_elements(graph.kinks, rounding, masks, POLISH)
        _follow_exact(loss, graph, _changed(graph, start) + half + near, params, want, inv,
                      start)
        grads, err = worst()
        if err <= within:
            break
    return Following(float(loss.detach()), numpy_of(names, grads), _changed(graph, start),
                     count, 0)


#: rounds of bulk following and weighing one at a time, while a parameter stays over the floor
ATTEMPTS = 2


def _restore(kink: Kink, decision) -> None:
    """Put ``kink``'s decisions back to ``decision`` (a pool's runner-up positions with them:
    a window whose decision changed had the two swapped)."""
    import torch
    if kink.kind == "pool":
        moved = kink.decision != decision
        kink.alt = torch.where(moved, kink.decision, kink.alt)
    kink.decision = decision.clone()


#: the most passes of :func:`_follow_exact` over its candidates
PASSES = 3

#: bytes of flip effects :class:`_Effects` keeps (float64 parameter gradients: 28 MB a flip for
#: MobileNetV2 1.0, 0.5 GB for AlexNet)
EFFECT_CACHE_BYTES = 4 << 30


class _Effects:
    """Flip effects (:func:`flip_effect`) of one graph at its present decisions, each computed
    once while it stays valid. A flip taken at kink layer M changes the backward pass from
    every later layer's input (it passes through M) and, once the residual is computed again,
    the output gradients of every earlier layer (they pass back through M): only the effects
    of M's other elements stay. A flip undone puts back what it dropped. Up to
    :data:`EFFECT_CACHE_BYTES` are kept (the first ones asked for: the weighing passes go over
    the candidates in one order)."""

    def __init__(self, graph: KinkGraph, params: list):
        self.graph, self.params, self.kept = graph, params, {}
        per = 8 * sum(p.numel() for p in params)
        self.room = EFFECT_CACHE_BYTES // max(per, 1)

    def __call__(self, f: Flip) -> list:
        key = (f.layer, f.index)
        e = self.kept.get(key)
        if e is None:
            e = flip_effect(self.graph.kinks[f.layer], f, self.params)
            if len(self.kept) < self.room:
                self.kept[key] = e
        return e

    def flip(self, f: Flip) -> dict:
        """Take ``f`` in the graph; returns the effects it dropped, for :meth:`undo`."""
        apply_flip(self.graph.kinks[f.layer], f)
        dropped = self.kept
        self.kept = {k: e for k, e in dropped.items() if k[0] == f.layer and k[1] != f.index}
        return dropped

    def undo(self, f: Flip, dropped: dict) -> None:
        """Undo ``f`` taken by :meth:`flip` (nothing taken since), with the effects it dropped
        (valid again once the residual is computed again)."""
        apply_flip(self.graph.kinks[f.layer], f)
        self.kept = dropped


def _follow_exact(loss, graph: KinkGraph, cands: list[Flip], params: list, want: list,
                  inv: list[float], start: list | None = None) -> None:
    """Of ``cands``, take one at a time the flips that lower the weighted squared residual
    (the build's gradients ``want`` minus the reference's; ``inv``: per parameter the inverse
    of its scale), the largest effects first, each flip's effect computed exactly from the
    output gradients at the present decisions (:func:`flip_effect`, kept while valid:
    :class:`_Effects`) and the residual computed again after each flip taken; up to
    :data:`PASSES` passes while one takes a flip (a flip taken can be undone in the next);
    then, with ``start`` (the decisions before following), swaps (:func:`_swaps`). Leaves the
    graph's decisions so."""
    def residual():
        return weighted_residual(loss, graph, params, want, inv)

    effect = _Effects(graph, params)

    def weight(e):
        return max(float(t.abs().max()) * s for t, s in zip(e, inv))

    resid, now = residual()
    # each flip's effect is a set of whole gradients: kept only up to a budget (AlexNet's 61 M
    # float64 gradient values per flip times hundreds of flips exceed any device)
    weighed = [(w, f) for w, f in ((weight(effect(f)), f) for f in cands) if w > 0]
    weighed.sort(key=lambda wf: -wf[0])
    for _ in range(PASSES):
        took = False
        for _, f in weighed:
            trial = sum(float(((r - t) * s).square().sum())
                        for r, t, s in zip(resid, effect(f), inv))
            if trial < now:
                dropped = effect.flip(f)
                r, c = residual()
                if c < now:
                    resid, now, took = r, c, True
                else:  # flips elsewhere make it worse: undone
                    effect.undo(f, dropped)
                    residual()
        if not took:
            break
    if start is not None:
        _swaps(graph, start, [f for _, f in weighed], effect, residual, resid, now, inv)


#: swaps weighed after the one-at-a-time passes: of the flips taken, at most SWAPS, each
#: against at most SWAP_WITH candidates of the same kink layer
SWAPS, SWAP_WITH = 40, 24


def _swaps(graph: KinkGraph, start: list, cands: list[Flip], effect: _Effects, residual,
           resid: list, now: float, inv: list[float]) -> None:
    """Where a flip taken and an untaken candidate of the same kink layer have nearly the same
    effect (elements of one channel), taking the wrong one leaves a residual that neither
    undoing it nor taking the other lowers alone: each taken flip (against ``start``, the
    decisions before following) is undone together with taking the candidate that lowers the
    weighted squared residual most, kept where the residual computed again is lower."""
    def cost(rs):
        return sum(float((r * s).square().sum()) for r, s in zip(rs, inv))

    for a in _changed(graph, start)[:SWAPS]:
        same = [f for f in cands if f.layer == a.layer and f.index != a.index][:SWAP_WITH]
        if not same:
            continue
        back = [r - t for r, t in zip(resid, effect(a))]
        best, pick = now, None
        for f in same:
            c = cost([r - t for r, t in zip(back, effect(f))])
            if c < best:
                best, pick = c, f
        if pick is None:
            continue
        dropped = effect.flip(a)
        effect.flip(pick)
        r, c = residual()
        if c < now:
            resid, now = r, c
        else:
            apply_flip(graph.kinks[pick.layer], pick)
            effect.undo(a, dropped)
            residual()


def _changed(graph: KinkGraph, start: list) -> list[Flip]:
    """The elements (pool: windows) of the graph's kinks decided otherwise than ``start`` (per
    kink, its decisions then), each as a :class:`Flip` with float64's distance from the
    kink."""
    out = []
    for i, (k, d0) in enumerate(zip(graph.kinks, start)):
        dist = _distance(k).reshape(-1)
        for j in (k.decision != d0).reshape(-1).nonzero().reshape(-1).tolist():
            out.append(Flip(i, k.kind, j, float(dist[j])))
    return out


def numpy_of(names, grads) -> dict[str, np.ndarray]:
    """name -> float64 numpy array of each tensor of ``grads``."""
    return {n: g.detach().cpu().numpy().astype("float64") for n, g in zip(names, grads)}
