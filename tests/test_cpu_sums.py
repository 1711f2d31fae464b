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
