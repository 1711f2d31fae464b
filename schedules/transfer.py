"""Schedules transferred between twin kernels that share a contraction (the anchor key)."""

from __future__ import annotations

import tvm

from .blocks import contraction
from .traces import before_postproc, plain_json


def _blocks(sch: tvm.s_tir.Schedule) -> list:
    """The blocks directly under the root block of an unscheduled function, in program order."""
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def _anchor(sch: tvm.s_tir.Schedule):
    """The one :func:`contraction` block of an unscheduled function, or None (none, several)."""
    anchors = [b for b in _blocks(sch) if contraction(sch.get(b))]
    return anchors[0] if len(anchors) == 1 else None


def _reach(sch: tvm.s_tir.Schedule, start, step) -> dict:
    """The blocks reached from block ``start`` by repeating ``step`` (``sch.get_producers`` or
    ``sch.get_consumers``), by name; ``start`` not included unless a step comes back to it."""
    found, todo = {}, [start]
    while todo:
        for b in step(todo.pop()):
            name = sch.get(b).name_hint
            if name not in found:
                found[name] = b
                todo.append(b)
    return found


def anchor_key(mod: tvm.IRModule) -> int | None:
    """What two kernels must share for a schedule of one to suit the other: the structural
    hash, with buffer and variable names mapped by position, of the kernel's one
    :func:`contraction` block and every block that feeds it (a padding, a dilation); the blocks
    after it (bias, ReLU, a mask) are left out. A convolution with ReLU and the same one
    without it, in the inference and the training graph, have the same key. None for a kernel
    with no contraction or with several. Source of the hash: TVM's ``structural_hash`` with
    ``map_free_vars=True``."""
    import hashlib

    import tvm_ffi

    sch = tvm.s_tir.Schedule(mod)
    anchor = _anchor(sch)
    if anchor is None:
        return None
    keep = [anchor, *_reach(sch, anchor, sch.get_producers).values()]
    hashes = sorted(int(tvm_ffi.structural_hash(sch.get(b), map_free_vars=True)) for b in keep)
    return int.from_bytes(hashlib.sha256(repr(hashes).encode()).digest()[:8], "big")


#: instructions a transferred trace may drop with a block the target kernel lacks
_INLINES = ("ComputeInline", "ReverseComputeInline")


#: block lookups a transferred trace drops when no later instruction uses what they found
#: (:func:`pad_in_fill` lists the root's blocks; the twin has more of them)
_LOOKUPS = ("GetChildBlocks", "GetConsumers", "GetProducers")


def transferred(trace_json, donor: tvm.IRModule, mod: tvm.IRModule):
    """A trace of kernel ``donor`` (JSON form, plain or as ``Trace.as_json()`` gives it)
    rewritten for kernel ``mod``, which has the same :func:`anchor_key` but other blocks
    around the contraction (a ReLU fused in one and not in the other): the blocks that only
    ``mod`` has are inlined (before the donor's steps where they inline into blocks of the
    donor, else after them as multi-level tiling fuses an epilogue: into the block that
    writes the contraction's result back), the instructions on blocks that only ``donor`` has
    are dropped where they are inlines, and every tile size, thread binding and unroll
    decision is kept; the postprocessing instructions are dropped (apply the trace, then the
    postprocessors). None when the trace does more than inline a block that ``mod`` lacks, or
    when the result does not apply to ``mod``. The trace is a schedule of ``mod``'s own
    computation either way: a transfer can be slow, never wrong."""
    insts, decisions = before_postproc(*plain_json(trace_json))
    donor_sch = tvm.s_tir.Schedule(donor)
    theirs = {donor_sch.get(b).name_hint for b in _blocks(donor_sch)}
    sch = tvm.s_tir.Schedule(mod)
    names = [sch.get(b).name_hint for b in _blocks(sch)]
    kept = _kept(insts, names)
    if kept is None:
        return None
    keep, func, gone = kept
    extra = [n for n in names if n not in theirs]
    placements = _placements(sch, extra)
    if placements is None or not extra and not gone:
        return None  # no contraction; or the same blocks: the donor's trace as it is
    used = {v for ins in insts for v in ins[3]}
    for order, first in placements:
        out = _with_inlines(insts, decisions, keep, order, first, func, used)
        try:
            tvm.s_tir.schedule.Trace.apply_json_to_schedule(out, tvm.s_tir.Schedule(mod))
        except Exception:  # TVM's ScheduleError: a step that needs the donor's structure
            continue
        return out
    return None


def _kept(insts: list, names: list[str]) -> tuple[list[int], str, bool] | None:
    """(positions of the instructions of a donor's trace ``insts`` kept for a kernel whose
    blocks are ``names``, the function its block lookups name, whether the donor has blocks
    the kernel lacks); None when the trace does more than inline such a block. Dropped: the
    lookups and inlines of the blocks the kernel lacks, and lookups of blocks nothing uses."""
    gone = set()  # trace variables of the donor's blocks that mod lacks
    func = "main"
    for ins in insts:
        if ins[0] == "GetSBlock" and len(ins[2]) >= 1 and len(ins[3]) == 1:
            func = ins[2][1] if len(ins[2]) > 1 else func
            if ins[2][0] not in names and ins[2][0] != "root":
                gone.add(ins[3][0])
    keep = []
    read = {a for ins in insts for a in ins[1] if isinstance(a, str)}
    for i, ins in enumerate(insts):
        if ins[0] in _LOOKUPS and not set(ins[3]) & read:
            continue  # a lookup nothing uses, whose count of blocks may differ in mod
        uses = {a for a in ins[1] if isinstance(a, str)} & gone
        if ins[0] == "GetSBlock" and ins[3] and ins[3][0] in gone:
            continue
        if uses:
            if ins[0] not in _INLINES:
                return None  # the donor schedules that block: nothing to map it to
            continue
        keep.append(i)
    return keep, func, bool(gone)


def _placements(sch: tvm.s_tir.Schedule, extra: list[str]) -> list | None:
    """The two placements of the inlines of the blocks ``extra`` (those only the kernel of
    ``sch`` has), each ``([(instruction kind, block name), ...], before the donor's steps)``;
    None when the kernel has no single contraction.

    First, before the donor's steps: the blocks after the contraction into their producers,
    the blocks that only feed those into their consumers (a ReLU after a bias add). Else after
    them, as multi-level tiling fuses an epilogue: the epilogue's tail into its producers, last
    first; the blocks that read the contraction's result into their consumers; the blocks that
    only feed the epilogue (BatchNorm's scale from its statistics) into theirs; then what is
    left into the block that writes the result back (the donor's own epilogue, or its copy out
    of registers)."""
    anchor = _anchor(sch)
    if anchor is None:
        return None
    ours = _blocks(sch)
    names = [sch.get(b).name_hint for b in ours]
    after = set(_reach(sch, anchor, sch.get_consumers))  # downstream of the contraction
    direct = {sch.get(c).name_hint for c in sch.get_consumers(anchor)}
    block = {sch.get(b).name_hint: b for b in ours}
    producers = {n: {sch.get(p).name_hint for p in sch.get_producers(block[n])} for n in names}
    feeders = [("ComputeInline", n) for n in reversed(extra) if n not in after]
    tail = [n for n in reversed(extra) if n in after and n not in direct
            and not producers[n] & direct]
    readers = [n for n in reversed(extra) if n in direct and sch.get_consumers(block[n])]
    return [
        ([("ReverseComputeInline", n) for n in extra if n in after] + feeders, True),
        ([("ReverseComputeInline", n) for n in tail] + [("ComputeInline", n) for n in readers]
         + feeders + [("ReverseComputeInline", n) for n in extra
                      if n in after and n not in tail and n not in readers], False)]


def _with_inlines(insts: list, decisions: list, keep: list[int], order: list, first: bool,
                  func: str, used: set) -> list:
    """The trace JSON ``[instructions, decisions]`` of the kept instructions ``keep`` of
    ``insts`` with the inlines ``order`` (:func:`_placements`) before them (``first``) or
    after; the decisions follow their instructions. New block variables ``b<i>t`` are taken
    from those not in ``used`` (which gets them)."""
    steps = []
    for kind, name in order:
        var = next(f"b{i}t" for i in range(len(used) + 1) if f"b{i}t" not in used)
        used.add(var)
        steps += [["GetSBlock", [], [name, func], [var]], [kind, [var], [], []]]
    ahead = len(steps) if first else 0
    where = {old: ahead + new for new, old in enumerate(keep)}
    kept = [insts[i] for i in keep]
    return [steps + kept if first else kept + steps,
            [[where[int(i)], d] for i, d in decisions if int(i) in where]]
