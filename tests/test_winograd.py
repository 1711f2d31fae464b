"""The Winograd form of stride-1 convolutions (``thomas_tune/training_graph/winograd_form.py``,
schedules in ``schedules/winograd.py``): its transforms against the definition, whole layers and
data gradients on PoCL against numpy in float64, the schedules MetaSchedule tunes, the choice of
form from kernel times, and the tasks of both forms."""

import dataclasses
import json

import numpy as np
import pytest
import tvm
from numpy.lib.stride_tricks import sliding_window_view
from tvm import relax

from thomas_tune import opencl
from thomas_tune.training_graph import winograd_form as W
from thomas_tune.tasks import choose_winograd, extract, fuse, kernel_calls, workload_key

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard


@pytest.mark.parametrize("m,r", [(2, 3), (2, 5), (4, 3)])
def test_transform_matrices_compute_the_correlation(m, r, rng):
    at, g, bt = W.transform_matrices(m, r)
    alpha = m + r - 1
    assert at.shape == (m, alpha) and g.shape == (alpha, r) and bt.shape == (alpha, alpha)
    for _ in range(5):
        d, f = rng.standard_normal(alpha), rng.standard_normal(r)
        want = np.array([d[i:i + r] @ f for i in range(m)])
        np.testing.assert_allclose(at @ ((g @ f) * (bt @ d)), want, rtol=1e-12, atol=1e-12)
    # the 2-D form, as the kernels compute it
    d, f = rng.standard_normal((alpha, alpha)), rng.standard_normal((r, r))
    want = sliding_window_view(d, (r, r)).reshape(m, m, r * r) @ f.reshape(-1)
    np.testing.assert_allclose(at @ ((g @ f @ g.T) * (bt @ d @ bt.T)) @ at.T, want,
                               rtol=1e-12, atol=1e-12)


def test_unsupported_tile_sizes_are_refused():
    with pytest.raises(ValueError, match="F\\(6, 5\\)"):
        W.transform_matrices(6, 5)


def _layer(dtype: str, r: int, p: int, shape=(2, 5, 9, 11), c_out=6):
    """conv2d(x, w) + b, ReLU, and the transposed convolution of dy by w (a data gradient),
    all stride 1 with padding p; returns the module."""
    n, c, h, w_ = shape
    oh, ow = h + 2 * p - r + 1, w_ + 2 * p - r + 1
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType((c_out, c, r, r), dtype))
    b = relax.Var("b", relax.TensorType((1, c_out, 1, 1), dtype))
    dy = relax.Var("dy", relax.TensorType((n, c_out, oh, ow), dtype))
    with bb.function("main", [x, w, b, dy]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=[p] * 4))
            z = bb.emit(relax.op.nn.relu(relax.op.add(y, b)))
            dx = bb.emit(relax.op.nn.conv2d_transpose(dy, w, padding=[p] * 4,
                                                      kernel_layout="IOHW"))
            out = bb.emit_output(relax.Tuple([z, dx]))
        bb.emit_func_output(out)
    return bb.get()


def _forward_only(dtype: str, r: int, p: int, shape=(2, 5, 9, 11), c_out=6):
    """ReLU(conv2d(x, w) + b), stride 1 with padding p, as an inference module has it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType((c_out, shape[1], r, r), dtype))
    b = relax.Var("b", relax.TensorType((1, c_out, 1, 1), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=[p] * 4))
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, b)))
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, w, b, dy, p):
    """numpy: ReLU(correlation of x with w, padded by p, + b), and the transposed
    convolution of dy by w (each dy value scattered through the filter), in float64."""
    r = w.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    y = np.einsum("nchwab,ocab->nohw", sliding_window_view(xp, (r, r), axis=(2, 3)), w)
    z = np.maximum(y + b, 0)
    n, _, oh, ow = dy.shape
    full = np.zeros((n, w.shape[1], oh + r - 1, ow + r - 1))
    for a in range(r):
        for c in range(r):
            full[:, :, a:a + oh, c:c + ow] += np.einsum("nihw,io->nohw", dy, w[:, :, a, c])
    h, wd = x.shape[2:]
    return z, full[:, :, p:p + h, p:p + wd]


@needs_opencl
@pytest.mark.parametrize("r,p", [(3, 1), (5, 2), (3, 0)])
def test_winograd_layers_and_data_gradients_match_numpy(r, p, rng):
    from thomas_tune.compiler.compile import compile_graph
    mod = _layer("float64", r, p)
    assert len(W.convolutions(mod)) == 2
    target = opencl.target_for(0)
    exe = compile_graph(mod, target, None, W.convolutions(mod))  # default schedules
    names = [gv.name_hint for gv in fuse(mod, "all").functions]
    assert any("winograd_matmul" in n for n in names)
    args = [rng.standard_normal([int(d) for d in v.ty.shape]) for v in mod["main"].params]
    dev = tvm.opencl(0)
    got = relax.VirtualMachine(exe, dev)["main"](*[tvm.runtime.tensor(a, dev) for a in args])
    for g, want in zip(got, _reference(*args, p)):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-10, atol=1e-10)


@needs_opencl
def test_transform_design_spaces_unroll_their_tiles_and_match_numpy(rng):
    """Each transform's one design space (the custom rule, a sampled work-group size) keeps
    the tile loops unrolled and the input tile in registers; its kernel computes what the
    default schedule computes."""
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.schedules import default_gpu_schedules, postprocessed, space_generator
    target = opencl.target_for(0)
    fused = fuse(_layer("float32", 3, 1), "all")
    dev = tvm.opencl(0)
    for gv, func in fused.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or "winograd_matmul" in gv.name_hint \
                or "winograd" not in gv.name_hint:
            continue
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_generator(target),
                             search_strategy="replay-trace", task_name=gv.name_hint,
                             num_threads=1)
        spaces = ctx.space_generator.generate_design_space(mod)
        assert len(spaces) == 1, gv.name_hint
        trace = spaces[0].trace
        kinds = [inst.kind.name for inst in trace.insts]
        assert "Unroll" in kinds and "SampleCategorical" in kinds, (gv.name_hint, kinds)
        if "input" in gv.name_hint:
            assert "SetScope" in kinds and "ComputeAt" in kinds, kinds  # tile in registers
        tuned = postprocessed(mod, trace.as_json(), ctx.space_generator.postprocs, seed=3)
        assert tuned is not None, gv.name_hint
        shapes = [[int(d) for d in info.shape] for info in ms.arg_info.ArgInfo.from_prim_func(func)]
        inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
        res = []
        for m in (tuned.mod, default_gpu_schedules(mod, target)):
            args = [tvm.runtime.tensor(a, dev) for a in inputs]
            tvm.compile(m, target)["main"](*args)
            res.append(args[-1].numpy())
        np.testing.assert_allclose(res[0], res[1], rtol=1e-6, atol=1e-6)


def test_the_faster_form_is_chosen_from_kernel_times():
    mod = _layer("float32", 3, 1)
    convs = W.convolutions(mod)
    base = kernel_calls(fuse(mod))
    wino = {k for k in kernel_calls(fuse(mod, "all")) if k not in base}

    def times(direct_ms, wino_ms, missing=()):
        def ms(key):
            if key in missing:
                return None
            return wino_ms if key in wino else direct_ms
        return ms

    # a module with data gradients (a training step): its forward convolution stays direct,
    # however fast its Winograd kernels
    gradients = {c for c in convs if c.transposed}
    assert gradients and gradients != convs
    assert choose_winograd(mod, times(1.0, 0.01)) == gradients
    # a forward pass alone (an inference module) takes it where it is faster
    forward = _forward_only("float32", 3, 1)
    fwd_base = kernel_calls(fuse(forward))
    fwd_wino = {k for k in kernel_calls(fuse(forward, "all")) if k not in fwd_base}
    assert choose_winograd(forward, lambda k: 0.01 if k in fwd_wino else 1.0) \
        == W.convolutions(forward) != set()
    # as an export's manifest keeps them, and the bench reads them back
    assert {W.Conv.from_dict(json.loads(json.dumps(dataclasses.asdict(c)))) for c in convs} \
        == convs
    assert choose_winograd(mod, times(0.01, 1.0)) == set()
    # a Winograd kernel that was never timed: the direct form stays
    assert choose_winograd(mod, times(1.0, 0.01, missing=wino)) == set()
    # ... unless its default schedule's time is known: asked once per kernel, with the
    # workload of each, and only for kernels without a time
    asked = []

    def untimed(workloads):
        asked.extend(workloads)
        assert all(isinstance(m["main"], tvm.tirx.PrimFunc) for m in workloads.values())
        return {k: 0.01 for k in workloads}
    assert choose_winograd(mod, times(1.0, 0.01, missing=wino), untimed) == gradients
    assert asked and set(asked) <= wino and len(asked) == len(set(asked))
    assert choose_winograd(mod, times(1.0, 0.01, missing=wino), lambda w: {}) == set()
    # direct kernels that were never timed count as free: the direct form stays
    assert choose_winograd(mod, times(None, 0.01, missing=set(base))) == set()
    # a 5x5 layer's data gradient stays direct in a training step (its rounding reaches the
    # gradients below it), and its Winograd kernels are not extracted for tuning; a forward
    # pass alone takes the form for both sizes
    five = _layer("float32", 5, 2)
    assert {c.r for c in W.convolutions(five)} == {5} and W.candidates(five) == set()
    assert choose_winograd(five, lambda k: 1.0 if k in kernel_calls(fuse(five)) else 0.01) \
        == set()
    target = tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"})
    assert not any("winograd" in t.name for t in extract({"g": five}, target))
    assert W.candidates(_forward_only("float32", 5, 2)) == W.convolutions(
        _forward_only("float32", 5, 2)) != set()
    # a module with nothing to rewrite is not fused again
    plain = _layer("float32", 1, 0)
    assert W.convolutions(plain) == set()
    assert choose_winograd(plain, times(1.0, 0.01)) == set()


def test_tasks_of_both_forms_are_extracted_once_each():
    mod = _layer("float32", 3, 1)
    target = tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"})
    both = extract({"g": mod}, target)
    direct = extract({"g": mod}, target, {"g": set()})
    wino = extract({"g": mod}, target, {"g": W.candidates(mod)})
    keys = lambda ts: {workload_key(t.mod["main"]) for t in ts}  # noqa: E731
    assert keys(both) == keys(direct) | keys(wino)
    assert any("winograd_matmul" in t.name for t in both)
    assert not any("winograd" in t.name for t in direct)
    # a kernel both forms call is counted once, not twice
    shared = keys(direct) & keys(wino)
    by_key = {workload_key(t.mod["main"]): t for t in both}
    for k in shared:
        assert by_key[k].calls["g"] == {workload_key(t.mod["main"]): t
                                        for t in direct}[k].calls["g"]
