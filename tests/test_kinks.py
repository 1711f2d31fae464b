"""The branch-following reference (``thomas_tune.kinks``) on its own, with no build: a made-up
"build" whose gradients are float64's with a random part of the ambiguous kink elements decided
otherwise, plus noise of float32 rounding's size, is followed back by :func:`kinks.follow`,
one flip at a time (a few candidates) and all at once (past ``MAX_FLIPS``, as at 224 px); a
gradient 1% off on top of the same flips is explained by no set of flips. PyTorch on the CPU,
float64; the AlexNet of the tests (0.1@67, ReLU and max pools) and MobileNetV2 0.35@32 (ReLU6).
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

NETS = {"alexnet": dict(num_classes=5, resolution=67, width=0.1),
        "mobilenet_v2": dict(num_classes=5, resolution=32, width=0.35)}


@functools.lru_cache(maxsize=None)
def _inputs(arch, seed):
    """The model, tensors, check batch, dropout masks and parameter names of ``seed`` (each a
    trace of the model: made once per seed, the tests run a seed's step up to four times;
    ``torch_forward`` copies them)."""
    from thomas_tune.models import build, init_params, spec
    from thomas_tune.step_check import batch, dropout_masks
    model = build(arch, **NETS[arch])
    tensors = init_params(model, seed=int(seed) % 1000)
    x, y = batch(model, 8, int(seed))
    masks = dropout_masks(model, 8, int(seed))
    return model, tensors, x, y, masks, [p.name for p in spec(model).params]


def _forward(arch, seed, dtype="float64"):
    from thomas_tune.kink_step import torch_forward
    model, tensors, x, y, masks, names = _inputs(arch, int(seed))
    return torch_forward(model, tensors, names, x, y, device="cpu", dtype=dtype, masks=masks)


def _made_up_build(arch, seed, rng, noise, monkeypatch):
    """(rounding per kink layer, scales, the build's gradients, the elements decided
    otherwise): float64's step whose kink inputs are read with an error of ``noise`` x that
    layer's rounding (normal, per distinct value; pools: per window's gap) before each
    decision, as a float32 build's are, plus noise of 1e-8 of each scale on the gradients."""
    from thomas_tune import kinks
    from thomas_tune.flip_solve import apply_mask
    from thomas_tune.step_check import term_floor
    loss, g, params, names = _forward(arch, seed)
    _, g32, _, _ = _forward(arch, seed, "float32")
    rounding = [float((k32.x.detach().double() - k.x.detach()).abs().max())
                for k, k32 in zip(g.kinks, g32.kinks)]
    base = torch.autograd.grad(loss, params, retain_graph=True)
    for k in g.kinks:
        k.dy0 = k.dy
    masks = kinks.ambiguous_masks(g.kinks, rounding)
    flipped = 0
    for k, m, r in zip(g.kinks, masks, rounding):
        if m is None:
            continue
        # one error per distinct value: a build computes equal values (the constant squares'
        # insides) by the same arithmetic, so it reads them alike
        value = (k.gap if k.kind == "pool" else k.x.detach()).reshape(-1).numpy()
        _, which = np.unique(value, return_inverse=True)
        draw = rng.standard_normal(int(which.max()) + 1)[which]
        err = torch.as_tensor(noise * r * draw.reshape(tuple(m.shape)))
        if k.kind == "pool":
            sel = k.gap + err < 0  # the runner-up read as the larger
        else:
            x = k.x.detach() + err
            lo = (x > 0) if k.kind == "relu" else (x > 0) & (x < 6)
            sel = lo != (k.decision > 0)
        sel &= m
        apply_mask(k, sel)
        flipped += int(sel.sum())
    # each parameter's scale as the check takes it (a bias before a training-form BatchNorm,
    # whose gradient cancels, on the sum of its terms: step_check.following_step)
    sums = kinks.term_sums(loss, g)
    scales = {n: max(float(b.abs().max()), term_floor(n, sums.get(n)))
              for n, b in zip(names, base)}
    grads = torch.autograd.grad(loss, params)
    build = {n: gr.numpy() + 1e-8 * scales[n] * rng.standard_normal(gr.shape)
             for n, gr in zip(names, grads)}
    return rounding, scales, build, flipped


def _follow(arch, seed, rounding, scales, build):
    from thomas_tune import kinks
    loss, g, params, names = _forward(arch, seed)
    f = kinks.follow(loss, g, rounding, params, names, build, scales)
    worst = max(float(np.abs(f.grads[n] - build[n]).max()) / scales[n] for n in names)
    return f, worst


@pytest.mark.parametrize("arch,noise,max_flips", [
    ("alexnet", 2.0, 400), ("alexnet", 2.0, 0), ("mobilenet_v2", 2.0, 0)],
    ids=["alexnet-one-at-a-time", "alexnet-bulk", "mobilenet_v2-bulk"])
def test_following_finds_the_builds_decisions(arch, noise, max_flips, rng, monkeypatch):
    """Every gradient of the followed reference within 1e-6 of its scale of the made-up build
    (rounding noise 1e-8; a flip left unfollowed moves a gradient by 1e-4..1e-1 of it); with
    one gradient 1% off as well, the check's error stays above 5e-3."""
    from thomas_tune import kinks
    monkeypatch.setattr(kinks, "MAX_FLIPS", max_flips)
    for _ in range(12):  # a batch with a few flips that move a gradient
        seed = int(rng.integers(1 << 20))
        rounding, scales, build, flipped = _made_up_build(arch, seed, rng, noise, monkeypatch)
        if flipped >= 4:
            break
    assert flipped >= 4, flipped
    f, worst = _follow(arch, seed, rounding, scales, build)
    print(f"{arch}: {flipped} flipped, {len(f.flips)} followed of {f.ambiguous}; worst {worst:.1e}")
    assert worst < 1e-6 and f.unresolved == 0
    name = max(scales, key=lambda n: build[n].size * (not n.endswith("bias")))
    build[name] = build[name] * 1.01
    _, worst = _follow(arch, seed, rounding, scales, build)
    assert worst > 5e-3, worst


@pytest.mark.parametrize("arch", list(NETS))
def test_bulk_transpose_is_the_backward_pass_transposed(arch):
    """The bulk solve's ``A^T`` (a forward pass in forward-mode differentiation, the kinks
    decided as they are) is the transpose of its ``A`` (a backward pass from the kink inputs):
    ``<A c, v> = <c, A^T v>`` for random ``c`` and ``v``, to float64 rounding, with every
    element of every kink a candidate and a flip taken in each layer first (so the decisions
    are not float64's own). A transpose through other decisions, or a kink's derivative
    left out, breaks the identity by far more."""
    import torch
    from thomas_tune.flip_solve import Effects, weighted_residual
    from thomas_tune.flip_exact import Flip, apply_flip
    loss, g, params, _ = _forward(arch, 5)
    inv = [1.0 + i % 3 for i in range(len(params))]
    layers = [i for i, k in enumerate(g.kinks) if k.x.requires_grad]
    for i in layers:
        apply_flip(g.kinks[i], Flip(i, g.kinks[i].kind, 0, 0.0))
    weighted_residual(loss, g, params, [torch.zeros_like(p) for p in params], inv)
    masks = [None] * len(g.kinks)
    for i in layers:
        k = g.kinks[i]
        masks[i] = torch.ones(k.gap.shape if k.kind == "pool" else k.x.shape, dtype=torch.bool)
    effects = Effects(g, layers, masks, params, inv)
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    c = [torch.randn(m.shape, generator=gen, dtype=torch.float64) for m in effects.masks]
    v = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    lhs = sum(float((a * b).sum()) for a, b in zip(effects.apply(c), v))
    rhs = sum(float((a * b).sum()) for a, b in zip(c, effects.transpose(v)))
    assert abs(lhs - rhs) <= 1e-10 * abs(lhs), (lhs, rhs)


def _shared_pair(seed):
    """In the float64 step of the tests' AlexNet on check batch ``seed``: a pool layer and two
    overlapping windows of one image and channel whose largest and second-largest values are
    the same two elements (not tied), with output gradients of opposite signs within a factor
    2 of each other (so that moving either window's gradient alone takes float64 further from
    moving both), as (layer, flat window indices, gap); None if there is none."""
    loss, g, params, _ = _forward("alexnet", seed)
    torch.autograd.grad(loss, params)
    best = None
    for i, k in enumerate(g.kinks):
        if k.kind != "pool" or k.dy is None:
            continue
        dy = k.dy.reshape(k.decision.shape)
        n, c, per = k.decision.shape
        for b in range(n):
            for ch in range(c):
                pairs = {}
                for j in range(per):
                    if float(k.gap[b, ch, j]) > 0:
                        key = (int(k.decision[b, ch, j]), int(k.alt[b, ch, j]))
                        pairs.setdefault(key, []).append(j)
                for js in pairs.values():
                    if len(js) != 2:
                        continue
                    d1, d2 = (float(dy[b, ch, j]) for j in js)
                    if d1 * d2 < 0 and max(abs(d1), abs(d2)) < 2 * min(abs(d1), abs(d2)):
                        size = abs(d1 + d2)
                        if best is None or size > best[0]:
                            best = (size, i, [(b * c + ch) * per + j for j in js],
                                    float(k.gap[b, ch, js[0]]))
    return None if best is None else best[1:]


@pytest.mark.parametrize("max_flips", [400, 0], ids=["one-at-a-time", "bulk"])
def test_following_flips_the_windows_one_comparison_decides(max_flips, monkeypatch):
    """A build compares a pool's largest and second-largest value once for every window that
    holds both (overlapping windows of a 3x3, stride-2 pool share a row, a column or a
    corner): a made-up build reading the second as the larger sends both windows' gradients
    there. With the windows' gradients of opposite signs neither move alone brings float64
    closer (AlexNet@224's check, H100 log, batch 1: 8.0e-3 left on ``features.3.weight``);
    the followed reference explains the build within 1e-6 of every scale, and a gradient 1%
    off on top still fails."""
    from thomas_tune import kinks
    from thomas_tune.step_check import term_floor
    monkeypatch.setattr(kinks, "MAX_FLIPS", max_flips)
    seed, found = next((s, f) for s in range(40) if (f := _shared_pair(s)) is not None)
    layer, windows, gap = found
    loss, g, params, names = _forward("alexnet", seed)
    _, g32, _, _ = _forward("alexnet", seed, "float32")
    rounding = [float((k32.x.detach().double() - k.x.detach()).abs().max())
                for k, k32 in zip(g.kinks, g32.kinks)]
    # the pair within the layer's rounding (the build's float32 reads the gap otherwise)
    rounding[layer] = max(rounding[layer], 2.0 * gap / kinks.DELTA_FACTOR)
    base = torch.autograd.grad(loss, params, retain_graph=True)
    sums = kinks.term_sums(loss, g)
    scales = {n: max(float(b.abs().max()), term_floor(n, sums.get(n)))
              for n, b in zip(names, base)}
    k = g.kinks[layer]
    dec, alt = k.decision.reshape(-1), k.alt.reshape(-1)
    for j in windows:  # both windows: the build's one comparison
        dec[j], alt[j] = alt[j].clone(), dec[j].clone()
    grads = torch.autograd.grad(loss, params)
    rng = np.random.default_rng(seed)
    build = {n: gr.numpy() + 1e-8 * scales[n] * rng.standard_normal(gr.shape)
             for n, gr in zip(names, grads)}
    moved = max(float(np.abs(build[n] - b.numpy()).max()) / scales[n]
                for n, b in zip(names, base))
    assert moved > 1e-4, moved  # the pair moves a gradient visibly
    f, worst = _follow("alexnet", seed, rounding, scales, build)
    print(f"seed {seed}: windows {windows} of kink {layer} moved {moved:.1e}; "
          f"{len(f.flips)} followed of {f.ambiguous}; worst {worst:.1e}")
    assert worst < 1e-6
    name = max(scales, key=lambda n: build[n].size * (not n.endswith("bias")))
    build[name] = build[name] * 1.01
    _, worst = _follow("alexnet", seed, rounding, scales, build)
    assert worst > 5e-3, worst
