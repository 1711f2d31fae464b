"""Enumerated matmul tilings: one design space per tile shape for kernels that are matmuls once
their indices are regrouped (convolutions and both of their gradients, dense layers).

MetaSchedule's multi-level tiling draws tile sizes at random from every factorization of the loop
extents. Most draws are poor on a GPU (too few threads, too little reuse per thread), and a
training graph holds hundreds of tasks, so each gets only tens of trials: on the H100 the tuned
AlexNet convolutions stayed at 4-16% of the device's FP32 peak. This module offers the search a
short list of tilings of the classic GPU matmul instead (:func:`schedule`): a work-group
computes a ``tile_i x tile_j`` block of outputs, stages ``k x tile_i`` and ``k x tile_j`` slices
of the operands in shared memory, and each thread keeps a ``micro_i x micro_j`` register tile
(outer products, Volkov and Demmel 2008, "Benchmarking GPUs to tune dense linear algebra"),
its operands read from shared memory as 4-wide vectors. Each tiling is one design space whose
only random decision is the unroll limit; the evolutionary search measures each, and
multi-level tiling keeps its own spaces beside them.

What these spaces gave on the H100 (OpenCL, AlexNet at batch 32): the twelve
hottest convolutions of the training step each got 22-41 tilings measured. On the five of
them compared, the best tiling was 1.4x to 2.2x faster than the best of the spaces this module
offered before (dlight's ``Matmul`` rule with the same tile list, whose register tile read one
operand as a 4-element gather), e.g. the fourth layer's forward convolution 0.706 ms against
1.474; on all twelve it stayed 1.2x to 3.2x slower than the best multi-level-tiling record
(0.366 ms there): none became a best record. Writing the im2col matrix out first (a kernel
of its own, so that the tiled kernel's fill reads a plain matrix) made them slower again
(0.746 ms there), so the cost is in the tiled kernel itself, not in its gather. Compiled with
aligned vector reads of shared memory (:mod:`thomas_tune.opencl_source`: ``ld.shared.v4``, 0.125
shared loads per FMA) the best tilings got up to 1.24x faster, and stayed slower than multi-level
tiling on 11 of the 12 tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import tvm
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain, auto_inline_producers
from tvm.s_tir.dlight.gpu.matmul import get_index_map, get_reduction_blocks

#: work-group sizes (threads along i, threads along j) and register tiles (micro_i, micro_j)
#: that are tried; slices of the sum staged per step (k) are 8 or 16 terms
THREADS = ((8, 8), (8, 16), (16, 8), (16, 16), (8, 32), (32, 8))
MICRO = ((4, 4), (4, 8), (8, 4), (8, 8))
K_STEPS = (8, 16)
#: elements per vector load and store (float4: 16 bytes), and the padding of a staged row
VECTOR = 4
#: unroll limits of a tiled kernel's loops (``meta_schedule.unroll_explicit``); the space starts
#: at the second, which unrolls one term's multiply-adds and register copies whole
UNROLL = (64, 512, 1024)
#: a tiling is offered only if padding the outputs to whole tiles adds at most this share
MAX_PAD = 0.25
#: ... and the sum to whole k steps at most this share
MAX_PAD_K = 0.15
#: ... and it makes at least this many work-groups
MIN_GROUPS = 32
#: ... and each output sums at least this many terms (shorter sums gain little from the tiles;
#: a linear layer's weight gradient at batch 32 sums 32)
MIN_TERMS = 32


@dataclass(frozen=True)
class RegisterTile:
    """A work-group of ``threads_i x threads_j`` threads, each keeping ``micro_i x micro_j``
    sums of a matmul's outputs in registers: a ``tile_i x tile_j`` block of outputs per
    work-group (Volkov and Demmel 2008). :class:`Tile` and :class:`.skinny.Split` add how
    the sum is staged and split."""

    threads_i: int
    threads_j: int
    micro_i: int
    micro_j: int

    @property
    def tile_i(self) -> int:
        return self.threads_i * self.micro_i

    @property
    def tile_j(self) -> int:
        return self.threads_j * self.micro_j

    @property
    def threads(self) -> int:
        return self.threads_i * self.threads_j


@dataclass(frozen=True)
class Tile(RegisterTile):
    """One tiling of a matmul ``C[b, i, j] = sum_k A[b, i, k] * B[b, j, k]`` (float32), ``k``
    terms of the sum staged per step."""

    k: int

    def shared_bytes(self, dtype_bytes: int = 4) -> int:
        """Shared memory of the two staged slices, in bytes: ``k`` rows of ``tile_i`` and of
        ``tile_j`` elements, each row padded by :data:`VECTOR` elements (:func:`schedule`)."""
        return (self.tile_i + self.tile_j + 2 * VECTOR) * self.k * dtype_bytes

    def __str__(self) -> str:
        return (f"{self.tile_i}x{self.tile_j}x{self.k} tile, {self.threads_i}x{self.threads_j} "
                f"threads, {self.micro_i}x{self.micro_j} per thread")


def matmul_extents(func: tvm.tirx.PrimFunc) -> tuple[int, int, int, int] | None:
    """Extents ``(batch, i, j, k)`` of ``func`` seen as a batched matmul, as dlight's ``Matmul``
    rule regroups it (spatial indices read by the first operand only -> i, by the second only
    -> j, reduction indices -> k), or None when ``func`` has no single reduction that is a
    matmul, or an extent is not a constant."""
    sch = tvm.s_tir.Schedule(func)
    try:
        found = get_reduction_blocks(sch, sch.get_child_blocks(sch.get_sblock("root")))
        if found is None:
            return None
        main = found[0]
        if not get_index_map(sch.get(main)):
            return None
        for idx, kind in ((0, "read"), (1, "read"), (0, "write")):
            sch.reindex(main, (kind, idx))
        maps = get_index_map(sch.get(main))
        if maps is None:
            return None
        sch.transform_block_layout(main, maps[0])
        extents = [iv.dom.extent for iv in sch.get(main).iter_vars]
    except Exception:  # TVM's ScheduleError: no root block, or not a matmul this regrouping
        return None     # can express
    if len(extents) != 4 or not all(isinstance(e, tvm.tirx.IntImm) for e in extents):
        return None
    return tuple(int(e) for e in extents)


def _tiles(n: int, tile: int) -> int:
    """Tiles of ``tile`` that cover ``n``."""
    return -(-n // tile)


def tiles_for(extents: tuple[int, int, int, int], max_threads: int,
              max_shared_bytes: int) -> list[Tile]:
    """The tilings offered for a matmul of ``extents`` (batch, i, j, k) on a device allowing
    ``max_threads`` threads per work-group and ``max_shared_bytes`` of shared memory: those
    within :data:`MAX_PAD`, :data:`MAX_PAD_K` and :data:`MIN_GROUPS`, largest register tile
    first. Empty for sums shorter than :data:`MIN_TERMS`."""
    b, i, j, k = extents
    if k < MIN_TERMS:
        return []
    out = []
    for (ti, tj), (mi, mj), ks in product(THREADS, MICRO, K_STEPS):
        t = Tile(ti, tj, mi, mj, ks)
        if t.threads > max_threads or t.shared_bytes() > max_shared_bytes:
            continue
        groups_i, groups_j = _tiles(i, t.tile_i), _tiles(j, t.tile_j)
        if groups_i * t.tile_i * groups_j * t.tile_j > (1 + MAX_PAD) * i * j:
            continue
        if _tiles(k, ks) * ks > (1 + MAX_PAD_K) * k:
            continue
        if b * groups_i * groups_j < MIN_GROUPS:
            continue
        out.append(t)
    out.sort(key=lambda t: (-t.micro_i * t.micro_j, -t.threads, -t.k))
    return out


def target_limits(target: tvm.target.Target) -> tuple[int, int]:
    """(threads per work-group, shared-memory bytes per work-group) the target allows."""
    return (int(target.attrs.get("max_threads_per_block", 256)),
            int(target.attrs.get("max_shared_memory_per_block", 16384)))


def schedule(sch: tvm.s_tir.Schedule, tile: Tile) -> None:
    """Schedule the matmul of ``sch`` (function ``main``, as :func:`matmul_extents` regroups
    it) with ``tile``, in place:

    - the operands and the result are regrouped to ``A[b, i, k]``, ``B[b, j, k]`` and
      ``C[b, i, j]`` (the index maps of dlight's ``Matmul`` rule; a convolution's input becomes
      its im2col matrix, never stored: it is read in the shared-memory fill), and padded to
      whole tiles;
    - work-group ``(b x i-tile, j-tile)`` owns ``tile_i x tile_j`` outputs; thread ``(ti, tj)``
      keeps ``micro_i x micro_j`` of them in registers, rows ``ti * micro_i + 0..micro_i-1``
      and columns ``tj * micro_j + 0..micro_j-1``;
    - each step of ``k`` terms stages ``k x tile_i`` of A and ``k x tile_j`` of B in shared
      memory, transposed to ``[k, i]`` and ``[k, j]`` with rows padded by :data:`VECTOR`
      elements (a row starts :data:`VECTOR` banks further on: the transposed stores of the fill
      spread over the banks, and rows stay 16-byte aligned);
    - per term, a thread copies its ``micro_i`` values of A and ``micro_j`` of B from shared
      memory into registers, :data:`VECTOR` at a time, then does ``micro_i x micro_j``
      multiply-adds: ``(micro_i + micro_j) / VECTOR`` shared loads per ``micro_i x micro_j``
      FMAs (2 x 2 vector loads per 64 for an 8 x 8 tile; an SM issues shared loads at a
      quarter of its FP32 FMA rate, NVIDIA's H100 whitepaper);
    - the results go out ``micro_j`` at a time through the kernel's epilogue (bias, ReLU,
      the regrouping back), inlined.

    This is the register-blocked outer product of Volkov and Demmel 2008 ("Benchmarking GPUs to
    tune dense linear algebra"). Its one sampled decision is the unroll limit
    (:data:`UNROLL`, for the search's mutator). Raises TVM's ScheduleError (a ``TVMError``)
    when a step does not apply to the kernel."""
    root = sch.get_sblock("root")
    main = get_reduction_blocks(sch, sch.get_child_blocks(root))[0]
    regroup = [sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)),
               sch.reindex(main, ("write", 0))]
    block_map, *maps = get_index_map(sch.get(main))
    for blk, where, index_map in zip(regroup, ("write", "write", "read"), maps):
        sch.transform_layout(blk, (where, 0), index_map)
    sch.transform_block_layout(main, block_map)
    sch.pad_einsum(main, [1, tile.tile_i, tile.tile_j, tile.k])
    b, i, j, k = sch.get_loops(main)
    bi, ti, mi = sch.split(i, [None, tile.threads_i, tile.micro_i])
    bj, tj, mj = sch.split(j, [None, tile.threads_j, tile.micro_j])
    ko, ki = sch.split(k, [None, tile.k])
    sch.reorder(bi, bj, ti, tj, ko, ki, mi, mj)
    sch.bind(sch.fuse(b, bi), "blockIdx.y")
    sch.bind(bj, "blockIdx.x")
    sch.bind(ti, "threadIdx.y")
    sch.bind(tj, "threadIdx.x")  # (the faster-varying: a warp's threads read adjacent columns)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, tj, preserve_unit_loops=True)
    staged = []
    for operand in (0, 1):
        s = sch.cache_read(main, operand, "shared")
        sch.compute_at(s, ko, preserve_unit_loops=True)
        sch.transform_layout(s, ("write", 0), lambda b_, x, k_: (b_, k_, x))
        sch.storage_align(s, 0, axis=1, factor=32, offset=VECTOR)
        staged.append(s)
    for operand in (0, 1):
        reg = sch.cache_read(main, operand, "local")
        sch.compute_at(reg, ki, preserve_unit_loops=True)
        _, vec = sch.split(sch.get_loops(reg)[-1], [None, VECTOR])
        sch.vectorize(vec)
    for s in staged:
        auto_inline_producers(sch, s)  # padding, the regrouping: computed in the fill
        sch.fuse(*sch.get_loops(s)[-3:])
        # the fill spread over the threads by the postprocessor, 4 elements per thread and
        # step (a sampled value, as multi-level tiling's: a constant does not survive the
        # trace's JSON form)
        sch.annotate(s, "meta_schedule.cooperative_fetch", sch.sample_categorical([4], [1.0]))
    _, vec = sch.split(sch.get_loops(acc)[-1], [None, VECTOR])
    sch.vectorize(vec)
    auto_inline_consumer_chain(sch, acc)
    sch.decompose_reduction(main, ko)
    n = len(UNROLL)
    sch.annotate(root, "meta_schedule.unroll_explicit",
                 sch.sample_categorical(list(UNROLL), [1 / n] * n, decision=1))


def tiled_spaces(sch: tvm.s_tir.Schedule, target: tvm.target.Target
                 ) -> list[tvm.s_tir.Schedule]:
    """Design spaces of :func:`tiles_for` for the kernel of ``sch`` (function ``main``): one
    fully scheduled schedule (:func:`schedule`) per tiling; empty when the kernel is not a
    matmul or no tiling fits. A tiling a step cannot apply to this kernel is left out."""
    extents = matmul_extents(sch.mod["main"])
    if extents is None:
        return []
    out = []
    for tile in tiles_for(extents, *target_limits(target)):
        s = sch.copy()
        try:
            schedule(s, tile)
        except tvm.error.TVMError:
            continue
        out.append(s)
    return out
