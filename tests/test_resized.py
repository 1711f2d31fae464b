"""Schedules carried across shapes (thomas_tune.tuning.resized): tile decisions refitted to
other extents, kernel families, and a refitted trace built and run on llvm against numpy in
float64."""

import numpy as np
import pytest
import tvm
from tvm import te, topi
from tvm.s_tir import meta_schedule as ms

from thomas_tune.tuning.resized import (extents, family, refit_tile, refitted,
                                        shape_distance)


def _conv(n, c, k, hw, kernel=1, stride=1, groups=1):
    x = te.placeholder((n, c, hw, hw), name="x")
    w = te.placeholder((k, c // groups, kernel, kernel), name="w")
    pad = kernel // 2
    if groups == 1:
        y = topi.nn.conv2d_nchw(x, w, stride, pad, 1)
    else:
        y = topi.nn.group_conv2d_nchw(x, w, stride, pad, 1, groups)
    return tvm.IRModule({"main": te.create_prim_func([x, w, y])})


def _conv_ref(x, w, stride, groups):
    """float64 NCHW convolution with 'same' padding for odd kernels (numpy)."""
    n, c, hw, _ = x.shape
    k, cg, kh, _ = w.shape
    pad = kh // 2
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out_hw = (hw + 2 * pad - kh) // stride + 1
    y = np.zeros((n, k, out_hw, out_hw))
    per = k // groups
    for f in range(k):
        g = f // per
        for i in range(kh):
            for j in range(kh):
                patch = xp[:, g * cg:(g + 1) * cg, i:i + stride * out_hw:stride,
                           j:j + stride * out_hw:stride]
                y[:, f] += np.einsum("nchw,c->nhw", patch, w[f, :, i, j])
    return y


def test_refit_tile_multiplies_to_the_extent_and_keeps_inner_factors(rng):
    for _ in range(300):
        levels = int(rng.integers(2, 6))
        factors = [int(v) for v in 2 ** rng.integers(0, 4, levels)]
        extent = int(rng.integers(1, 600))
        out = refit_tile(factors, extent)
        assert int(np.prod(out)) == extent, (factors, extent, out)
        assert all(1 <= o <= f for o, f in zip(out[1:], factors[1:])), (factors, extent, out)
        # where an inner factor divides what is left, it is kept as it was
        rest = extent
        for i in range(levels - 1, 0, -1):
            if rest % factors[i] == 0:
                assert out[i] == factors[i], (factors, extent, out)
            rest //= out[i]
    assert refit_tile([7, 1, 8, 2], 7 * 8 * 2) == [7, 1, 8, 2]  # same extent: unchanged
    assert refit_tile([1, 4, 8], 14) == [1, 2, 7]
    with pytest.raises(ValueError):
        refit_tile([2, 2], 0)


def test_families_join_shapes_and_part_structures():
    a, b = _conv(1, 8, 16, 8), _conv(2, 12, 24, 6)
    assert family(a) == family(b)
    assert extents(a) != extents(b) and len(extents(a)) == len(extents(b))
    assert shape_distance(extents(a), extents(a)) == 0.0
    assert shape_distance(extents(a), extents(b)) > 0.0
    assert shape_distance(extents(a), extents(_conv(1, 8, 32, 8))) < \
        shape_distance(extents(a), extents(b))
    assert family(_conv(1, 8, 16, 8, kernel=3)) != family(a)  # a padded 3x3 window
    assert family(_conv(1, 8, 16, 8, kernel=3, stride=2)) != \
        family(_conv(1, 8, 16, 8, kernel=3))  # a strided read
    assert family(_conv(1, 8, 8, 8, kernel=3, groups=8)) != \
        family(_conv(1, 8, 8, 8, kernel=3))  # depthwise
    with pytest.raises(ValueError):
        shape_distance((1, 2), (1, 2, 3))


@pytest.mark.parametrize("shapes", [((1, 8, 16, 8, 3, 1, 1), (2, 12, 20, 10, 3, 1, 1)),
                                    ((1, 16, 16, 8, 3, 2, 16), (1, 24, 24, 14, 3, 2, 24))])
def test_a_refitted_trace_computes_the_other_kernel(shapes, rng):
    (n, c, k, hw, kern, stride, groups), theirs = shapes
    donor = _conv(n, c, k, hw, kern, stride, groups)
    mod = _conv(*theirs)
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    seed = int(rng.integers(1, 1 << 30))
    ctx = ms.TuneContext(mod=donor, target=target, space_generator="post-order-apply",
                         task_name="donor", rand_state=seed)
    refits = 0
    for space in ctx.generate_design_space():
        trace = refitted(space.trace.as_json(), donor, mod)
        assert trace is not None
        sch = tvm.s_tir.Schedule(mod)
        tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace, sch)
        # each tile decision multiplies to its loop's extent here, not the donor's
        again = tvm.s_tir.Schedule(mod)

        def looked_at(inst, inputs, attrs, decision):
            nonlocal refits
            if inst.kind.name == "SamplePerfectTile":
                extent = int(again.get(inputs[0]).extent)
                assert int(np.prod([int(f) for f in decision])) == extent
                refits += 1
            return decision

        sch.trace.apply_to_schedule(again, remove_postproc=True, decision_provider=looked_at)
        lib = tvm.compile(sch.mod, target=target)
        tn, tc, tk, thw, tkern, tstride, tgroups = theirs
        x = rng.normal(size=(tn, tc, thw, thw))
        w = rng.normal(size=(tk, tc // tgroups, tkern, tkern))
        want = _conv_ref(x, w, tstride, tgroups)
        dev = tvm.cpu()
        out = tvm.runtime.empty(want.shape, "float32", dev)
        lib(tvm.runtime.tensor(x.astype("float32"), dev),
            tvm.runtime.tensor(w.astype("float32"), dev), out)
        got = out.numpy()
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), \
            np.abs(got - want).max()
    assert refits > 0


def test_a_trace_that_does_not_replay_gives_none():
    x = te.placeholder((1, 8, 8, 8), name="x")
    w = te.placeholder((16, 8, 1, 1), name="w")
    y = topi.nn.relu(topi.nn.conv2d_nchw(x, w, 1, 0, 1))
    donor = tvm.IRModule({"main": te.create_prim_func([x, w, y])})  # a ReLU block to schedule
    mod = _conv(1, 8, 16, 8)  # which this kernel lacks
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    ctx = ms.TuneContext(mod=donor, target=target, space_generator="post-order-apply",
                         task_name="donor", rand_state=1)
    for space in ctx.generate_design_space():
        assert refitted(space.trace.as_json(), donor, mod) is None
