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
:func:`thomas_tune.training_graph.gradients.max_pool2d_grad_te`). The forward pass records every
kink's input and marks as **ambiguous** the elements within ``delta`` of the kink: ``delta`` per
kink layer is :data:`DELTA_FACTOR` times the largest difference between PyTorch float32's and
float64's input of that kink over the batch (a measurement of the forward's rounding there).

The build's decisions are read from its gradients (:func:`follow`): only an ambiguous element
may be decided otherwise than float64 decides it; the effect of deciding one otherwise (its
*flip*) on every parameter gradient is computed exactly in float64 (the backward of the moved
output gradient from that kink's input), and the flips that bring the float64 gradients closer
to the build's are taken, one at a time, largest first
(:func:`thomas_tune.flip_exact.follow_exact`). Overlapping pool windows whose first maximum
and runner-up are the same two elements are one candidate: the build compares those two
values once for all of them, and their flips, of opposite signs, may explain it only together
(:func:`thomas_tune.flip_solve.pool_groups`). Past :data:`MAX_FLIPS` candidates (a 224-px step
has tens of thousands: ReLU6 inputs within rounding of 0 or 6, pool windows whose constant
squares tie), they are weighed all at once first: a flip's effect on the gradients is linear in
it for fixed output gradients, so the flips that explain the residual solve a least-squares
problem over every candidate, whose matrix is applied by one backward pass and its transpose by
one forward pass in forward-mode differentiation (:func:`thomas_tune.flip_solve.follow_bulk`,
:meth:`KinkGraph.tangents`); the flips it takes, what it leaves half-explained and the
candidates nearest their kink are then weighed one at a time; the same where one flip at a time
leaves a parameter over the bounds' floor (flips that explain the build only together); where a
flip is taken, the elements of its layer with the same float64 input are tried with it, all at
once (:func:`thomas_tune.flip_exact.follow_groups`: a build rounds equal values alike). The
reference is the float64 step with those decisions, recomputed whole; it and the build differ
by rounding only, on every batch. A mutant cannot hide behind this: the flips it could use are
single elements within rounding of a kink, and each flip taken is listed
(:attr:`Following.flips`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from .flip_exact import Flip, changed, distance, follow_exact, follow_groups, restore
from . import half_reference as H
from .flip_solve import POLISH, follow_bulk, group_firsts, group_sum
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

        @staticmethod
        def jvp(ctx, dx, *_):
            return dx * ctx.kink.decision

    class Pool(torch.autograd.Function):
        """max_pool2d whose backward scatters each window's gradient to ``kink.decision``."""

        @staticmethod
        def forward(ctx, x, kink, kernel, stride, padding):
            out, _ = F.max_pool2d(x, kernel, stride, padding, return_indices=True)
            ctx.kink, ctx.shape, ctx.out_shape = kink, x.shape, out.shape
            return out

        @staticmethod
        def backward(ctx, dy):
            ctx.kink.dy = dy
            n, c, h, w = ctx.shape
            dx = dy.new_zeros((n, c, h * w))
            dx.scatter_add_(2, ctx.kink.decision, dy.reshape(n, c, -1))
            return dx.reshape(n, c, h, w), None, None, None, None

        @staticmethod
        def jvp(ctx, dx, *_):
            n, c = ctx.shape[:2]
            return dx.reshape(n, c, -1).gather(2, ctx.kink.decision).reshape(ctx.out_shape)

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
    (``<layer>.bias``), the tensor it is added into (:attr:`bias_outputs`), and per BatchNorm
    weight (``<layer>.weight``) the normalised input it multiplies (:attr:`bn_normalised`,
    detached), for the natural scales of their gradients (:func:`term_sums`)."""

    def __init__(self, *args, half: bool = False, trainable=None, halves=None, **kwargs):
        super().__init__(*args, **kwargs)
        #: layer outputs rounded to float16 where a mixed16 step stores them
        #: (:mod:`thomas_tune.half_reference`); ``trainable``: the names of the trainable
        #: parameters (default: those that require a gradient); ``halves``: the float16
        #: tensors the build stored on this batch, in order (half only): each place rounded
        #: as the build rounded it where within one float16 step
        #: (:func:`thomas_tune.half_reference.round_like`), counted in :attr:`aligned`
        self.half = half
        self.halves = list(halves) if halves is not None else None
        self.aligned = H.Aligned()
        self.trainable = set(trainable if trainable is not None else
                             (n for n, t in self.p.items() if t.requires_grad))
        self.kinks: list[Kink] = []
        self.bias_outputs: dict[str, object] = {}
        self.bn_normalised: dict[str, object] = {}
        self._masked, self._pool = _functions()
        self._made = (args, dict(kwargs, half=half, trainable=self.trainable, halves=halves))
        #: half only: the last frozen convolution without bias, its output not yet rounded
        #: (:meth:`conv2d`), as (output, input, name, stride, padding, groups), else None
        self._pending = None
        #: (model, input batch) of the forward pass run on it, for :meth:`tangents`
        self.source = None

    def tangents(self, params: list, directions: list) -> list:
        """Per kink (in :attr:`kinks`' order), the derivative of its input when ``params``
        (tensors of this graph's parameters) move along ``directions`` (a tensor of each
        one's shape; the other parameters stay),
        the kinks decided as they are now: the forward pass run again in forward-mode
        differentiation (``J u``, the transpose of the backward pass from the kink inputs to
        the parameters, ``J^T g``). A kink input that does not move gets zeros. Needs
        :attr:`source`."""
        import torch
        import torch.autograd.forward_ad as fw
        model, x = self.source
        args, kwargs = self._made
        along = {id(p): d for p, d in zip(params, directions)}
        with fw.dual_level(), torch.no_grad(), warnings.catch_warnings():
            # (some of PyTorch's forward-mode formulas are scripted functions, and scripting
            # says it is deprecated)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
            params = {n: fw.make_dual(t.detach(), along[id(t)]) if id(t) in along
                      else t.detach() for n, t in args[0].items()}
            again = _Replay(self.kinks, params, *args[1:], **kwargs)
            model.forward(again, x)
            out = []
            for k in again.kinks:
                t = fw.unpack_dual(k.x).tangent
                out.append(t if t is not None else torch.zeros_like(fw.unpack_dual(k.x).primal))
        return out

    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        x = self._settle(x)
        if self.half:
            # a frozen convolution without bias is folded with the frozen BatchNorm after it
            # (the build's first, unfolded convolution is dead code, never stored): its
            # output is rounded when something other than that BatchNorm reads it
            pending = not bias and f"{name}.weight" not in self.trainable
            y = H.conv2d(self, name, x, stride, padding, groups, bias, rounded=not pending)
            self._pending = (y, x, name, stride, padding, groups) if pending else None
        else:
            y = super().conv2d(name, x, out_channels, kernel, stride, padding, groups, bias)
        if bias:
            self.bias_outputs[f"{name}.bias"] = y
        return y

    def linear(self, name, x, out_features):
        y = self._stored(super().linear(name, self._settle(x), out_features))
        self.bias_outputs[f"{name}.bias"] = y
        return y

    def residual(self, a, b):
        return self._stored(super().residual(self._settle(a), self._settle(b)))

    def adaptive_avg_pool2d(self, x, output_size):
        x = self._settle(x)
        y = super().adaptive_avg_pool2d(x, output_size)
        return x if y.shape == x.shape else self._stored(y)  # the identity: no kernel, no store

    def dropout(self, name, x, p):
        x = self._settle(x)
        y = super().dropout(name, x, p)
        return y if y is x else self._stored(y)

    def _stored(self, y):
        """``y`` as a mixed16 step stores it (rounded to float16) when :attr:`half`."""
        return self.round_stored(y) if self.half else y

    def round_stored(self, y):
        """``y`` rounded to float16 at the next place a mixed16 step stores: as the build
        rounded it where :attr:`halves` are given and within one float16 step, else to the
        nearest (:mod:`thomas_tune.half_reference`). Raises ValueError when the build stored
        fewer tensors than the reference rounds, or one of another shape."""
        if self.halves is None:
            return H.round_half(y)
        i = self.aligned.places
        if i >= len(self.halves):
            raise ValueError(f"the build stored {len(self.halves)} float16 tensors; the "
                             "reference rounds more: its places are not the build's")
        return H.round_like(y, self.halves[i], self.aligned)

    def _settle(self, x):
        """``x`` as a layer reads it: a frozen convolution's output not folded (see
        :meth:`conv2d`) rounded now."""
        if self._pending is not None and x is self._pending[0]:
            return self.round_stored(x)
        return x

    def flatten(self, x):
        return super().flatten(self._settle(x))

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        training = self.bn_training and name not in self.frozen_bn
        if self.half and not training:  # stored before its activation, folded where built so
            conv = self._pending  # folded into the frozen convolution that made x
            folds = conv is not None and conv[0] is x
            y = H.inference_batch_norm(self, name, x if folds else self._settle(x), eps,
                                       conv if folds else None)
        else:
            x = self._settle(x)
            y = super().batch_norm(name, x, eps, momentum, None)
        self.bias_outputs[f"{name}.bias"] = y
        # x-hat, the weight's factor: the batch's statistics in the training form, the
        # running ones in the inference form (no running statistic updated here)
        self.bn_normalised[f"{name}.weight"] = self.F.batch_norm(
            x.detach(), None if training else self.s[f"{name}.running_mean"],
            None if training else self.s[f"{name}.running_var"], None, None, training, 0.0,
            eps)
        out = self._activate(y, act)
        if act is not None:
            self.kinks[-1].layer = name
        # the training form's one kernel stores its activation's output; the inference form's
        # activation reads the stored output, and its own output is stored again (the same
        # float16 values: rounding commutes with ReLU and ReLU6)
        return self._stored(out) if training or act is not None else out

    def _activate(self, x, act):
        """``x`` after ``act`` (None, ``"relu"`` or ``"relu6"``), not stored (a BatchNorm's)."""
        return x if act is None else self._masked_kink(x, act, None if act == "relu" else 6.0)

    def _masked_kink(self, x, kind, hi):
        x = self._settle(x)
        d = (x > 0) if hi is None else (x > 0) & (x < hi)
        k = Kink(kind, x, d.to(x.dtype))
        self.kinks.append(k)
        return self._masked.apply(x, k, hi)

    def relu(self, x):
        """A layer's ReLU: it reads a stored output (a convolution's or a linear layer's with
        its bias), and a mixed16 step stores its output again (the same float16 values)."""
        return self._stored(self._masked_kink(x, "relu", None))

    def relu6(self, x):
        """A layer's ReLU6, stored as :meth:`relu`'s output is."""
        return self._stored(self._masked_kink(x, "relu6", 6.0))

    def max_pool2d(self, x, kernel, stride, padding=0):
        x = self._settle(x)
        first, alt, gap = _pool_windows(x, kernel, stride, padding)
        k = Kink("pool", x, first, alt, gap)
        self.kinks.append(k)
        # (the build stores it: the largest of float16 values, so rounding leaves it as it is)
        return self._stored(self._pool.apply(x, k, kernel, stride, padding))


class _Replay(KinkGraph):
    """A :class:`KinkGraph` whose kinks take the decisions of ``given`` (another pass's kinks
    of the same network, in order) instead of their own."""

    def __init__(self, given: list[Kink], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._given = iter(given)

    def _masked_kink(self, x, kind, hi):
        x = self._settle(x)
        k = Kink(kind, x, next(self._given).decision)
        self.kinks.append(k)
        return self._masked.apply(x, k, hi)

    def max_pool2d(self, x, kernel, stride, padding=0):
        x = self._settle(x)
        g = next(self._given)
        k = Kink("pool", x, g.decision, g.alt)
        self.kinks.append(k)
        return self._stored(self._pool.apply(x, k, kernel, stride, padding))


def term_sums(loss, graph: KinkGraph) -> dict[str, np.ndarray]:
    """The sums of absolute terms of the gradients that are sums over (N, H, W) of one
    product per position, per channel (float64): per bias, of |the gradient of the tensor it
    is added into|; per BatchNorm weight, of |that gradient x the normalised input x-hat|
    (the weight's gradient is the sum of their products). A gradient's natural scale where it
    cancels: a bias before a training-form BatchNorm, and the weight of a BatchNorm whose
    output reaches the next training-form BatchNorm through a ReLU (its bias 0) and a
    depthwise convolution, channel by channel, which the weight scales alike (MobileNetV1's
    first BatchNorm and its pointwise ones with fresh parameters): zero in exact arithmetic
    but for the next BatchNorm's epsilon."""
    import torch
    names = [n for n, t in graph.bias_outputs.items() if t.requires_grad]
    outs = torch.autograd.grad(loss, [graph.bias_outputs[n] for n in names], retain_graph=True)
    out = {}
    for n, g in zip(names, outs):
        dims = [d for d in range(g.dim()) if d != 1]
        out[n] = g.abs().sum(dim=dims).detach().cpu().numpy()
        weight = n[:-len("bias")] + "weight"
        if weight in graph.bn_normalised and graph.p[weight].requires_grad:
            terms = (g * graph.bn_normalised[weight]).abs()
            out[weight] = terms.sum(dim=dims).detach().cpu().numpy()
    return out


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
    through (in the frozen part) or with no such element. Of the pool windows one comparison
    decides (:func:`thomas_tune.flip_solve.pool_groups`), only the first is a candidate: its
    flip moves them all."""
    import torch
    out = []
    for k, r in zip(kinks64, rounding):
        if not k.x.requires_grad or k.dy0 is None:
            out.append(None)  # in the frozen part: no gradient passes through it
            continue
        m = (distance(k) <= DELTA_FACTOR * r) & (k.dy0.reshape(k.gap.shape if k.kind == "pool"
                                                                else k.x.shape) != 0)
        if k.kind == "pool":  # a group of windows one comparison decides: one candidate
            m = group_sum(k, m.to(torch.int64)).gt(0) & group_firsts(k)
        out.append(m if bool(m.any()) else None)
    return out




def ambiguous_elements(kinks64: list[Kink], rounding: list[float],
                       masks: list | None = None, nearest: int | None = None) -> list[Flip]:
    """The elements of :func:`ambiguous_masks` (or of ``masks``, already made by it), each as
    a :class:`Flip` with its distance; with ``nearest``, only that many, the nearest to their
    kink first (chosen on the device: a 224-px batch has a million)."""
    import torch
    found = [(i, m.reshape(-1).nonzero().reshape(-1), distance(k).reshape(-1))
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
        follow_exact(loss, graph, ambiguous_elements(graph.kinks, rounding), params, want,
                      inv, start)
        follow_groups(loss, graph, start, params, want, inv)
        grads, err = worst()
        if err <= within or count == 0:  # (no candidate: nothing else to follow)
            return Following(float(loss.detach()), numpy_of(names, grads),
                             changed(graph, start), count, 0)
        # one flip at a time did not explain the build (flips whose effects only add up
        # together): all at once, from float64's own decisions again
        for k, d in zip(graph.kinks, start):
            restore(k, d)
    for _ in range(ATTEMPTS):  # each from the decisions the one before left
        # what the solve half-explains, and the flips taken so far (each may be undone)
        half = [Flip(i, graph.kinks[i].kind, j, 0.0)
                for i, j in follow_bulk(loss, graph, masks, params, want, inv)]
        near = ambiguous_elements(graph.kinks, rounding, masks, POLISH)
        follow_exact(loss, graph, changed(graph, start) + half + near, params, want, inv,
                      start)
        follow_groups(loss, graph, start, params, want, inv)
        grads, err = worst()
        if err <= within:
            break
    return Following(float(loss.detach()), numpy_of(names, grads), changed(graph, start),
                     count, 0)


#: rounds of bulk following and weighing one at a time, while a parameter stays over the floor
ATTEMPTS = 2


def numpy_of(names, grads) -> dict[str, np.ndarray]:
    """name -> float64 numpy array of each tensor of ``grads``."""
    return {n: g.detach().cpu().numpy().astype("float64") for n, g in zip(names, grads)}
