"""Design spaces for matmuls with few rows: a linear layer at a small batch.

A linear layer's forward, ``Y[m, n] = sum_k X[m, k] * W[n, k]``, at batch 32 has a few rows
(m) and a weight far larger than everything else: AlexNet's first fully connected layer reads a
151 MB weight for 32x9216 inputs. Tiling it as a square matmul leaves a few dozen work-groups,
each running a 9216-term loop (on the H100 the tuned kernel took 0.36 ms, 10% of the FP32
peak, where reading the weight once takes 0.05 ms). A GEMV-style schedule streams the weight
instead: threads split each output's sum (consecutive threads read consecutive elements of a
weight row), every thread keeps the partial sums of a bucket of rows, and the threads' partial
sums are added in the work-group. This is dlight's ``LowBatchGEMV`` rule, written for the
batch of a served language model (a symbolic row count padded to a bucket); here the row count
is a constant and the rule is driven with it: one design space per bucket (rows per work-group)
and per settings set (dlight's CUDA settings: 4-wide partial sums, the rows' inputs staged in
shared memory; its generic ones: neither).
"""

from __future__ import annotations

import tvm
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.analysis.common_analysis import collect_block_iter_vars_used_in_access_region
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.s_tir.dlight.gpu.low_batch_gemv import LowBatchGEMV

#: rows per work-group that are tried (those that divide the row count)
BUCKETS = (1, 4, 8, 16, 32)
#: at most this many rows: beyond, the kernel is a matmul and the tiled spaces serve it
MAX_ROWS = 64
#: dlight's settings sets, named by the target kind it keys them on
SETTINGS = ("cuda", "opencl")


def _size(region) -> int:
    n = 1
    for d in region.source.shape:
        n *= int(d)
    return n


def _prepare(func: tvm.tirx.PrimFunc):
    """(schedule, main block, epilogue block info or None, the rows' input buffer, rows) with the
    main block's loops reordered as dlight's rule expects (rows, fused spatial, fused
    reduction); None when ``func`` is not a matmul with few rows whose weight is read along
    the sum."""
    sch = tvm.s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None or sum(1 for b in infos if b.is_reduction()) != 1:
        return None
    infos = try_inline_contiguous_spatial(sch, infos)
    if not infos or not infos[0].is_reduction() or len(infos) > 2:
        return None
    epilogue = infos[1] if len(infos) == 2 else None
    if epilogue is not None and not epilogue.is_injective():
        return None
    block = infos[0].block_rv
    stmt = sch.get(block)
    if len(stmt.writes) != 1 or len(stmt.reads) != 2:
        return None
    if not all(isinstance(iv.dom.extent, tvm.tirx.IntImm) for iv in stmt.iter_vars):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for r in stmt.reads for d in r.source.shape):
        return None
    big = 0 if _size(stmt.reads[0]) >= _size(stmt.reads[1]) else 1
    used = collect_block_iter_vars_used_in_access_region(stmt, stmt.reads[big].region)
    spatial = [iv for iv in stmt.iter_vars if iv.iter_type == tvm.tirx.IterVar.DataPar]
    reduce_ = [iv for iv in stmt.iter_vars if iv.iter_type == tvm.tirx.IterVar.CommReduce]
    rows = [iv for iv in spatial if iv.var not in used]
    cols = [iv for iv in spatial if iv.var in used]
    if len(rows) != 1 or not cols or not reduce_ or int(rows[0].dom.extent) > MAX_ROWS:
        return None
    # the weight's last index must be a reduction iterator (its rows are read along the sum)
    last = stmt.reads[big].region[-1].min
    if not any(last.same_as(iv.var) for iv in reduce_):
        return None
    loop_of = {iv.var: lp for iv, lp in zip(stmt.iter_vars, sch.get_loops(block))}
    if len(loop_of) != len(stmt.iter_vars):
        return None
    sch.reorder(loop_of[rows[0].var], *[loop_of[iv.var] for iv in cols],
                *[loop_of[iv.var] for iv in reduce_])
    if len(cols) > 1:
        sch.fuse(*[loop_of[iv.var] for iv in cols])
    if len(reduce_) > 1:
        sch.fuse(*[loop_of[iv.var] for iv in reduce_])
    return sch, block, epilogue, stmt.reads[1 - big].source, int(rows[0].dom.extent)


def low_batch_spaces(func: tvm.tirx.PrimFunc, target: tvm.target.Target
                     ) -> list[tvm.s_tir.Schedule]:
    """Fully scheduled design spaces for ``func`` when it is a matmul of at most
    :data:`MAX_ROWS` rows whose large operand is read along the sum (``W[n, k]``): one per
    bucket of :data:`BUCKETS` dividing the row count and per settings set of :data:`SETTINGS`;
    empty for any other kernel. Thread counts respect the target's ``max_num_threads``."""
    if _prepare(func) is None:
        return []
    rows = _prepare(func)[4]
    threads = int(target.attrs.get("max_num_threads", 256))
    shared = int(target.attrs.get("max_shared_memory_per_block", 16384))
    out = []
    for like in SETTINGS:
        settings = tvm.target.Target({"kind": like, "max_num_threads": threads,
                                      "max_shared_memory_per_block": shared,
                                      "thread_warp_size": 32, **({"arch": "sm_90"}
                                                                 if like == "cuda" else {})})
        for bucket in BUCKETS:
            if bucket > rows or rows % bucket:
                continue
            sch, block, epilogue, vector, _ = _prepare(func)
            try:
                LowBatchGEMV(bucket).sch_inner_reduction(sch, settings, block, None, None,
                                                         [vector], epilogue, bucket)
            except Exception:  # a shape the rule asserts on: other spaces stay
                continue
            out.append(sch)
    return out
