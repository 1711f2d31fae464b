"""Following a build's kink decisions in bulk: the flips of every candidate element at once.

For fixed output gradients of the kinks, deciding an element otherwise changes the gradients
of the parameters linearly in the flip, so which flips explain the build's gradients is a
least-squares problem over all candidates (:func:`least_squares`) whose matrix is applied by
one backward pass from the kink inputs and its transpose by one forward pass in forward-mode
differentiation (the derivative of the kink inputs along a direction of the parameters)
(:class:`Effects`). :func:`follow_bulk` solves it in rounds from the new decisions; the
caller, :func:`thomas_tune.kinks.follow`, weighs what it leaves one flip at a time. The kinks
are :class:`thomas_tune.kinks.Kink` objects (``kind``, ``x``, ``decision``, ``alt``, ``dy0``),
read here by those attributes only.
"""

from __future__ import annotations

def pool_groups(kink):
    """The windows of a pool ``kink`` that one comparison decides: windows of one image and
    channel whose first maximum (``decision``) and runner-up (``alt``) are the same two input
    positions (3x3 windows at stride 2 share a row, a column or a corner). A build compares
    those two values once for all of them (either is first in row-major order in every window
    holding both), so they flip together. Returns (per window, flat over (N, C, L), its group's
    number: int64; per group, the flat index of its first window: int64). Kept on the kink
    while its ``decision`` and ``alt`` stay the same tensors, unchanged in place (a solve's
    every product reads the groups; finding them sorts every window)."""
    import torch
    # the tensors themselves are kept with their versions (an id alone could be a new tensor's)
    stamp = (kink.decision, kink.alt, kink.decision._version, kink.alt._version)
    kept = getattr(kink, "_pool_groups", None)
    if kept is not None and all(a is b for a, b in zip(kept[0][:2], stamp[:2])) \
            and kept[0][2:] == stamp[2:]:
        return kept[1]
    n, c, _ = kink.decision.shape
    hw = kink.x.shape[2] * kink.x.shape[3]
    nc = torch.arange(n * c, device=kink.decision.device).reshape(n, c, 1)
    key = ((nc * hw + kink.decision) * hw + kink.alt).reshape(-1)
    _, group = torch.unique(key, return_inverse=True)
    flat = torch.arange(group.numel(), device=group.device)
    first = torch.full((int(group.max()) + 1,), group.numel(), dtype=flat.dtype,
                       device=group.device).scatter_reduce(0, group, flat, reduce="amin")
    kink._pool_groups = (stamp, (group, first))
    return group, first


def group_sum(kink, t):
    """Per window of a pool ``kink``, the sum of ``t`` (a tensor of the windows' shape) over
    its :func:`pool_groups` group."""
    group, first = pool_groups(kink)
    flat = t.reshape(-1)
    return flat.new_zeros(first.shape).index_add_(0, group, flat)[group].reshape(t.shape)


def group_firsts(kink):
    """A boolean tensor of a pool ``kink``'s windows' shape: true at each :func:`pool_groups`
    group's first window (the one that stands for the group among the candidates)."""
    import torch
    group, first = pool_groups(kink)
    flat = torch.arange(group.numel(), device=group.device)
    return (first[group] == flat).reshape(kink.decision.shape)


def apply_mask(kink, sel) -> None:
    """Decide every element where ``sel`` is true otherwise in ``kink`` (pool: every window
    of the :func:`pool_groups` group of a window where it is true)."""
    import torch
    if kink.kind == "pool":
        sel = group_sum(kink, sel.to(torch.int64)) > 0
        kink.decision, kink.alt = (torch.where(sel, kink.alt, kink.decision),
                                   torch.where(sel, kink.decision, kink.alt))
    else:
        kink.decision = torch.where(sel, 1.0 - kink.decision, kink.decision)


def pushes(kink, coef):
    """The change of the gradient of ``kink``'s input (a tensor of its shape) when each of its
    elements (pool: windows) is decided otherwise by the amount ``coef`` (a tensor of the
    elements' shape; 1: the whole flip), from the output gradient ``dy0``. A pool window's
    coefficient moves its whole :func:`pool_groups` group (the sum over the group applies to
    each of its windows)."""
    if kink.kind == "pool":
        n, c = kink.x.shape[:2]
        moved = kink.dy0.reshape(n, c, -1) * group_sum(kink, coef)
        out = moved.new_zeros((n, c, kink.x.shape[2] * kink.x.shape[3]))
        out.scatter_add_(2, kink.alt, moved)
        out.scatter_add_(2, kink.decision, -moved)
        return out.reshape(kink.x.shape)
    return (1.0 - 2.0 * kink.decision) * kink.dy0 * coef


def moves(kink, derivative):
    """The transpose of :func:`pushes`: per element (pool: window) of ``kink``, the inner
    product of its flip's change of the input gradient with ``derivative`` (a tensor of the
    input's shape); a pool window's is its :func:`pool_groups` group's."""
    if kink.kind == "pool":
        n, c = kink.x.shape[:2]
        g = kink.dy0.reshape(n, c, -1)
        flat = derivative.reshape(n, c, -1)
        return group_sum(kink, g * (flat.gather(2, kink.alt) - flat.gather(2, kink.decision)))
    return (1.0 - 2.0 * kink.decision) * kink.dy0 * derivative


class Effects:
    """The flips of the candidate elements ``masks`` (per kink layer of ``layers``) as a linear
    map ``A`` from a coefficient per candidate to the change of every parameter gradient,
    weighted per parameter by ``inv`` (its scale's inverse), at the graph's present decisions
    and output gradients: :meth:`apply` is ``W A c`` (one backward pass from the kink inputs),
    :meth:`transpose` is ``A^T W v``: the transpose of that backward pass is the derivative
    of the kink inputs along ``W v`` (one forward pass in forward-mode differentiation, the
    graph's ``tangents``), and each candidate's inner product with it (:func:`moves`)."""

    def __init__(self, graph, layers: list[int], masks: list, params: list,
                 inv: list[float]):
        self.graph, self.layers = graph, layers
        self.kinks = [graph.kinks[i] for i in layers]
        self.masks = [masks[i] for i in layers]
        self.params, self.inv = params, inv

    def apply(self, coefs: list) -> list:
        import torch
        outs = [pushes(k, c * m) for k, c, m in zip(self.kinks, coefs, self.masks)]
        g = torch.autograd.grad([k.x for k in self.kinks], self.params, grad_outputs=outs,
                                retain_graph=True, allow_unused=True)
        return [(t if t is not None else torch.zeros_like(p)) * s
                for t, p, s in zip(g, self.params, self.inv)]

    def transpose(self, v: list) -> list:
        import torch
        jv = self.graph.tangents(self.params, [t * s for t, s in zip(v, self.inv)])
        return [torch.where(m, moves(k, jv[i]), 0.0)
                for i, k, m in zip(self.layers, self.kinks, self.masks)]


def dot(a: list, b: list) -> float:
    return sum(float((x * y).sum()) for x, y in zip(a, b))


def least_squares(effects: Effects, resid: list, iterations: int, probes: int,
                   gen) -> list:
    """The coefficients ``c`` per candidate (from 0) that minimise ``|W^(1/2) resid - W A c|``
    (``resid``: the unweighted residual per parameter): conjugate gradients on the normal
    equations (CGLS; Paige & Saunders 1982, ACM TOMS 8(1); Björck, "Numerical Methods for Least
    Squares Problems", 1996, 7.4), ``iterations`` steps, its columns scaled to unit length
    (Jacobi preconditioning). A column's squared length is estimated from ``probes`` random
    directions: for z ~ N(0, I), the mean square of ``(A^T W z)_i`` is the squared length of
    column i (Hutchinson 1990, Commun. Stat. Simul. 19(2)); ``gen``: their torch generator."""
    import torch
    zs = [[torch.randn(p.shape, generator=gen, dtype=p.dtype, device=p.device)
           for p in effects.params] for _ in range(probes)]
    sq = None
    for z in zs:
        t = [x.square() for x in effects.transpose(z)]
        sq = t if sq is None else [a + b for a, b in zip(sq, t)]
    # unit columns; a column of no length (a flip that moves nothing) stays out (scale 0)
    d = [torch.where(q > 0, (q / probes).rsqrt(), 0.0) for q in sq]
    r = [t * s for t, s in zip(resid, effects.inv)]
    g = [a * b for a, b in zip(effects.transpose(r), d)]
    y = [x.new_zeros(x.shape) for x in g]
    p, gamma = g, dot(g, g)
    first = gamma
    for _ in range(iterations):
        if gamma == 0.0:
            break
        q = effects.apply([a * b for a, b in zip(p, d)])
        qq = dot(q, q)
        if qq == 0.0:
            break
        alpha = gamma / qq
        y = [a + alpha * b for a, b in zip(y, p)]
        r = [a - alpha * b for a, b in zip(r, q)]
        g = [a * b for a, b in zip(effects.transpose(r), d)]
        new = dot(g, g)
        if new <= TOLERANCE * first:
            break
        p, gamma = [a + (new / gamma) * b for a, b in zip(g, p)], new
    return [a * b for a, b in zip(y, d)]


#: bulk following: rounds (each a least-squares solve at the present decisions, its flips taken,
#: the residual recomputed exactly), conjugate-gradient steps per solve, random directions for
#: its preconditioner; then the flips taken, the candidates whose coefficient is still above
#: POLISH_FROM (at most POLISH) and the POLISH nearest to their kink are weighed one at a time
ROUNDS, ITERATIONS, PROBES, POLISH_FROM, POLISH = 6, 60, 8, 0.1, 100
#: CGLS stops when the normal equations' residual falls below this share of its first
TOLERANCE = 1e-10


def weighted_residual(loss, graph, params: list, want: list, inv: list[float]):
    """(the residual ``want`` minus the gradients of ``params`` at the graph's present
    decisions, per parameter; its squared norm weighted by ``inv`` squared), after one backward
    pass that also leaves each kink's output gradient in ``dy0``."""
    import torch
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    for k in graph.kinks:
        k.dy0 = k.dy
    r = [w - g for w, g in zip(want, grads)]
    return r, sum(float((t * s).square().sum()) for t, s in zip(r, inv))


def follow_bulk(loss, graph, masks: list, params: list, want: list,
                inv: list[float]) -> list[tuple[int, int]]:
    """Take the flips among ``masks`` (:func:`thomas_tune.kinks.ambiguous_masks`) that bring
    the float64 gradients closer to ``want`` (the build's), all candidates at once. A flip's
    effect on the gradients is linear in the flip for fixed output gradients, so which flips
    explain the residual is a least-squares problem over all candidates (:class:`Effects`,
    :func:`least_squares`); the candidates whose coefficient passes 1/2 are flipped, and the
    flips are kept when the exact weighted squared residual falls. Flips interact through the
    output gradients of earlier kinks, so it is repeated from the new decisions (a flip taken
    can be undone the same way). Leaves the graph's decisions so; returns the candidates the
    last solve leaves half-explained (coefficient above :data:`POLISH_FROM`; (kink layer, flat
    element index) pairs), for :func:`thomas_tune.kinks.follow`."""
    import torch
    layers = [i for i, m in enumerate(masks) if m is not None]
    if not layers:
        return []
    gen = torch.Generator(device=params[0].device).manual_seed(0)

    def residual():
        return weighted_residual(loss, graph, params, want, inv)

    resid, now = residual()
    for _ in range(ROUNDS):
        effects = Effects(graph, layers, masks, params, inv)
        coefs = least_squares(effects, resid, ITERATIONS, PROBES, gen)
        sels = [c > 0.5 for c in coefs]
        del effects
        if not any(bool(s.any()) for s in sels):
            break
        for i, sel in zip(layers, sels):
            apply_mask(graph.kinks[i], sel)
        trial, c = residual()
        if c >= now:
            for i, sel in zip(layers, sels):
                apply_mask(graph.kinks[i], sel)  # undone: the same elements flipped back
            residual()
            break
        resid, now = trial, c
    effects = Effects(graph, layers, masks, params, inv)
    coefs = least_squares(effects, resid, ITERATIONS, PROBES, gen)
    del effects
    # what the solve still half-explains, the strongest first: weighed one at a time
    cands = []
    for i, c in zip(layers, coefs):
        flat = c.reshape(-1)
        for j in (flat > POLISH_FROM).nonzero().reshape(-1).tolist():
            cands.append((float(flat[j]), (i, j)))
    cands.sort(key=lambda cf: -cf[0])
    return [f for _, f in cands[:POLISH]]
