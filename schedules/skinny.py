"""Split-K design spaces for skinny matmuls: a dense layer's forward pass and data gradient at a
small batch, ``C[i, j] = sum_k A[i, k] * B[j, k]`` (or ``B[k, j]``) with few rows (i, the
batch) and long sums (k, the layer's inputs).

Such a kernel has too few outputs to fill a large GPU when each work-group owns a tile of them:
AlexNet's first fully connected layer at batch 32 has 32x4096 outputs, 32 work-groups of 32x128
outputs on the H100's 132 multiprocessors. Its best multi-level-tiling record ran 0.31 ms,
8 TFLOP/s, 26% of the FP32 peak; the second layer's 0.34 ms, 3 TFLOP/s.
The split spaces of :class:`SplitReduction` express the same split, but among the thousands of
random tilings of its three-dimensional partial-sum block the search measured 35 and reached
0.68 ms.

Here each space is one fixed schedule, as in :mod:`.matmul_tiles` (its only sampled decision is
the unroll limit, :data:`UNROLL`):

- the sum is split into ``G`` parts (``rfactor``); work-group ``(g, jb)`` computes the partial
  sums of part ``g`` for all rows and ``tile_j`` columns, so there are ``G x N / tile_j``
  work-groups;
- its ``threads_i x threads_j`` threads each keep ``micro_i x micro_j`` sums in registers; a
  thread's ``micro_j`` columns are adjacent and read from shared memory as one vector, so the
  threads of a warp read consecutive words (no bank conflict) and write consecutive words of
  the result;
- each step of ``k_step`` terms stages ``rows x k_step`` of A and ``k_step x tile_j`` of B in
  shared memory (B transposed into ``[k, j]`` when it is stored ``[j, k]``), filled with
  4-wide loads;
- a second kernel adds the ``G`` partial sums of each output and applies the epilogue the
  kernel carries (bias, ReLU, dropout mask) in the same thread.

The tiling is the register-blocked outer product of Volkov and Demmel 2008 ("Benchmarking
GPUs to tune dense linear algebra"); the split of the sum across work-groups is the split-K of
CUTLASS's GEMM documentation. Spaces are offered for sums of :data:`MIN_TERMS` or more and
at most :data:`MAX_ROWS` rows; the tuner measures each once and keeps the best record.

On the H100 (OpenCL; ``bench/results/h100_alexnet_r224_b32_*_skinny.json``) these spaces took
AlexNet's first layer's forward pass from 0.308 to 0.195 ms (12.4 TFLOP/s), its data gradient
from 0.257 to 0.118 ms, and the second layer's forward pass from 0.229 to 0.093 ms; the linear
layers of the batch-32 training step from 1.50 to 0.98 ms. Threads along columns that 32 and 64
do not divide, 8-term steps and parts of 128 terms took the last layer's forward pass (1,000
columns) from 0.039 to 0.025 ms, its data gradient (1,000 terms) from 0.056 to 0.026, and the
second layer's data gradient, split 32 ways, from 0.124 to 0.054.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import tvm

from .matmul_tiles import RegisterTile, target_limits

#: the skinny side has at most this many rows (a batch)
MAX_ROWS = 64
#: ... and each output sums at least this many terms (AlexNet's last layer's data gradient
#: sums 1,000)
MIN_TERMS = 512
#: each part of a split sum keeps at least this many terms
MIN_PART = 128
#: work-groups a space aims at (one space per aim): a few per multiprocessor of a large GPU
GROUP_AIMS = (256, 1024)
MICRO_I = (4, 8)
MICRO_J = (2, 4)
THREADS_J = (32, 64)
#: threads along the columns when none of :data:`THREADS_J` divides them (1,000 classes: 20,
#: 25 or 50 columns of threads), this many at least and at most
THREADS_J_RANGE = (16, 64)
#: terms staged per step: the first of these that divides a part of the sum
K_STEPS = (32, 8)
K_STEP = K_STEPS[0]
#: unroll limits of the inner loops (``meta_schedule.unroll_explicit``); the space starts at
#: the last, which unrolls a step of the sum whole (32 terms x a register tile of up to 16)
UNROLL = (64, 512)


@dataclass(frozen=True)
class Split(RegisterTile):
    """One skinny tiling: a :class:`.matmul_tiles.RegisterTile` whose ``tile_i`` is every row,
    the sum cut into ``parts`` (G) parts across work-groups, ``k_step`` terms staged per
    step."""

    parts: int = 1
    k_step: int = K_STEP

    def shared_bytes(self) -> int:
        """Bytes of shared memory for the two staged slices (float32)."""
        return (self.tile_i + self.tile_j) * self.k_step * 4

    def __str__(self) -> str:
        return (f"split-K {self.parts} parts, {self.threads_i}x{self.threads_j} threads, "
                f"{self.micro_i}x{self.micro_j} per thread")


@dataclass(frozen=True)
class Skinny:
    """The matmul a kernel holds: its reduction block's name, the loop positions of rows (i),
    columns (j) and the sum (k), their extents, the read index of A (indexed by i, k) and of B,
    and whether B is stored ``[k, j]``."""

    block: str
    rows: int
    cols: int
    terms: int
    a_index: int
    b_index: int
    b_kj: bool
    loop_i: int
    loop_j: int


def _indices(region) -> list:
    return [r.min for r in region.region]


def find_skinny(func: tvm.tirx.PrimFunc) -> Skinny | None:
    """The skinny matmul of ``func`` (its only reduction block: two spatial iterators and one
    reduction iterator, bound one to one to constant loops; two float32 operands, each indexed
    by the sum and one spatial iterator), or None. Rows are the spatial iterator of at most
    :data:`MAX_ROWS`; the sum has :data:`MIN_TERMS` terms or more."""
    sch = tvm.s_tir.Schedule(func)
    root = sch.get_sblock("root")
    found = [b for b in sch.get_child_blocks(root) if sch.get(b).init is not None]
    if len(found) != 1:
        return None
    block = found[0]
    b = sch.get(block)
    loops = sch.get_loops(block)
    ivs = list(b.iter_vars)
    if len(loops) != 3 or len(ivs) != 3 or len(b.reads) != 2 or len(b.writes) != 1:
        return None
    kinds = [iv.iter_type for iv in ivs]
    if kinds != [tvm.tirx.IterVar.DataPar, tvm.tirx.IterVar.DataPar,
                 tvm.tirx.IterVar.CommReduce]:
        return None
    ext = []
    for lp, iv in zip(loops, ivs):
        e = sch.get(lp).extent
        if not isinstance(e, tvm.tirx.IntImm) or iv.dom.extent.value != e.value:
            return None
        ext.append(int(e))
    if any(r.source.dtype != "float32" for r in b.reads) or b.writes[0].source.dtype != "float32":
        return None
    v = [iv.var for iv in ivs]
    writes = _indices(b.writes[0])
    if len(writes) != 2 or not (writes[0].same_as(v[0]) and writes[1].same_as(v[1])):
        return None
    # which operand is indexed by (spatial s, k), and in which order
    shapes = []
    for r in b.reads:
        idx = _indices(r)
        if len(idx) != 2 or any(e.extent.value != 1 for e in r.region if
                                isinstance(e.extent, tvm.tirx.IntImm)):
            return None
        if idx[1].same_as(v[2]) and any(idx[0].same_as(x) for x in v[:2]):
            shapes.append((0 if idx[0].same_as(v[0]) else 1, False))
        elif idx[0].same_as(v[2]) and any(idx[1].same_as(x) for x in v[:2]):
            shapes.append((0 if idx[1].same_as(v[0]) else 1, True))
        else:
            return None
    if sorted(s for s, _ in shapes) != [0, 1]:
        return None
    rows_at = 0 if ext[0] <= ext[1] else 1
    if ext[rows_at] > MAX_ROWS or ext[2] < MIN_TERMS:
        return None
    a_index = [s for s, _ in shapes].index(rows_at)
    b_index = 1 - a_index
    if shapes[a_index][1]:  # A stored [k, i]: not this layout
        return None
    return Skinny(block=b.name_hint, rows=ext[rows_at], cols=ext[1 - rows_at], terms=ext[2],
                  a_index=a_index, b_index=b_index, b_kj=shapes[b_index][1],
                  loop_i=rows_at, loop_j=1 - rows_at)


def _threads_j(cols: int, micro_j: int) -> list[int]:
    """Threads along the columns for ``micro_j`` columns each: those of :data:`THREADS_J` that
    divide ``cols``; when none does, the divisors of ``cols / micro_j`` in
    :data:`THREADS_J_RANGE` (1,000 columns, 4 per thread: 25 and 50)."""
    found = [t for t in THREADS_J if cols % (t * micro_j) == 0]
    if found or cols % micro_j:
        return found
    lo, hi = THREADS_J_RANGE
    return [t for t in range(lo, hi + 1) if (cols // micro_j) % t == 0]


def _k_step(part: int) -> int | None:
    """Terms staged per step for a part of ``part`` terms: the first of :data:`K_STEPS` that
    divides it, or None."""
    return next((k for k in K_STEPS if part % k == 0), None)


def splits_for(m: Skinny, max_threads: int, max_shared_bytes: int) -> list[Split]:
    """The tilings offered for ``m``: every combination of :data:`MICRO_I`, :data:`MICRO_J`
    and threads along the columns (:func:`_threads_j`) that divides the rows and columns and
    fits the work-group limits, each with the part count G (a divisor of the sum leaving
    :data:`MIN_PART` terms or more, a multiple of a step of :data:`K_STEPS`) nearest each of
    :data:`GROUP_AIMS` work-groups. Empty when no tiling divides the rows and columns or no G
    leaves whole steps (a sum of 1,030 terms)."""
    # part counts that leave whole steps, with their step
    steps = {g: _k_step(m.terms // g) for g in range(1, m.terms // MIN_PART + 1)
             if m.terms % g == 0}
    steps = {g: k for g, k in steps.items() if k}
    out = []
    for mi, mj in product(MICRO_I, MICRO_J):
        if m.rows % mi:
            continue
        for tj in _threads_j(m.cols, mj):
            threads = (m.rows // mi) * tj
            if threads > max_threads or threads < 32:
                continue
            fits = [Split(m.rows // mi, tj, mi, mj, parts=g, k_step=k) for g, k in steps.items()]
            fits = [t for t in fits if t.shared_bytes() <= max_shared_bytes]
            if not fits:  # no part count leaves whole steps that fit
                continue
            col_groups = m.cols // fits[0].tile_j
            chosen = []
            for aim in GROUP_AIMS:
                t = min(fits, key=lambda t: abs(t.parts * col_groups - aim))
                if t not in chosen:
                    chosen.append(t)
            out.extend(chosen)
    return out


def schedule(sch: tvm.s_tir.Schedule, m: Skinny, t: Split) -> None:
    """Schedule ``sch`` (the kernel of ``m``) with tiling ``t``, in place: the partial sums
    as the module docstring says, then (for G > 1) one thread per output adds them up and
    computes the epilogue, the blocks after the matmul (all but the last inlined into it,
    the last computed in the same thread); for G = 1 the epilogue is inlined into the copy of
    the register results. Raises TVM's ScheduleError when a step does not apply (an epilogue
    that is not element-wise, a loop that does not split)."""
    block = sch.get_sblock(m.block)
    root = sch.get_sblock("root")
    children = sch.get_child_blocks(root)
    at = [sch.get(b).name_hint for b in children].index(m.block)
    # blocks that feed the matmul (a layout change of an operand) are inlined into it; of the
    # epilogue, every block but the last is inlined into its consumer
    for b in children[:at]:
        sch.compute_inline(b)
    after = list(children[at + 1:])
    for b in after[:-1]:
        sch.compute_inline(b)
    out = after[-1] if after else None
    loops = sch.get_loops(block)
    i, j, k = loops[m.loop_i], loops[m.loop_j], loops[2]
    if m.loop_i != 0:
        sch.reorder(i, j)
    if t.parts > 1:
        ko, _ = sch.split(k, factors=[t.parts, None])
        rf = sch.rfactor(ko, factor_axis=0)
        g, i, j, kk = _rf_loops(sch, rf, m)
    else:
        rf = block
        i, j, kk = sch.get_loops(rf)
        g = None
    jb, jt, jv = sch.split(j, factors=[None, t.threads_j, t.micro_j])
    it, iv = sch.split(i, factors=[t.threads_i, t.micro_i])
    k0, k1 = sch.split(kk, factors=[None, t.k_step])
    sch.reorder(*([g] if g is not None else []), jb, it, jt, k0, k1, iv, jv)
    sch.bind(sch.fuse(g, jb) if g is not None else jb, "blockIdx.x")
    tx = sch.fuse(it, jt)
    sch.bind(tx, "threadIdx.x")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, tx, preserve_unit_loops=True)
    a_s = sch.cache_read(rf, m.a_index, "shared")
    sch.compute_at(a_s, k0, preserve_unit_loops=True)
    b_s = sch.cache_read(rf, m.b_index, "shared")
    sch.compute_at(b_s, k0, preserve_unit_loops=True)
    if not m.b_kj:  # [j, k] in memory, [k, j] in shared memory: a warp reads one row
        sch.transform_layout(b_s, ("write", 0), lambda a, b: (b, a))
    for s in (a_s, b_s):  # the fill's loops as one, spread over the threads by the postprocessor
        sch.fuse(*sch.get_loops(s)[-2:])
        # (a sampled value, as multi-level tiling's: a constant does not survive the trace's
        # JSON form, which the postprocessor then rejects)
        sch.annotate(s, "meta_schedule.cooperative_fetch", sch.sample_categorical([4], [1.0]))
    # a thread's micro_j columns are adjacent: read (and written) as one vector, so the
    # threads of a warp read consecutive words of shared memory
    sch.vectorize(jv)
    sch.decompose_reduction(rf, k0)
    # (sampled, as every unroll limit the search's mutator may change)
    n = len(UNROLL)
    sch.annotate(root, "meta_schedule.unroll_explicit",
                 sch.sample_categorical(list(UNROLL), [1 / n] * n, decision=n - 1))
    if g is None:
        if out is not None:
            sch.reverse_compute_inline(out)
        return
    # adding up the partial sums and the epilogue: one thread per output
    i2, j2, _ = sch.get_loops(block)
    fused = sch.fuse(i2, j2)
    bx, tx2 = sch.split(fused, factors=[None, t.threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx2, "threadIdx.x")
    if out is not None:
        sch.set_scope(block, 0, "local")
        sch.reverse_compute_at(out, tx2, preserve_unit_loops=True)


def _rf_loops(sch, rf, m: Skinny):
    """The partial-sum block's loops as (g, i, j, k-within-part)."""
    i, j, g, kk = sch.get_loops(rf)  # rfactor keeps the block's loop order, the part at k's
    return g, i, j, kk


def skinny_spaces(sch: tvm.s_tir.Schedule, target: tvm.target.Target
                  ) -> list[tvm.s_tir.Schedule]:
    """One fully scheduled design space per tiling of :func:`splits_for` for the kernel of
    ``sch`` (function ``main``); empty when it holds no skinny matmul. A tiling that a step
    cannot apply to is left out."""
    m = find_skinny(sch.mod["main"])
    if m is None:
        return []
    out = []
    for t in splits_for(m, *target_limits(target)):
        s = sch.copy()
        try:
            schedule(s, m, t)
        except tvm.error.TVMError:
            continue
        out.append(s)
    return out
