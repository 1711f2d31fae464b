"""A convolution's padding kept out of its inner loop: moved into the shared-memory fill."""

from __future__ import annotations

import json

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .blocks import contraction, padding_block
from .traces import before_postproc, plain_json


def pads_a_contraction(sch: tvm.s_tir.Schedule, block) -> bool:
    """Whether ``block`` of ``sch`` is a :func:`padding_block` that feeds a
    :func:`contraction`: the blocks :class:`PaddingInFill` keeps out of inner loops."""
    return padding_block(sch.get(block)) and any(contraction(sch.get(c))
                                                 for c in sch.get_consumers(block))


#: the annotation :class:`PaddingInFill` puts on a padding block it keeps out of inlining
KEEP_PADDING = ("meta_schedule.inline_rule", "disable")


def _kept_padding(sch: tvm.s_tir.Schedule, block) -> bool:
    b = sch.get(block)
    return padding_block(b) and b.annotations.get(KEEP_PADDING[0]) == KEEP_PADDING[1]


def pad_in_fill(sch: tvm.s_tir.Schedule) -> int:
    """Inline each padding block that :class:`PaddingInFill` kept apart and that now only
    feeds shared-memory copies (the stages multi-level tiling made of the padded operand):
    the bounds test moves into the copy that fills shared memory, once per staged element,
    and the convolution's innermost loop reads shared memory with no test. Returns the
    number of blocks inlined; a padding block read by anything else stays a kernel of its own."""
    done = 0
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if not _kept_padding(sch, block):
            continue
        consumers = sch.get_consumers(block)
        if consumers and all(sch.get(c).writes and sch.get(c).writes[0].source.scope()
                             == "shared" for c in consumers):
            sch.compute_inline(block)
            done += 1
    return done


@derived_object
class PaddingInFill(ms.schedule_rule.PyScheduleRule):
    """Design spaces where a convolution's padding is kept out of its innermost loop, beside
    those where it is inlined into the convolution.

    Inlined into the convolution, the padding becomes a bounds test on every operand read of
    the innermost loop, each read a load of its own behind a branch: the best AlexNet record
    for the weight gradient of ``conv2`` on the H100 (OpenCL, 1.41 ms, 16% of the FP32 peak)
    compiles to 972 FMA, 1,015 shared-memory loads and 786 branches (PTX; the same counts from
    NVIDIA's driver and from clang's NVPTX backend, ``bench/experiments/ptx_mix.py``), and an SM
    issues shared loads at a quarter of its FMA rate (32 banks of 4 bytes per clock against 128 FP32
    lanes; NVIDIA's CUDA C++ Programming Guide and H100 whitepaper).

    Here the padding block is not inlined before tiling (annotation :data:`KEEP_PADDING`), so
    multi-level tiling stages the *padded* tensor in shared memory; :class:`Tiling` and
    :class:`SplitReduction` then inline the padding into that copy (:func:`pad_in_fill`). The
    bounds test runs once per staged element and the innermost loop reads shared memory with
    no test: the same record with its padding in the fill compiles to 972 FMA, 567 shared
    loads (7 per 12 FMA, its 3x4 register tile) and 24 branches. Where nothing is staged
    (direct tiling, cross-thread reduction), the padding stays a kernel of its own (one pass
    over the input). Both kinds of space are offered; the tuner picks by measurement."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        if not pads_a_contraction(sch, block):
            return [sch]
        kept = sch.copy()
        kept.annotate(kept.get_sblock(sch.get(block).name_hint), *KEEP_PADDING)
        return [sch, kept]

    def clone(self) -> "PaddingInFill":
        return PaddingInFill()


def with_padding_in_fill(mod: tvm.IRModule, trace_json):
    """A trace of ``mod`` (JSON form, plain or as ``Trace.as_json()`` gives it) whose padding
    blocks are kept out of the innermost loop as :class:`PaddingInFill`'s spaces keep them:
    each ``ComputeInline`` of a block that :func:`padding_block` recognizes and that feeds a
    :func:`contraction` becomes the annotation that keeps the inlining rules off it, and after
    the trace's last scheduling step the padding goes into the shared-memory copies of the
    padded operand (:func:`pad_in_fill`) where the tiling made them; every other decision (tile
    sizes, thread bindings, unrolling) is kept and the postprocessing instructions dropped
    (apply it, then the postprocessors, to get the schedule). None when the trace inlines no
    such block. The best records of the inlined spaces carry the tiling that the search took
    thousands of trials to find; this gives the padded spaces the same one."""
    insts, decisions = before_postproc(*plain_json(trace_json))
    sch = tvm.s_tir.Schedule(mod)
    names = {}  # trace variable -> block name, for the blocks the trace looks up by name
    for ins in insts:
        if ins[0] == "GetSBlock" and len(ins[2]) >= 1 and len(ins[3]) == 1:
            names[ins[3][0]] = ins[2][0]
    kept = {ins[1][0] for ins in insts if ins[0] == "Annotate" and ins[2] == [KEEP_PADDING[0]]}
    changed = False
    for i, ins in enumerate(insts):
        if ins[0] != "ComputeInline" or ins[1][0] not in names or ins[1][0] in kept:
            continue
        try:
            block = sch.get_sblock(names[ins[1][0]])
        except Exception:  # TVM's ScheduleError: no block of that name in the unscheduled mod
            continue
        if pads_a_contraction(sch, block):
            insts[i] = ["Annotate", [ins[1][0], json.dumps(KEEP_PADDING[1])],
                        [KEEP_PADDING[0]], []]
            changed = True
    if not changed:
        return None
    try:
        tvm.s_tir.schedule.Trace.apply_json_to_schedule([insts, decisions], sch)
    except Exception:  # TVM's ScheduleError: a later step needs the padding inlined
        return None
    try:
        pad_in_fill(sch)
    except Exception:  # the copy cannot take the padding: it stays a kernel of its own
        return [insts, decisions]
    return plain_json(sch.trace.as_json())
