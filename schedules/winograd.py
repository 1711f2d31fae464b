"""Schedules of the Winograd transforms (``thomas_tune/training_graph/winograd_form.py``): the
filter, input and output transforms around the batched matmul.

Each transform computes, per (channel, tile) or (channel pair), a small block of values: the
``alpha x alpha`` transformed tile of an input tile or a filter, or the ``m x m`` outputs of
a tile. Its block carries the annotation ``schedule_rule = "thomas_tune.winograd_<kind>"``
and the tile size (``winograd_m``). Here each work-item computes one whole block: the loops
over the tile's positions are innermost and unrolled, so that the selects of the transform's
expression fold to the constant-coefficient sum of each position, and the sums shared
between positions are computed once. Work-items of a work-group take consecutive tiles (the
fastest-varying axis of the arrays they write). The only sampled decision is the work-group
size (:data:`THREADS`).

The same schedule is the kernel's default (:class:`WinogradTransform`, first of the default
GPU rules) and its one design space in tuning (the MetaSchedule custom rule registered as
``s_tir.meta_schedule.gpu.thomas_tune.winograd_<kind>``); epilogues fused after the output
transform (a bias, a ReLU, a mask) are inlined into it. The matmul between the transforms
is an ordinary contraction and gets the ordinary spaces.
"""

from __future__ import annotations

import tvm
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

#: work-group sizes the tuner samples from (the default schedule takes the first)
THREADS = (128, 64, 256)
KINDS = ("winograd_weight", "winograd_input", "winograd_output")


def _kind(block) -> str | None:
    rule = block.annotations.get("schedule_rule")
    rule = str(rule) if rule is not None else ""
    return rule.split(".", 1)[1] if rule.startswith("thomas_tune.winograd_") else None


def schedule_block(sch: tvm.s_tir.Schedule, block, threads) -> None:
    """Schedule one annotated transform block (see the module docstring); ``threads``: an
    int or a sampled variable."""
    b = sch.get(block)
    kind = _kind(b)
    loops = sch.get_loops(block)
    if kind in ("winograd_weight", "winograd_input"):
        e, f, i, p = loops  # (alpha, alpha, channels, tiles or channels)
        sch.reorder(i, p, e, f)
        outer, tile = [i, p], [e, f]
    elif kind == "winograd_output":
        m = int(b.annotations["winograd_m"])
        n, o, h, w = loops
        th, ih = sch.split(h, factors=[None, m])
        tw, iw = sch.split(w, factors=[None, m])
        sch.reorder(n, o, th, tw, ih, iw)
        outer, tile = [n, o, th, tw], [ih, iw]
    else:
        raise ValueError(f"block {b.name_hint} is no Winograd transform")
    bx, tx = sch.split(sch.fuse(*outer), factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    for loop in tile:
        sch.unroll(loop)
    if kind == "winograd_input":  # the input tile, read once into registers
        (d,) = [p for p in sch.get_producers(block) if sch.get(p).name_hint == "winograd_tile"]
        sch.compute_at(d, tx)
        sch.set_scope(d, 0, "local")
        for loop in sch.get_loops(d)[2:]:
            sch.unroll(loop)
    # (the annotations stay: MetaSchedule applies no other rule to a block that has one)


def _inline_rest(sch: tvm.s_tir.Schedule, keep) -> None:
    """Inline every other block of the function into ``keep`` (an epilogue after the output
    transform) where TVM can; raises TVM's ScheduleError where a block cannot be."""
    for blk in list(sch.get_child_blocks(sch.get_sblock("root"))):
        if sch.get(blk).same_as(sch.get(keep)) or sch.get(blk).name_hint == "winograd_tile":
            continue
        try:
            sch.compute_inline(blk)
        except Exception:  # (ScheduleError) an output block: into its producer
            sch.reverse_compute_inline(blk)


class WinogradTransform(GPUScheduleRule):
    """Default GPU schedule of a kernel whose one block left after inlining is a Winograd
    transform (:func:`schedule_block` with the first of :data:`THREADS`); None otherwise."""

    def apply(self, func, target, _):
        if not isinstance(func, tvm.tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = tvm.s_tir.Schedule(func)
        blocks = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
                  if _kind(sch.get(b)) is not None]
        if len(blocks) != 1:
            return None
        try:
            _inline_rest(sch, blocks[0])
            schedule_block(sch, blocks[0], THREADS[0])
        except Exception:  # (ScheduleError) a kernel these schedules do not fit
            return None
        return sch


def _custom_rule(sch: tvm.s_tir.Schedule, block):
    n = len(THREADS)
    threads = sch.sample_categorical(list(THREADS), [1.0 / n] * n)
    schedule_block(sch, block, threads)
    return [sch]


for _k in KINDS:
    tvm.register_global_func(f"s_tir.meta_schedule.gpu.thomas_tune.{_k}", _custom_rule,
                             override=True)
