"""Passes over a CPU target's unscheduled kernels: long sums taken as sums of partial sums
(:func:`split_long_sums`, for precision) and loops too long for TVM's unroll test split
(:func:`split_long_loops`). :func:`.defaults.default_schedules` applies both on CPUs."""

from __future__ import annotations

import contextlib
import math

import tvm


def split_long_sums(mod: tvm.IRModule, parts: int = 256, min_terms: int = 2048,
                    chain: int = 512, max_partials: int = 1 << 22) -> tvm.IRModule:
    """``mod`` with the long sums of its unscheduled kernels taken as sums of partial sums, for
    a CPU target, whose loops run in order: a float32 sum of n terms in a row is about
    sqrt(n) roundings of its running value from the exact sum (Higham 2002, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., sec. 4.2), a sum of p partial sums about
    sqrt(n / p) + sqrt(p). Applies to kernels with one reduction block (``rfactor``); the
    element-wise blocks before it (padding) are inlined into it, those after it (bias, ReLU)
    stay as they are.

    - Few outputs and at least ``min_terms`` terms per output (weight and bias gradients, sums
      over N*H*W): ``parts`` partial sums (fewer where ``parts`` does not divide the terms:
      as many as leave no part empty), each over a contiguous run of the terms, in one
      buffer of ``parts`` x outputs, then their sum (what a GPU's work-group gets from
      :class:`.default_rules.LongReduction`).
    - Where that buffer would hold more than ``max_partials`` values (convolutions and
      matmuls of the forward pass and the data gradients: millions of outputs), and the sum
      has at least ``chain`` terms: partial sums per output, each over a run of the outermost
      summed axis (input channels) and the whole of the others, as near sqrt(terms) terms as
      that axis's divisors allow, in a buffer of one output's partial sums. The chain of 1,600
      terms of AlexNet's second convolution was 2.3x further from float64 than PyTorch
      float32's (blocked, vectorised) sum; its max-pool then routed more gradients elsewhere
      than float64 does (docs/journal/precision.md).

    A kernel the split does not fit is left as it is."""
    from .blocks import reduction_blocks

    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or \
                func.attrs is not None and func.attrs.get("tir.is_scheduled", False):
            continue
        blocks = reduction_blocks(func)
        if len(blocks) != 1:
            continue
        try:
            split = _split_sum(func, blocks[0].name_hint, parts, min_terms, chain, max_partials)
        except Exception:  # the kernel stays unsplit (right, with longer sums)
            continue
        if split is not None:
            out[gv] = split
    return out


def _split_sum(func: tvm.tirx.PrimFunc, name: str, parts: int, min_terms: int, chain: int,
               max_partials: int) -> tvm.tirx.PrimFunc | None:
    """``func`` with its one reduction block ``name`` split as :func:`split_long_sums` says;
    None when the split does not fit. Raises TVM's errors of a schedule step that fails."""
    sch = tvm.s_tir.Schedule(func)
    block = sch.get_sblock(name)
    for other in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(other).name_hint != name:
            with contextlib.suppress(Exception):  # a consumer of the sum stays
                sch.compute_inline(other)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    loops = sch.get_loops(block)
    r_loops = [lp for lp, k in zip(loops, kinds) if k == tvm.tirx.IterVar.CommReduce]
    s_loops = [lp for lp, k in zip(loops, kinds) if k == tvm.tirx.IterVar.DataPar]
    if len(r_loops) + len(s_loops) != len(loops) or not s_loops:
        return None
    terms = outputs = 1
    for lp in r_loops:
        terms *= int(sch.get(lp).extent)
    for lp in s_loops:
        outputs *= int(sch.get(lp).extent)
    # no part without terms: a part whose every iteration the split's bound check
    # skips never runs its initialisation either, and the sum of the parts would add
    # whatever its memory held (2,916 terms in 256 parts of 12 left 13 parts empty)
    per_part = -(-terms // parts)
    n_parts = -(-terms // per_part)
    if terms >= min_terms and n_parts * outputs <= max_partials:
        outer, _ = sch.split(sch.fuse(*r_loops), [n_parts, per_part])
        sch.rfactor(outer, 0)
    elif terms < chain or not _chain_parts(sch, name, r_loops, s_loops, terms):
        return None
    return sch.mod["main"]


def _chain_parts(sch: tvm.s_tir.Schedule, name: str, r_loops: list, s_loops: list,
                 terms: int) -> bool:
    """Split the sum of block ``name`` (``terms`` terms over ``r_loops``) into partial sums
    per output (``s_loops``): parts of the outermost summed axis (a convolution's input
    channels), so that the loops over the others (the filter's rows and columns) stay whole,
    each made right before it is added. False, changing nothing, when that axis gives fewer
    than two parts."""
    # k of the outermost axis's values per part, k dividing its extent, k times the other
    # axes' terms nearest sqrt(terms)
    first = int(sch.get(r_loops[0]).extent)
    rest = terms // first
    k = min((d for d in range(1, first + 1) if first % d == 0),
            key=lambda d: abs(math.log(d * rest / terms ** 0.5)))
    if first // k < 2:
        return False
    outer, _ = sch.split(r_loops[0], [first // k, k])
    sch.reorder(*s_loops, outer)
    rf = sch.rfactor(outer, 0)
    # the write-back block's loops: the outputs, then the parts; the partial sums of one
    # output are made right before they are added
    wb_loops = sch.get_loops(sch.get_sblock(name))
    sch.compute_at(rf, wb_loops[len(s_loops) - 1])
    return True


#: loops of an unscheduled CPU kernel longer than this are split (:func:`split_long_loops`)
LONG_LOOP = 1 << 22


def split_long_loops(mod: tvm.IRModule, limit: int = LONG_LOOP, inner: int = 1 << 16
                     ) -> tvm.IRModule:
    """``mod`` with every outermost loop of more than ``limit`` iterations in its unscheduled
    kernels split into loops of ``inner`` iterations (and a remainder), for a CPU target: the
    same computation, element for element.

    TVM's ``UnrollLoop`` pass (``src/tirx/transform/unroll_loop.cc``, in the pinned release)
    decides to unroll a loop when its extent times the statements of its body is at most its
    step limit, computed in 32-bit ints: a loop long enough for that product to wrap around
    (AlexNet's multi-tensor optimizer update: one loop over its 61,100,840 parameters, several
    stores each) passes the test with a negative product and is unrolled in full, which no
    memory holds (the llvm build of AlexNet@224's training step grew past 23 GB and was
    killed). A loop with a loop inside it that is not unrolled is never unrolled, so the split
    keeps the outer loop rolled. Kernels that fail to split are left as they are."""
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and \
                func.attrs.get("tir.is_scheduled", False):
            continue
        try:
            sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
            changed = False
            for block in sch.get_child_blocks(sch.get_sblock("root")):
                loops = sch.get_loops(block)
                if not loops:
                    continue
                extent = sch.get(loops[0]).extent
                if isinstance(extent, tvm.tirx.IntImm) and int(extent) > limit:
                    sch.split(loops[0], [None, inner])
                    changed = True
            if changed:
                out[gv] = sch.mod["main"]
        except Exception:  # a kernel the split does not fit stays as it is
            continue
    return out
