"""Long sums on a CPU (llvm): ``schedules.split_long_sums`` splits them into partial sums."""

import numpy as np
import tvm
from tvm import te

from thomas_tune.schedules import split_long_sums


def _rf_parts(func: tvm.tirx.PrimFunc, block: str) -> tuple[int, int]:
    """(parts, terms per part) of the split sum: the extents of the last two loops around the
    partial-sum block ``block`` (the part, then the term within it)."""
    sch = tvm.s_tir.Schedule(func)
    loops = sch.get_loops(sch.get_sblock(block))
    return int(sch.get(loops[-2]).extent), int(sch.get(loops[-1]).extent)


def test_a_sum_split_into_parts_leaves_no_part_empty(rng):
    """A bias gradient's sum over N x H x W = 4 x 27 x 27 = 2,916 terms per channel (AlexNet
    width 0.1 at 224 px, batch 4; 256 parts of 12 would leave 13 empty, whose partial sums
    were never set to zero): the split keeps every part non-empty and the result is numpy's
    in float64 to float32 rounding, for fresh inputs each run."""
    n, c, h = 4, 19, 27
    dy = te.placeholder((n, c, h, h), name="dy")
    rn, rh, rw = (te.reduce_axis((0, e)) for e in (n, h, h))
    db = te.compute((c,), lambda j: te.sum(dy[rn, j, rh, rw], axis=[rn, rh, rw]), name="db")
    mod = split_long_sums(tvm.IRModule({"main": te.create_prim_func([dy, db])}))
    assert "rf" in mod["main"].script()  # it was split
    parts, per_part = _rf_parts(mod["main"], "db_rf")
    terms = n * h * h
    assert parts * per_part >= terms and (parts - 1) * per_part < terms, (parts, per_part)
    lib = tvm.compile(mod, "llvm")
    x = rng.standard_normal((n, c, h, h)).astype("float32")
    out = tvm.runtime.tensor(np.full(c, np.nan, "float32"))
    lib["main"](tvm.runtime.tensor(x), out)
    want = x.astype("float64").sum(axis=(0, 2, 3))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


def test_a_forward_convolution_is_as_close_to_float64_as_pytorchs(rng):
    """AlexNet's second convolution (64 input channels, 5x5 filter: 1,600 terms per output)
    with its bias and ReLU, compiled for llvm as a step is: within 1.5x of PyTorch float32's
    error against float64 (largest difference over the largest value), on fresh inputs. Summed
    in one chain per output it was 2.0-3.6x PyTorch float32's over 20 seeds; in partial sums
    (``split_long_sums``) 0.41-0.91x (docs/journal/precision.md)."""
    import torch
    from tvm import relax

    from thomas_tune.compiler.compile import compile_graph

    n, ci, h, co, k = 2, 64, 27, 64, 5
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, ci, h, h), "float32"))
    w = relax.Var("w", relax.TensorType((co, ci, k, k), "float32"))
    b = relax.Var("b", relax.TensorType((1, co, 1, 1), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(x, w, padding=2), b))
            y = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(y)
    vm = relax.VirtualMachine(compile_graph(bb.get(), tvm.target.Target({"kind": "llvm"})),
                              tvm.cpu())
    for _ in range(3):
        xs = np.maximum(rng.standard_normal((n, ci, h, h)), 0).astype("float32")  # post-ReLU
        ws = (rng.standard_normal((co, ci, k, k)) / 40).astype("float32")
        bs = (rng.standard_normal((1, co, 1, 1)) / 10).astype("float32")

        def torch_conv(dtype):
            t = [torch.tensor(v, dtype=dtype) for v in (xs, ws, bs)]
            return torch.relu(torch.nn.functional.conv2d(t[0], t[1], padding=2) + t[2]).numpy()

        want = torch_conv(torch.float64)
        scale = np.abs(want).max()
        theirs = np.abs(torch_conv(torch.float32) - want).max() / scale
        got = vm["main"](*(tvm.runtime.tensor(v) for v in (xs, ws, bs))).numpy()
        ours = np.abs(got - want).max() / scale
        assert ours <= 1.5 * theirs, (ours, theirs)


_BUILD_UPDATE = r"""
import sys, numpy as np, tvm
from thomas_tune.training_graph.multi_tensor import update_kernel
from thomas_tune.schedules import split_long_loops
n, limit = int(sys.argv[1]), int(sys.argv[2])
func = update_kernel([(n,)] * 40, ("p", "g", "v"),
                     {"v_new": "T.float32(0.9) * v + g", "p_new": "p - T.float32(0.01) * v_new"},
                     inplace=True, counter="steps")
mod = tvm.IRModule({"main": func})
mod = split_long_loops(mod, limit=limit, inner=min(limit, 1 << 16))
sch = tvm.s_tir.Schedule(mod)
assert len(sch.get_loops(sch.get_sblock("update"))) == 2, mod["main"].script()
lib = tvm.compile(mod, tvm.target.Target("llvm"))
# run it on a few elements of real buffers: the split loop computes the same update
if n <= 4096:
    rng = np.random.default_rng(int(sys.argv[3]))
    args, want = [tvm.runtime.tensor(np.zeros((), "int64"))], []
    for _ in range(40):
        p, g, v = (rng.standard_normal(n).astype("float32") for _ in range(3))
        v_new = np.float32(0.9) * v + g
        want.append((p - np.float32(0.01) * v_new, v_new))
        args += [tvm.runtime.tensor(a) for a in (p, g, v)]
    lib(*args)
    for j, (p_new, v_new) in enumerate(want):
        np.testing.assert_allclose(args[1 + 3 * j].numpy(), p_new, rtol=1e-6)
        np.testing.assert_allclose(args[3 + 3 * j].numpy(), v_new, rtol=1e-6)
    assert int(args[0].numpy()) == 1
print("built")
"""


def test_a_long_update_loop_builds_for_a_cpu_within_bounded_memory(tmp_path, rng):
    """An optimizer update over 40 tensors of 1,048,576 elements (one loop of 41.9 M
    iterations, more than 80 stores each: over 2^31 steps) builds for llvm in a process
    limited to 4 GB once ``split_long_loops`` has split its loop. TVM's UnrollLoop multiplies
    extent by steps in 32 bits, and the wrapped product made it unroll the whole loop
    (AlexNet@224's update took 24 GB and was killed). A short loop split the same way computes
    the update numpy does."""
    import subprocess
    import sys

    from thomas_tune.schedules import LONG_LOOP

    script = tmp_path / "build_update.py"
    script.write_text(_BUILD_UPDATE)
    seed = str(int(rng.integers(1 << 30)))
    short = int(rng.integers(1000, 4000))  # split in parts of 256 and a remainder
    for n, limit in ((1 << 20, LONG_LOOP), (short, 256)):
        r = subprocess.run(["bash", "-c", f"ulimit -v 4000000; exec {sys.executable} {script} "
                            f"{n} {limit} {seed}"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "built" in r.stdout, (n, r.stdout[-2000:], r.stderr[-2000:])
