"""Enumerated matmul tilings: one design space per tile shape for kernels that are matmuls once
their indices are regrouped (convolutions and both of their gradients, dense layers).

MetaSchedule's multi-level tiling draws tile sizes at random from every factorization of the loop
extents. Most draws are poor on a GPU (too few threads, too little reuse per thread), and a
training graph holds hundreds of tasks, so each gets only tens of trials: on the H100 the tuned
AlexNet convolutions stayed at 4-16% of the device's FP32 peak. This module offers the search a
short list of tilings of the classic GPU matmul instead, the same structure as dlight's ``Matmul``
rule: a work-group computes a ``tile_i x tile_j`` block of outputs, stages ``tile_i x k`` and
``tile_j x k`` slices of the operands in shared memory, and each thread keeps a ``micro_i x
micro_j`` register tile (outer products, Volkov and Demmel 2008, "Benchmarking GPUs to tune dense
linear algebra"). Each tiling is one design space with no random decision; the evolutionary
search measures each once, and multi-level tiling keeps its own spaces beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import tvm
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.matmul import get_index_map, get_reduction_blocks

#: work-group sizes (threads along i, threads along j) and register tiles (micro_i, micro_j)
#: that are tried; slices of the sum staged per step (k) are 8 or 16 terms
THREADS = ((8, 8), (8, 16), (16, 8), (16, 16), (8, 32), (32, 8))
MICRO = ((4, 4), (4, 8), (8, 4), (8, 8))
K_STEPS = (8, 16)
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
        """Shared memory of the two staged slices, in bytes (with the row padding the rule
        adds against bank conflicts: ``vector`` elements per row)."""
        return (self.tile_i + self.tile_j) * (self.k + self.vector) * dtype_bytes

    @property
    def vector(self) -> int:
        return min(4, self.micro_j)

    def config(self) -> dl.gpu.Matmul.Config:
        """dlight's form of this tiling (``x`` is dlight's name for i, ``y`` for j)."""
        return dl.gpu.Matmul.Config(
            block_size_x=self.threads_i, block_size_y=self.threads_j, vthread_x=1,
            vthread_y=1, micro_size_x=self.micro_i, micro_size_y=self.micro_j,
            micro_size_k=self.k, vector_size=self.vector, unroll=256, use_shared=True,
            storage_align=True, inner_x=False)

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


class TiledMatmul(dl.gpu.Matmul):
    """dlight's ``Matmul`` rule with the tiling ``tile`` instead of its per-target default."""

    def __init__(self, tile: Tile):
        self.tile = tile

    def get_configs(self, target) -> dl.gpu.Matmul.Config:
        return self.tile.config()


def target_limits(target: tvm.target.Target) -> tuple[int, int]:
    """(threads per work-group, shared-memory bytes per work-group) the target allows."""
    return (int(target.attrs.get("max_threads_per_block", 256)),
            int(target.attrs.get("max_shared_memory_per_block", 16384)))


def tiled_spaces(sch: tvm.s_tir.Schedule, target: tvm.target.Target
                 ) -> list[tvm.s_tir.Schedule]:
    """Design spaces of :func:`tiles_for` for the kernel of ``sch`` (function ``main``): one
    fully scheduled schedule per tiling; empty when the kernel is not a matmul or no tiling
    fits. A tiling the rule cannot apply to this kernel is left out."""
    func = sch.mod["main"]
    extents = matmul_extents(func)
    if extents is None:
        return []
    out = []
    for tile in tiles_for(extents, *target_limits(target)):
        try:
            with target:
                s = TiledMatmul(tile).apply(func, target, False)
        except Exception:  # a kernel shape the rule asserts on
            s = None
        if s is not None:
            out.append(s)
    return out
