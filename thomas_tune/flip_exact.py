"""Following a build's kink decisions one flip at a time: each candidate flip's exact effect
on the parameter gradients (:func:`flip_effect`), kept while valid (:class:`_Effects`), the
flips that lower the weighted squared residual taken (:func:`follow_exact`), then swaps within
a layer. The kinks are :class:`thomas_tune.kinks.Kink` objects (``kind``, ``x``,
``decision``, ``alt``, ``dy0``) and the graph a :class:`thomas_tune.kinks.KinkGraph` (its
``kinks``), read here by those attributes only; :func:`thomas_tune.kinks.follow` calls this.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flip_solve import weighted_residual


@dataclass
class Flip:
    """A kink element decided otherwise than float64 decides it: ``layer`` (index in the
    forward's kinks), ``kind``, ``index`` (flat index of the element, or of the pool window),
    ``distance`` (float64's input's distance from the kink, or the pool window's gap)."""

    layer: int
    kind: str
    index: int
    distance: float


def distance(k):
    """Per element of ``k`` (per window of a pool), float64's distance from the kink."""
    if k.kind == "pool":
        return k.gap
    x64 = k.x.detach()
    return x64.abs() if k.kind == "relu" else x64.abs().minimum((x64 - 6.0).abs())


def flip_effect(kink, flip: Flip, params: list, sign: float = 1.0):
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
        g = per[b, ch][_group(kink, b, ch, j)].sum()  # the windows one comparison decides
        d = delta.reshape(n, c, -1)
        d[b, ch, kink.decision[b, ch, j]] -= sign * g
        d[b, ch, kink.alt[b, ch, j]] += sign * g
    else:
        now = kink.decision.reshape(-1)[flip.index]
        delta.reshape(-1)[flip.index] = sign * (1.0 - 2.0 * now) * kink.dy0.reshape(-1)[flip.index]
    grads = torch.autograd.grad(x, params, grad_outputs=delta, retain_graph=True,
                                allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]


def _group(kink, b: int, ch: int, j: int):
    """The windows of image ``b``, channel ``ch`` of a pool ``kink`` decided by the comparison
    that decides window ``j`` (:func:`thomas_tune.flip_solve.pool_groups`): a boolean tensor
    over the windows of that image and channel."""
    return (kink.decision[b, ch] == kink.decision[b, ch, j]) & (kink.alt[b, ch] ==
                                                                   kink.alt[b, ch, j])


def apply_flip(kink, flip: Flip) -> list[int]:
    """Decide ``flip``'s element otherwise in ``kink`` (a pool window's gradient goes to its
    second-best position, with every window of its group, which one comparison decides; a
    mask element is inverted). Returns the flat indices of the elements (windows) changed."""
    if kink.kind == "pool":
        n, c, _, _ = kink.x.shape
        per = kink.decision.shape[2]
        nc, j = divmod(flip.index, per)
        b, ch = divmod(nc, c)
        members = _group(kink, b, ch, j)
        a, d = kink.alt[b, ch, j].clone(), kink.decision[b, ch, j].clone()
        kink.decision[b, ch][members], kink.alt[b, ch][members] = a, d
        return [nc * per + int(i) for i in members.nonzero().reshape(-1).tolist()]
    m = kink.decision.reshape(-1)
    m[flip.index] = 1.0 - m[flip.index]
    return [flip.index]




def restore(kink, decision) -> None:
    """Put ``kink``'s decisions back to ``decision`` (a pool's runner-up positions with them:
    a window whose decision changed had the two swapped)."""
    import torch
    if kink.kind == "pool":
        moved = kink.decision != decision
        kink.alt = torch.where(moved, kink.decision, kink.alt)
    kink.decision = decision.clone()


#: the most passes of :func:`follow_exact` over its candidates
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

    def __init__(self, graph, params: list):
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
        moved = set(apply_flip(self.graph.kinks[f.layer], f))
        dropped = self.kept
        self.kept = {k: e for k, e in dropped.items() if k[0] == f.layer and k[1] not in moved}
        return dropped

    def undo(self, f: Flip, dropped: dict) -> None:
        """Undo ``f`` taken by :meth:`flip` (nothing taken since), with the effects it dropped
        (valid again once the residual is computed again)."""
        apply_flip(self.graph.kinks[f.layer], f)
        self.kept = dropped


def follow_exact(loss, graph, cands: list[Flip], params: list, want: list,
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


def _swaps(graph, start: list, cands: list[Flip], effect: _Effects, residual,
           resid: list, now: float, inv: list[float]) -> None:
    """Where a flip taken and an untaken candidate of the same kink layer have nearly the same
    effect (elements of one channel), taking the wrong one leaves a residual that neither
    undoing it nor taking the other lowers alone: each taken flip (against ``start``, the
    decisions before following) is undone together with taking the candidate that lowers the
    weighted squared residual most, kept where the residual computed again is lower."""
    def cost(rs):
        return sum(float((r * s).square().sum()) for r, s in zip(rs, inv))

    for a in changed(graph, start)[:SWAPS]:
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


def _alike(k, d0, index: int):
    """The elements of kink ``k`` (pool: windows) whose float64 input equals element
    ``index``'s (pool: the same maximum, at the positions of ``d0``, and the same gap), as a
    bool tensor of the decisions' shape."""
    if k.kind == "pool":
        n, c = k.x.shape[:2]
        top = k.x.detach().reshape(n, c, -1).gather(2, d0).reshape(-1)
        gap = k.gap.reshape(-1)
        return ((top == top[index]) & (gap == gap[index])).reshape(d0.shape)
    x = k.x.detach().reshape(-1)
    return (x == x[index]).reshape(d0.shape)


def follow_groups(loss, graph, start: list, params: list, want: list,
                  inv: list[float]) -> None:
    """Where a flip taken (against ``start``, the decisions before following) has elements of
    its kink layer with the same float64 input (pool: windows with the same maximum and gap)
    still decided as float64 decides them, decide them all as the flip did, kept where the
    weighted squared residual (``want``: the build's gradients; ``inv``: per parameter the
    inverse of its scale) falls. Equal values are made by the same arithmetic on equal inputs
    (the inside of the check images' constant squares), so a float32 build rounds them alike
    and decides them together; their flips' effects are nearly equal, a least-squares solve
    shares its coefficient among them, and one at a time the last few of a group can each
    lower the residual too little to be taken. Leaves the graph's decisions so."""
    from .flip_solve import apply_mask
    _, now = weighted_residual(loss, graph, params, want, inv)
    for f in changed(graph, start):
        k, d0 = graph.kinks[f.layer], start[f.layer]
        sel = _alike(k, d0, f.index) & (k.decision == d0)
        if not bool(sel.any()):
            continue
        apply_mask(k, sel)
        _, c = weighted_residual(loss, graph, params, want, inv)
        if c < now:
            now = c
        else:  # the same elements decided back
            apply_mask(k, sel)
            weighted_residual(loss, graph, params, want, inv)


def changed(graph, start: list) -> list[Flip]:
    """The elements (pool: windows) of the graph's kinks decided otherwise than ``start`` (per
    kink, its decisions then), each as a :class:`Flip` with float64's distance from the
    kink."""
    out = []
    for i, (k, d0) in enumerate(zip(graph.kinks, start)):
        dist = distance(k).reshape(-1)
        for j in (k.decision != d0).reshape(-1).nonzero().reshape(-1).tolist():
            out.append(Flip(i, k.kind, j, float(dist[j])))
    return out


