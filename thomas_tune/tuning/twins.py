"""Twin kernels across storage precisions: one contraction whose tensors are stored in float32
in one graph and in float16 in another (``--precision mixed16``).

A convolution of the half-storage step reads its float16 input through a cast and writes its
float32 sum back as float16: the same blocks, loops and tile space as the float32 step's
convolution, with other element types (and one more element-wise block, the rounding). The
anchor key of :func:`thomas_tune.schedules.anchor_key` hashes the blocks with their types, so
the two are not twins by it; :func:`precision_key` is the key that leaves the types out, and
:func:`twin_trace` carries a schedule from one to the other (through
:func:`thomas_tune.schedules.transferred` where their blocks differ). A carried schedule is a
schedule of the receiving kernel's own computation (TVM applies it to that kernel or refuses
it): it may be slow there, never wrong, and like every candidate it is checked and timed on the
device before a tuning log keeps it.
"""

from __future__ import annotations

import hashlib

import tvm

from ..schedules import before_postproc, contraction, plain_json, transferred


def _block_shape(block) -> tuple:
    """A block's name, its iterators' extents and kinds, and the shapes of the buffers it
    reads and writes: all but the element types."""
    def shapes(regions):
        return tuple(tuple(int(x) for x in r.source.shape) for r in regions)
    iters = tuple((int(iv.dom.extent), int(iv.iter_type)) for iv in block.iter_vars)
    return block.name_hint, iters, shapes(block.reads), shapes(block.writes)


def precision_key(mod: tvm.IRModule) -> int | None:
    """What a kernel shares with its twins at other storage precisions: a 64-bit hash of the
    names, iterator extents and kinds, and read and written buffer shapes of its one
    contraction block (:func:`thomas_tune.schedules.contraction`) and every block that feeds
    it (the padding, the float16 input's cast), element types left out. None for a kernel with
    no contraction or several, or one whose extents are not constants.

    Two kernels with one key have the same loop nest to tile around their contraction; the
    key does not compare index expressions, so a schedule carried between them is tried
    (:func:`twin_trace`) and measured, never assumed."""
    sch = tvm.s_tir.Schedule(mod)
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    anchors = [b for b in blocks if contraction(sch.get(b))]
    if len(anchors) != 1:
        return None
    keep, todo, seen = [anchors[0]], [anchors[0]], set()
    while todo:
        for b in sch.get_producers(todo.pop()):
            name = sch.get(b).name_hint
            if name not in seen:
                seen.add(name)
                keep.append(b)
                todo.append(b)
    try:
        shapes = sorted(_block_shape(sch.get(b)) for b in keep)
    except TypeError:  # a symbolic extent: no key
        return None
    return int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:8], "big")


def twin_trace(trace_json, donor: tvm.IRModule, mod: tvm.IRModule):
    """A trace of kernel ``donor`` (JSON form, plain or as ``Trace.as_json()`` gives it) for
    its twin ``mod`` (the same :func:`precision_key` or anchor key): rewritten by
    :func:`thomas_tune.schedules.transferred` where it can; else, where ``mod`` has every block
    of ``donor`` and more after its contraction (the half-storage step's roundings to
    float16), the donor's trace with those blocks inlined into the one that writes the
    contraction's result back, at the first point of the trace where that applies; where the
    two have the same blocks (kernels that differ in element types only), the donor's trace
    as it is. None when none applies to ``mod``. Postprocess it before building (the donor's
    postprocessing is dropped either way)."""
    out = transferred(trace_json, donor, mod)
    if out is not None:
        return out
    theirs, ours = _names(donor), _names(mod)
    if any(n not in ours for n in theirs):
        return None
    insts, decisions = _without_unused_lookups(*before_postproc(*plain_json(trace_json)))
    extra = [n for n in ours if n not in theirs]
    for at in _inline_points(insts) if extra else [len(insts)]:
        out = _inlined_at(insts, decisions, extra, at)
        try:
            tvm.s_tir.schedule.Trace.apply_json_to_schedule(out, tvm.s_tir.Schedule(mod))
        except Exception:  # TVM's ScheduleError: a step the twin's structure does not take
            continue
        return out
    return None


#: block lookups whose count of outputs depends on the kernel's blocks (a twin has more)
_LOOKUPS = ("GetChildBlocks", "GetConsumers", "GetProducers")


def _without_unused_lookups(insts: list, decisions: list) -> tuple[list, list]:
    """A trace without the block lookups whose results no instruction reads (the search's
    rules list the root's blocks to find none to inline): in a twin with more blocks they
    would give more outputs than the trace names, which TVM refuses."""
    keep = list(range(len(insts)))
    while True:  # a lookup read only by lookups that go goes too
        read = {a for i in keep for a in insts[i][1] if isinstance(a, str)}
        kept = [i for i in keep if insts[i][0] not in _LOOKUPS or set(insts[i][3]) & read]
        if kept == keep:
            break
        keep = kept
    where = {old: new for new, old in enumerate(keep)}
    return [insts[i] for i in keep], [[where[int(i)], d] for i, d in decisions if int(i) in where]


def _inline_points(insts: list) -> list[int]:
    """Where in a donor's trace ``insts`` the twin's extra epilogue blocks (the float16
    rounding of a sum) can be inlined into the block that writes the contraction's result
    back: after each ``ReverseComputeAt`` (multi-level tiling's placement of that block under
    its thread loop, before which the reduction itself is incomplete and takes no inline),
    else before each lookup of the root's blocks (whose count the extra blocks would change),
    then at the end."""
    after = [i + 1 for i, ins in enumerate(insts) if ins[0] == "ReverseComputeAt"]
    before = [i for i, ins in enumerate(insts) if ins[0] == "GetChildBlocks"]
    return list(dict.fromkeys([*after, *before, len(insts)]))


def _inlined_at(insts: list, decisions: list, extra: list[str], at: int) -> list:
    """The trace JSON ``[instructions, decisions]`` of ``insts`` with a reverse inline of each
    block of ``extra`` (in program order: each into the block that then produces its input)
    inserted before instruction ``at``; the decisions follow their instructions."""
    func = next((ins[2][1] for ins in insts if ins[0] == "GetSBlock" and len(ins[2]) > 1), "main")
    used = {v for ins in insts for v in ins[3]}
    steps = []
    for name in extra:
        var = next(f"b{i}x" for i in range(len(used) + 1) if f"b{i}x" not in used)
        used.add(var)
        steps += [["GetSBlock", [], [name, func], [var]], ["ReverseComputeInline", [var], [], []]]
    moved = [[int(i) + len(steps) if int(i) >= at else int(i), d] for i, d in decisions]
    return [insts[:at] + steps + insts[at:], moved]


def _names(mod: tvm.IRModule) -> list[str]:
    sch = tvm.s_tir.Schedule(mod)
    return [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
