"""Search spaces for MetaSchedule: schedule rules, postprocessors and mutators per target.

CPU (``llvm``) uses MetaSchedule's own defaults. GPU targets (OpenCL above all: PoCL, NVIDIA, a
phone's Adreno) get the rule set written out here, its limits read from the target: thread
counts from ``max_threads_per_block`` and shared-memory tiling that respects
``max_shared_memory_per_block`` (16 KiB on the ``qcom/adreno-opencl`` tag; the Adreno 540 has
1 MB of on-chip memory in all, per Qualcomm's description), and ``thread_warp_size`` (1 on Adreno,
so cross-thread reductions use plain workgroup barriers).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir import meta_schedule as ms

from .matmul_tiles import tiled_spaces
from .skinny import skinny_spaces
from .winograd import WinogradTransform


#: The maximum numbers of unrolled steps the search chooses among for a GPU kernel
#: (MetaSchedule's ``ParallelizeVectorizeUnroll``; loops are unrolled explicitly in the OpenCL C
#: source). On the H100 (``experiments/compile_cost.py``, 48 AlexNet records,
#: ``bench/results/h100_alexnet_compile_cost.json``), limiting them to 64 cut TVM's build 3.2x
#: and NVIDIA's compile 3.5x per candidate, and made kernels 1.11x slower in the geometric mean
#: (1.20x for each workload's best record).
UNROLL_STEPS = (0, 16, 64, 512, 1024)


def unroll_steps(max_unroll: int | None = None) -> list[int]:
    """The choices of :data:`UNROLL_STEPS` up to ``max_unroll`` (all for None). Raises
    ValueError when that leaves fewer than two (below 16): MetaSchedule's unroll mutator
    needs another choice to move to."""
    if max_unroll is None:
        return list(UNROLL_STEPS)
    steps = [s for s in UNROLL_STEPS if s <= max_unroll]
    if len(steps) < 2:
        raise ValueError(f"max_unroll {max_unroll} leaves the search one unroll limit or none; "
                         f"give at least {UNROLL_STEPS[1]} (the limits are {UNROLL_STEPS})")
    return steps


def json_default(o):
    """``json.dumps``'s ``default`` for the TVM objects of a trace's or a tuning record's JSON
    form (``as_json()``): ``IntImm`` and ``FloatImm`` as numbers, TVM maps and arrays as dicts
    and lists. Raises TypeError for an object that is none of these (not met in MetaSchedule's
    traces so far: a layout's ``IndexMap`` comes as a string)."""
    if isinstance(o, tvm.tirx.IntImm):
        return bool(o.value) if str(o.ty) == "bool" else int(o.value)
    if isinstance(o, tvm.tirx.FloatImm):
        return float(o.value)
    if isinstance(o, tvm.tirx.IndexMap):  # as TVM's own JSON form of a trace writes it
        return tvm.ir.save_json(o)
    if hasattr(o, "items"):
        return dict(o.items())
    if hasattr(o, "__len__") and hasattr(o, "__getitem__"):
        return list(o)  # TVM's arrays
    raise TypeError(f"{type(o).__name__} has no JSON form")


def plain_json(trace_json) -> list:
    """A trace's JSON form (``Trace.as_json()``: TVM arrays holding ``IntImm`` and ``FloatImm``
    attributes; or a record's, already plain) as plain Python lists, ints, floats and strings,
    which ``json`` can write and ``Trace.apply_json_to_schedule`` reads back. Raises TypeError
    as :func:`json_default` does."""
    return json.loads(json.dumps(trace_json, default=json_default))


def _unroll_at(insts, decisions) -> tuple[int, int] | None:
    """:func:`sampled_unroll` of a plain trace."""
    var = next((ins[1][1] for ins in insts if ins[0] == "Annotate" and ins[2]
                and ins[2][0] == "meta_schedule.unroll_explicit"), None)
    where = next((i for i, ins in enumerate(insts)
                  if ins[0] == "SampleCategorical" and ins[3] == [var]), None)
    chosen = dict((int(i), d) for i, d in decisions).get(where)
    if var is None or where is None or chosen is None:
        return None
    return where, int(insts[where][2][0][int(chosen)])


def sampled_unroll(trace_json) -> tuple[int, int] | None:
    """Where a trace (JSON form ``[instructions, decisions]``, plain or as ``Trace.as_json()``
    gives it) samples its unroll limit and the limit it chose: ``(instruction index, limit)``,
    or None when it samples none (the enumerated matmul tilings fix theirs)."""
    return _unroll_at(*plain_json(trace_json))


def before_postproc(insts, decisions) -> tuple[list, list]:
    """A plain trace's instructions (each a list of its own) and decisions up to its
    postprocessing (``EnterPostproc``), which the postprocessors redo when applied again."""
    end = next((i for i, ins in enumerate(insts) if ins[0] == "EnterPostproc"), len(insts))
    return [list(ins) for ins in insts[:end]], [[i, d] for i, d in decisions if i < end]


def _set_unroll(insts, decisions, found, step: int, choices: list[int]):
    """:func:`with_unroll` of a plain trace whose sampled limit is ``found``."""
    where, current = found
    if current == step and [int(c) for c in insts[where][2][0]] == choices:
        return None
    insts, decisions = before_postproc(insts, decisions)
    insts[where][2] = [choices, [1.0 / len(choices)] * len(choices)]
    decisions = [[i, d] for i, d in decisions if i != where]
    decisions.append([where, choices.index(step)])
    return [insts, decisions]


def with_unroll(trace_json, step: int, choices=UNROLL_STEPS):
    """A trace (JSON form, plain or as ``Trace.as_json()`` gives it) with its sampled unroll
    limit set to ``step``, its choice among ``choices`` (default all of :data:`UNROLL_STEPS`)
    and the postprocessing instructions dropped (apply it, then the postprocessors, to get the
    schedule). None when the trace samples no unroll limit (:func:`sampled_unroll`) or already
    chose ``step`` among ``choices``. Raises ValueError when ``step`` is not in ``choices``."""
    choices = [int(c) for c in choices]
    if step not in choices:
        raise ValueError(f"unroll step {step} is not one of {choices}")
    insts, decisions = plain_json(trace_json)
    found = _unroll_at(insts, decisions)
    return None if found is None else _set_unroll(insts, decisions, found, step, choices)


def within_unroll(trace_json, allowed) -> tuple[list | None, int | None]:
    """A trace (JSON form, plain or as ``Trace.as_json()`` gives it) kept to the unroll limits
    ``allowed`` (ascending, as :func:`unroll_steps` gives them): its sampled limit lowered to
    the largest allowed one not above it and its choice narrowed to ``allowed``, postprocessing
    dropped (:func:`with_unroll`). Returns ``(trace or None, limit it had)``: None for the
    trace when it chose among exactly ``allowed`` already; ``(None, None)`` when it samples no
    limit."""
    allowed = [int(a) for a in allowed]
    insts, decisions = plain_json(trace_json)
    found = _unroll_at(insts, decisions)
    if found is None:
        return None, None
    step = max(s for s in allowed if s <= max(found[1], allowed[0]))
    return _set_unroll(insts, decisions, found, step, allowed), found[1]


def postprocessed(mod: tvm.IRModule, trace_json, postprocs,
                  seed: int | None = None) -> tvm.s_tir.Schedule | None:
    """The schedule of ``mod`` that a trace without postprocessing instructions (JSON form, as
    :func:`with_unroll` gives) and then ``postprocs`` make, its postprocessing marked so that a
    later replay can remove it; None when a postprocessor rejects it or cannot complete it.
    Sampling instructions without a decision in the trace draw one from the schedule's random
    state, ``seed`` (1 to 2^31 - 1; None: a random seed)."""
    sch = tvm.s_tir.Schedule(mod, seed=seed)
    try:
        tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace_json, sch)
        sch.enter_postproc()
        if not all(p.apply(sch) for p in postprocs):
            return None
    except Exception:  # TVM's ScheduleError and friends: a schedule they cannot complete
        return None
    return sch


def _thread_extents(max_threads: int) -> list[int]:
    return [t for t in (16, 32, 64, 128, 256, 512, 1024) if t <= max_threads] or [max_threads]


def _tiling(staged: bool = True) -> ms.ScheduleRule:
    """Multi-level tiling with shared-memory reuse (structure SSSRRSRS, Zheng et al. 2020
    "Ansor", section 4.1); with ``staged`` False, no operand is staged in shared memory
    (results still gather in registers)."""
    return ms.schedule_rule.MultiLevelTiling(
        structure="SSSRRSRS",
        tile_binds=["blockIdx.x", "vthread.x", "threadIdx.x"],
        max_innermost_factor=64,
        vector_load_lens=[1, 2, 3, 4, 8, 16],
        reuse_read=(ms.schedule_rule.ReuseType(req="must", levels=[4], scope="shared")
                    if staged else None),
        reuse_write=ms.schedule_rule.ReuseType(req="must", levels=[3], scope="local"),
    )


@derived_object
class Tiling(ms.schedule_rule.PyScheduleRule):
    """Multi-level tiling (:func:`_tiling`), plus spaces that stage nothing in shared memory
    for a block that reads an operand through a division or remainder of its iterators.

    Such a block is the data gradient of a strided convolution: MobileNetV2's stride-2
    depthwise layers read the output gradient at ``(h + 1 - kh) // 2``. Staging that operand
    in shared memory gives a region whose extent depends on the loop variables: every sampled
    schedule of the 32x96x112x112 gradient failed MetaSchedule's checks (26 of 40 over the
    target's shared memory, 14 with a loop of variable extent), the evolutionary search could
    not draw an initial population, and the kernel, the hottest of the tuned MobileNetV2 step
    on the H100 (0.47 ms), got no trial. The direct spaces sit beside the staged ones: the
    search keeps whichever it can sample and measures best."""

    def __init__(self):
        super().__init__()
        self._staged, self._direct = _tiling(), _tiling(staged=False)

    def _initialize_with_tune_context(self, context) -> None:
        self._staged._initialize_with_tune_context(context)
        self._direct._initialize_with_tune_context(context)

    def apply(self, sch, block):
        direct = []
        if strided_read(sch.get(block)):  # (on a copy: the staged rule may change ``sch``)
            direct = [s for s in self._direct.apply(sch.copy(), block)
                      if "meta_schedule.tiling_structure" in s.get(block).annotations]
        staged = self._staged.apply(sch, block)
        for space in staged:
            pad_in_fill(space)
        return [*staged, *direct]

    def clone(self) -> "Tiling":
        return Tiling()


def strided_read(block) -> bool:
    """Whether ``block`` reads a buffer at an index that divides, or takes the remainder of, an
    expression of its iterators (``floordiv``, ``floormod``, ``/``, ``%``)."""
    import tvm_ffi

    iters = [iv.var for iv in block.iter_vars]
    found = []

    def visit(node) -> None:
        if _uses(node, iters):
            found.append(node)

    for region in block.reads:
        for r in region.region:
            tvm_ffi.structural_walk(r.min, [(cls, visit) for cls in (
                tvm.tirx.FloorDiv, tvm.tirx.FloorMod, tvm.tirx.Div, tvm.tirx.Mod)])
            if found:
                return True
    return False


def padding_block(block) -> bool:
    """Whether ``block`` only pads (or dilates) a tensor: one buffer read, and the value stored
    is ``if_then_else(in bounds, that buffer's element, constant)``, as TOPI's ``pad`` and
    ``conv2d_transpose``'s dilation write it."""
    store = block.body
    if not isinstance(store, tvm.tirx.BufferStore) or len(block.reads) != 1:
        return False
    value = store.value
    if not (isinstance(value, tvm.ir.expr.Call) and value.op.name.endswith("if_then_else")):
        return False
    taken, other = value.args[1], value.args[2]
    return (isinstance(taken, tvm.ir.expr.TensorLoad) and isinstance(other, tvm.tirx.FloatImm)
            and taken.source.same_as(block.reads[0].source))


def contraction(block) -> bool:
    """Whether ``block`` sums products of two or more tensors (a reduction iterator, two or more
    buffers read): a convolution, either of its gradients, a matmul."""
    return (len(block.reads) >= 2
            and any(int(iv.iter_type) == 2 for iv in block.iter_vars))  # 2: CommReduce


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
    NVIDIA's driver and from clang's NVPTX backend, ``experiments/ptx_mix.py``), and an SM issues
    shared loads at a quarter of its FMA rate (32 banks of 4 bytes per clock against 128 FP32
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
    ours = _blocks(sch)
    names = [sch.get(b).name_hint for b in ours]
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
    anchor = _anchor(sch)
    if anchor is None:
        return None
    after = set(_reach(sch, anchor, sch.get_consumers))  # downstream of the contraction
    direct = {sch.get(c).name_hint for c in sch.get_consumers(anchor)}
    block = {sch.get(b).name_hint: b for b in ours}
    producers = {n: {sch.get(p).name_hint for p in sch.get_producers(block[n])} for n in names}
    extra = [n for n in names if n not in theirs]
    if not extra and not gone:
        return None  # the same blocks: the donor's trace as it is, nothing to transfer
    # two placements of the inlines, tried in turn. First, before the donor's steps: the
    # blocks after the contraction into their producers, the blocks that only feed those into
    # their consumers (a ReLU after a bias add). Else after them, as multi-level tiling fuses
    # an epilogue: the epilogue's tail into its producers, last first; the blocks that read
    # the contraction's result into their consumers; the blocks that only feed the epilogue
    # (BatchNorm's scale from its statistics) into theirs; then what is left into the block
    # that writes the result back (the donor's own epilogue, or its copy out of registers)
    feeders = [("ComputeInline", n) for n in reversed(extra) if n not in after]
    tail = [n for n in reversed(extra) if n in after and n not in direct
            and not producers[n] & direct]
    readers = [n for n in reversed(extra) if n in direct and sch.get_consumers(block[n])]
    placements = [
        ([("ReverseComputeInline", n) for n in extra if n in after] + feeders, True),
        ([("ReverseComputeInline", n) for n in tail] + [("ComputeInline", n) for n in readers]
         + feeders + [("ReverseComputeInline", n) for n in extra
                      if n in after and n not in tail and n not in readers], False)]
    used = {v for ins in insts for v in ins[3]}
    for order, first in placements:
        steps = []
        for kind, name in order:
            var = next(f"b{i}t" for i in range(len(used) + 1) if f"b{i}t" not in used)
            used.add(var)
            steps += [["GetSBlock", [], [name, func], [var]], [kind, [var], [], []]]
        ahead = len(steps) if first else 0
        where = {old: ahead + new for new, old in enumerate(keep)}
        kept = [insts[i] for i in keep]
        out = [steps + kept if first else kept + steps,
               [[where[int(i)], d] for i, d in decisions if int(i) in where]]
        try:
            tvm.s_tir.schedule.Trace.apply_json_to_schedule(out, tvm.s_tir.Schedule(mod))
        except Exception:  # TVM's ScheduleError: a step that needs the donor's structure
            continue
        return out
    return None


def _inline() -> ms.ScheduleRule:
    return ms.schedule_rule.AutoInline(
        into_producer=True, into_consumer=True, inline_const_tensor=True,
        disallow_if_then_else=False, require_injective=False, require_ordered=False,
        disallow_op=None)


def gpu_rules(target: tvm.target.Target, max_unroll: int | None = None
              ) -> list[ms.ScheduleRule]:
    """Schedule rules for an OpenCL/CUDA-like target: padding kept out of a convolution's
    inner loop (in the shared-memory fill) beside inlined (:class:`PaddingInFill`), inlining,
    split reductions (:class:`SplitReduction`), cross-thread reduction, multi-level tiling
    with shared-memory reuse (and without, for strided reads: :class:`Tiling`) and
    auto-binding, with thread extents capped by the target, and unroll limits of
    :func:`unroll_steps` (``max_unroll``)."""
    max_threads = int(target.attrs.get("max_threads_per_block", 256))
    extents = _thread_extents(max_threads)
    return [
        ms.schedule_rule.ApplyCustomRule(),
        PaddingInFill(),
        _inline(),
        SplitReduction(),
        ms.schedule_rule.CrossThreadReduction(thread_extents=extents),
        Tiling(),
        ms.schedule_rule.InlineConstantScalars(),
        _inline(),
        ms.schedule_rule.ParallelizeVectorizeUnroll(
            max_jobs_per_core=-1, max_vectorize_extent=-1,
            unroll_max_steps=unroll_steps(max_unroll), unroll_explicit=True),
        ms.schedule_rule.AutoBind(max_threadblocks=256, thread_extents=extents),
    ]


#: partial sums a split-K space aims at (G x outputs), one space for each: enough work-groups
#: for a large GPU (the H100 has 132 multiprocessors) at every tiling the search draws
SPLIT_PARTIALS = (1 << 20, 1 << 22)
#: each partial sum keeps at least this many terms
SPLIT_MIN_TERMS = 64
#: kernels with more outputs are never split (splitting one loop into parts: up to 2^19 outputs,
#: so that up to 8 parts fit in the largest of :data:`SPLIT_PARTIALS`, 2^22 partial sums)
SPLIT_MAX_OUTPUTS = 1 << 19


def split_parts(extent: int, outputs: int, rest: int = 1) -> list[int]:
    """The part counts G offered for splitting a reduction loop of ``extent`` iterations (a
    matmul's k) of a kernel with ``outputs`` outputs, whose other reduction loops have ``rest``
    iterations in all: for each of :data:`SPLIT_PARTIALS`, the divisor of ``extent`` nearest
    to it over ``outputs`` (in ratio) that leaves each partial sum :data:`SPLIT_MIN_TERMS`
    terms or more; 2 or more, no repeats, at most 4 bytes x 2^22 = 16 MiB of partial sums.
    AlexNet's first fully connected layer at batch 32 (32x4096 outputs, k = 9216): [8, 32]."""
    divisors = [g for g in range(2, extent + 1) if extent % g == 0
                and (extent // g) * rest >= SPLIT_MIN_TERMS and g * outputs <= max(SPLIT_PARTIALS)]
    out = []
    for aim in SPLIT_PARTIALS:
        if not divisors:
            break
        g = min(divisors, key=lambda d: abs(math.log(d * outputs / aim)))
        if g not in out:
            out.append(g)
    return out


@derived_object
class SplitReduction(ms.schedule_rule.PyScheduleRule):
    """Design spaces that split a long reduction across work-groups (split-K).

    The weight gradients and batch statistics of a training step sum many terms into few
    outputs: 96x16 weights of a 1x1 convolution, each a sum over 32x112x112 positions, or one
    mean per channel. Multi-level tiling maps outputs to threads, so such a kernel runs on a
    handful of work-groups; cross-thread reduction gives each output a work-group that re-reads
    its operands. For MobileNetV2's 16->96 weight gradient on the H100 the best of 186 tiled
    records took 6.56 ms and ``LongReduction``'s default 1.28 ms; a split schedule tuned here
    0.57 ms (``tuning_logs/h100/``, ``bench/results/h100_*_split*``).

    Here a reduction loop (the batch, or the next one) is factored out (``rfactor``): a first
    block computes partial sums with that loop as an extra output axis, and the original block
    adds the partial sums up, bound to threads by the postprocessors. The partial sums get a
    space where a work-group computes each and its threads split it (cross-thread reduction),
    and, for a contraction (two or more operands indexed by the sum's loops, as in a weight
    gradient), also multi-level tiling's spaces. A plain sum is never tiled: a per-channel
    operand such as a variance's mean looks like data reuse to the tiling rule, which then
    stages the large operand in shared memory along the wrong axis (MobileNetV2's 32x96x112x112
    variance on the H100: 1.30 ms at best over 65 tiled records, against 0.51 ms by default).
    The plain block's spaces stay too: the tuner picks.

    A matmul's sum runs over one loop (k): factoring it out whole would leave one term per
    partial sum. Such a loop is first split into G parts of k / G terms (:func:`split_parts`,
    two choices of G) and the G parts are factored out (split-K). AlexNet's fully connected
    layers at batch 32 are such kernels: 32x4096 outputs of 9216- or 4096-term sums, which
    tiling maps to a few dozen work-groups.

    Applies to a reduction block with constant loops bound one to one to its iterators and at
    least ``min_terms`` terms per output; factors a reduction loop of at least 4 iterations
    that leaves at least 64 terms (at most the first two such loops) when the block has at
    most ``max_outputs`` outputs; else, or when no loop leaves 64 terms, splits its longest
    reduction loop into G parts (:func:`split_parts`) when it has at most
    :data:`SPLIT_MAX_OUTPUTS` outputs. AlexNet's ``conv2`` weight gradient at batch 32 is
    such a kernel: 192x64x5x5 outputs, each a sum over 32x27x27 terms, its batch loop split
    into 4 or 8 parts; its best tiled record without a split runs 128 work-groups of 200
    threads on the H100's 132 multiprocessors (1.41 ms, 16% of the FP32 peak). The partial
    sums take (parts x outputs x 4) bytes of device workspace per call.
    """

    def __init__(self, min_terms: int = 1024, max_outputs: int = 1 << 17):
        super().__init__()
        self.min_terms, self.max_outputs = min_terms, max_outputs
        self._tile, self._threads = None, []

    def _initialize_with_tune_context(self, context) -> None:
        max_threads = int(context.target.attrs.get("max_threads_per_block", 256))
        self._tile = _tiling()
        self._threads = [t for t in _thread_extents(max_threads) if t >= 32]
        self._tile._initialize_with_tune_context(context)

    def _factor_loops(self, sch, block) -> tuple[int, list[tuple[int, int | None]]]:
        """(number of spatial loops, [(index among the block's loops of a reduction loop to
        factor out, None to factor it out whole or the number of parts to split it into
        first)]); an empty list when the rule does not apply."""
        b = sch.get(block)
        loops = sch.get_loops(block)
        if b.init is None or len(b.writes) != 1 or len(loops) != len(b.iter_vars):
            return 0, []
        outputs = terms = 1
        reductions = []  # (loop index, extent)
        for i, (lp, iv) in enumerate(zip(loops, b.iter_vars)):
            ext = sch.get(lp).extent
            if not isinstance(ext, tvm.tirx.IntImm) or iv.dom.extent.value != ext.value:
                return 0, []
            if iv.iter_type == tvm.tirx.IterVar.CommReduce:
                terms *= int(ext)
                reductions.append((i, int(ext)))
            elif iv.iter_type == tvm.tirx.IterVar.DataPar:
                outputs *= int(ext)
            else:
                return 0, []
        n_spatial = len(loops) - len(reductions)
        if terms < self.min_terms or outputs > SPLIT_MAX_OUTPUTS or \
                [i for i, _ in reductions] != list(range(n_spatial, len(loops))):
            return 0, []
        whole = [(i, None) for i, e in reductions if e >= 4 and terms // e >= SPLIT_MIN_TERMS][:2]
        if whole and outputs <= self.max_outputs:
            return n_spatial, whole
        # one loop holds (nearly) the whole sum, a matmul's k, or a whole loop's partial sums
        # would be too many: split the longest loop into G parts first
        i, e = max(reductions, key=lambda r: r[1])
        return n_spatial, [(i, g) for g in split_parts(e, outputs, terms // e)]

    def apply(self, sch, block):
        n_spatial, at = self._factor_loops(sch, block)
        if not at:
            return [sch]
        contraction = _contraction(sch.get(block))
        spaces = []
        for i, parts in at:
            for tiled in ((False, True) if contraction else (False,)):
                s = sch.copy()
                try:
                    spaces.extend(self._split(s, block, i, n_spatial, tiled, parts))
                except tvm.error.TVMError:  # a block this split cannot take: other spaces stay
                    continue
        # A kernel of several reductions (a variance: its mean, then the sum of squares) keeps
        # split spaces only: MetaSchedule's cross-thread reduction fails on such kernels (it
        # computes the first inside the second's loops), and in a space where one reduction
        # is split, the other must be split too.
        if spaces and len(_reduction_blocks(sch.mod["main"])) > 1:
            return spaces
        return [sch, *spaces]

    def _split(self, s, block, i: int, n_spatial: int, tiled: bool,
               parts: int | None = None) -> list:
        loop = s.get_loops(block)[i]
        if parts is not None:  # factor out the outer of G x (e / G)
            loop, _ = s.split(loop, factors=[parts, None])
        rf = s.rfactor(loop, factor_axis=0)
        # the factored loop is the partial-sum block's first iterator: its loops must run in
        # the iterators' order (a "trivial binding") for multi-level tiling to apply
        rl = s.get_loops(rf)
        rest = [lp for j, lp in enumerate(rl[n_spatial:]) if j != i - n_spatial]
        s.reorder(rl[i], *rl[:n_spatial], *rest)
        # the adding-up block is left to the postprocessors (RewriteUnboundBlock)
        s.annotate(block, "schedule_rule", "None")
        if tiled:
            spaces = [t for t in self._tile.apply(s, rf)
                      if "meta_schedule.tiling_structure" in t.get(rf).annotations]
            # (no space when tiling finds no data reuse: the work-group space covers that case)
            for t in spaces:
                pad_in_fill(t)
            return spaces
        # a work-group per partial sum, its threads split the sum (cross-thread reduction,
        # combined in local memory)
        rl = s.get_loops(rf)
        n = len(self._threads)
        threads = s.sample_categorical(self._threads, [1 / n] * n)
        _, tx = s.split(s.fuse(*rl[n_spatial + 1:]), factors=[None, threads])
        s.bind(tx, "threadIdx.x")
        s.bind(s.fuse(*rl[:n_spatial + 1]), "blockIdx.x")
        return [s]

    def clone(self) -> "SplitReduction":
        return SplitReduction(self.min_terms, self.max_outputs)


def gpu_postprocs() -> list[ms.Postproc]:
    """Postprocessors that make a sampled GPU schedule valid, last of all VerifyGPUCode, which
    rejects schedules over the target's thread and shared-memory limits before they are built."""
    return [
        ms.postproc.DisallowDynamicLoop(),
        ms.postproc.RewriteCooperativeFetch(),
        ms.postproc.RewriteUnboundBlock(max_threadblocks=256),
        ms.postproc.RewriteParallelVectorizeUnroll(),
        ms.postproc.RewriteReductionBlock(),
        ms.postproc.VerifyGPUCode(),
    ]


def gpu_mutators() -> dict[ms.Mutator, float]:
    """Mutation probabilities of the evolutionary search on GPU targets."""
    return {
        ms.mutator.MutateTileSize(): 0.9,
        ms.mutator.MutateUnroll(): 0.08,
        ms.mutator.MutateThreadBinding(): 0.02,
    }


def _shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` with the source context of the third frame only (the caller's
    caller), the only one TVMScript's parser reads; the others get none."""
    frame, out = sys._getframe(1), []
    while frame is not None:
        if len(out) == 2:
            tb = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, tb.filename, tb.lineno, tb.function,
                                         tb.code_context, tb.index, positions=tb.positions))
        else:
            out.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                         frame.f_code.co_name, None, None))
        frame = frame.f_back
    return out


def load_tensor_intrinsics() -> None:
    """Import TVM's tensor intrinsics (``tvm.s_tir.tensor_intrin``), which every MetaSchedule
    ``TuneContext`` imports, in a fifth of the time.

    That module parses 124 TVMScript functions, and TVM's ``prim_func`` decorator calls
    ``inspect.stack()`` for each. With source context for every frame, each call maps every
    frame to its module by a scan of ``sys.modules``: 27 s of a tuner's start on this project's
    2-core CI machine (58 s in a bare interpreter), paid by every process that tunes or builds a
    design space. The parser reads the source line of one frame (the third: is the function
    defined in a ``@I.ir_module`` class?) and the frame objects of the others, so during the
    import ``inspect.stack`` gives that frame's context alone (:func:`_shallow_stack`): 5 s.
    The intrinsics registered are the same (the structural hashes of all 124, compared once);
    ``inspect.stack`` is restored afterwards. A no-op once imported."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    real = inspect.stack
    inspect.stack = _shallow_stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = real


def space_generator(target: tvm.target.Target, max_unroll: int | None = None
                    ) -> ms.SpaceGenerator:
    """The design-space generator for ``target``: on CPUs MetaSchedule's own; on GPUs the
    post-order application of the rules above (unroll limits up to ``max_unroll``, see
    :func:`unroll_steps`), and beside it one space per tiling of
    :func:`matmul_tiles.tiled_spaces` for kernels that are matmuls once regrouped and of
    :func:`skinny.skinny_spaces` for matmuls of few rows and long sums (split-K)."""
    load_tensor_intrinsics()  # (the tune context this goes to imports them)
    if target.kind.name == "llvm":
        return ms.space_generator.PostOrderApply(sch_rules="llvm", postprocs="llvm",
                                                 mutator_probs="llvm")
    rules = ms.space_generator.PostOrderApply(sch_rules=gpu_rules(target, max_unroll),
                                              postprocs=gpu_postprocs(),
                                              mutator_probs=gpu_mutators())
    tiles = ms.space_generator.ScheduleFn(lambda sch: tiled_spaces(sch, target), sch_rules=[],
                                          postprocs=gpu_postprocs(),
                                          mutator_probs=gpu_mutators())
    skinny = ms.space_generator.ScheduleFn(lambda sch: skinny_spaces(sch, target), sch_rules=[],
                                           postprocs=gpu_postprocs(),
                                           mutator_probs=gpu_mutators())
    return ms.space_generator.SpaceGeneratorUnion([rules, tiles, skinny], sch_rules=[],
                                                  postprocs=gpu_postprocs(),
                                                  mutator_probs=gpu_mutators())


class LongReduction(GPUScheduleRule):
    """Default GPU schedule for kernels with few outputs and long sums (threads split the sum).

    The weight gradients of a training step are such kernels: a 1x1 convolution's weight
    gradient has C_out*C_in outputs, each a sum over batch x height x width (96*16 outputs of
    401,408 terms in MobileNetV2's second block at batch 32), a depthwise layer's has C*KH*KW.
    Mapping one output to one thread, as the generic rules do, leaves the GPU nearly idle and
    each thread runs a sum of 10^5 terms. Here each output gets a work-group: the reduction
    loops are fused, split across ``max_threads_per_block`` threads and combined by TVM's
    cross-thread reduction (partial sums, then a tree in local memory). Applies when every
    reduction block sums at least ``min_terms`` terms per output and has at most
    ``max_outputs`` outputs; other blocks of the kernel get the fallback mapping.
    """

    def __init__(self, min_terms: int = 2048, max_outputs: int = 1 << 18):
        self.min_terms, self.max_outputs = min_terms, max_outputs

    @staticmethod
    def _extent(sch, loops) -> int | None:
        n = 1
        for loop in loops:
            ext = sch.get(loop).extent
            if not isinstance(ext, tvm.tirx.IntImm):
                return None
            n *= int(ext)
        return n

    def apply(self, func, target, _):
        from tvm.s_tir.dlight.analysis import normalize_prim_func
        from tvm.s_tir.dlight.base import try_inline

        if not isinstance(func, tvm.tirx.PrimFunc) or not self.is_target_available(target):
            return None
        threads = int(target.attrs.get("max_threads_per_block", 256))
        sch = tvm.s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        plan = []
        for info in infos:
            kinds = info.dom_kind()
            block = info.block_rv
            loops = sch.get_loops(block)
            s_loops = [lp for lp, k in zip(loops, kinds) if k == "S"]
            r_loops = [lp for lp, k in zip(loops, kinds) if k == "R"]
            if any(k not in "SR" for k in kinds):
                return None
            plan.append((block, s_loops, r_loops))
        reductions = [p for p in plan if p[2]]
        if not reductions:
            return None
        for _, s_loops, r_loops in reductions:
            outputs, terms = self._extent(sch, s_loops), self._extent(sch, r_loops)
            if outputs is None or terms is None or terms < self.min_terms \
                    or outputs > self.max_outputs:
                return None
        for block, s_loops, r_loops in plan:
            if not s_loops:
                s_loops = [sch.add_unit_loop(block)]
            sch.reorder(*s_loops, *r_loops)
            if r_loops:  # a work-group per output, its threads split the sum
                sch.bind(sch.fuse(*s_loops), "blockIdx.x")
                _, tx = sch.split(sch.fuse(*r_loops), factors=[None, threads])
                sch.bind(tx, "threadIdx.x")
            else:
                _spread(sch, s_loops, threads)
        return sch


def _spread(sch, loops, threads: int) -> None:
    """Fuse ``loops`` and spread them over work-groups of ``threads`` work-items."""
    bx, tx = sch.split(sch.fuse(*loops), factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


class LeadingLoops(GPUScheduleRule):
    """Last-resort GPU schedule: per block, the leading loops of constant extent that run over
    its spatial axes are fused and spread over work-groups of ``max_threads_per_block``; the
    rest runs inside each thread. It takes kernels the other rules refuse, such as adaptive
    pooling whose window bounds depend on the output index."""

    def apply(self, func, target, _):
        if not isinstance(func, tvm.tirx.PrimFunc) or not self.is_target_available(target):
            return None
        threads = int(target.attrs.get("max_threads_per_block", 256))
        sch = tvm.s_tir.Schedule(func)
        root = sch.get_sblock("root")
        for block in sch.get_child_blocks(root):
            loops = sch.get_loops(block)
            n_spatial = sum(1 for iv in sch.get(block).iter_vars
                            if iv.iter_type == tvm.tirx.IterVar.DataPar)
            lead = []
            for loop in loops[:n_spatial]:
                if not isinstance(sch.get(loop).extent, tvm.tirx.IntImm):
                    break
                lead.append(loop)
            _spread(sch, lead or [sch.add_unit_loop(block)], threads)
        return sch


def _contraction(block) -> bool:
    """Whether two or more of ``block``'s operands are indexed by its reduction iterators (a
    matmul or a convolution's weight gradient, as opposed to a plain sum of one operand)."""
    reduce_vars = [iv.var for iv in block.iter_vars
                   if iv.iter_type == tvm.tirx.IterVar.CommReduce]
    indexed = sum(1 for region in block.reads
                  if any(_uses(r.min, reduce_vars) for r in region.region))
    return indexed >= 2


def _uses(expr, variables) -> bool:
    """Whether TIR expression ``expr`` refers to one of ``variables`` (compared by identity:
    ``==`` on TIR variables builds an expression)."""
    used = tvm.tirx.analysis.undefined_vars(expr, [])
    return any(u.same_as(v) for u in used for v in variables)


def _reduction_blocks(func: tvm.tirx.PrimFunc) -> list:
    """The reduction blocks (blocks with an init statement) of ``func``, in post order."""
    import tvm_ffi

    found = []

    def visit(block) -> None:
        if block.init is not None:
            found.append(block)

    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, visit)], order="post")
    return found


def tuple_reduction(func: tvm.tirx.PrimFunc) -> bool:
    """True when a reduction block of ``func`` writes several buffers at once (the argmax of
    max-pooling's backward): TVM cannot split such a reduction across threads ("no matched
    reducer"), so only the thread-per-output schedules apply."""
    return any(len(block.writes) > 1 for block in _reduction_blocks(func))


def shared_bytes(func: tvm.tirx.PrimFunc, target: tvm.target.Target | None = None) -> int:
    """Bytes of shared (work-group local) memory a scheduled kernel allocates, static shapes.

    Counted after buffer compaction, as the kernel is built: a schedule declares its shared
    staging buffers at the full shape of the tensor they tile (a 4096x9216 weight for a 32x8
    tile of it) and ``CompactBufferAllocation`` shrinks them to the region each work-group
    touches. Counting the declared shapes rejected every tiled matmul schedule of dlight
    (152 MB "staged" for AlexNet's first fully connected layer, 2 KiB in fact)."""
    import tvm_ffi
    from tvm.s_tir import transform as st

    lower = tvm.ir.transform.Sequential([
        st.LowerCrossThreadReduction(), st.LowerInitBlock(),
        st.PlanAndUpdateBufferAllocationLocation(), st.ConvertBlocksToOpaque(),
        st.CompactBufferAllocation()])
    mod = tvm.IRModule({"main": func})
    try:
        with target if target is not None else contextlib.nullcontext():
            mod = lower(mod)
    except Exception:  # a schedule the passes refuse is counted as declared
        pass
    total = 0

    def visit(block) -> None:
        nonlocal total
        for buf in block.alloc_buffers:
            if buf.scope() == "shared":
                n = 1
                for d in buf.shape:
                    n *= int(d) if isinstance(d, tvm.tirx.IntImm) else 1 << 30
                total += n * tvm.DataType(buf.dtype).bits // 8

    tvm_ffi.structural_walk(mod["main"].body, [(tvm.s_tir.SBlock, visit)], order="post")
    return total


def reduction_shape(func: tvm.tirx.PrimFunc) -> tuple[int, int] | None:
    """(outputs, terms per output) of the largest reduction block of ``func``, or None when it
    has none or its extents are not constant."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    sch = tvm.s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    best = None
    for info in infos:
        kinds = info.dom_kind()
        if "R" not in kinds:
            continue
        loops = sch.get_loops(info.block_rv)
        out = terms = 1
        for lp, k in zip(loops, kinds):
            ext = sch.get(lp).extent
            if not isinstance(ext, tvm.tirx.IntImm):
                return None
            if k == "S":
                out *= int(ext)
            elif k == "R":
                terms *= int(ext)
        if best is None or out * terms > best[0] * best[1]:
            best = (out, terms)
    return best


class _SizeGate:
    """Mixin: the rule applies only to kernels whose largest reduction
    (:func:`reduction_shape`) has at least ``min_outputs`` outputs and sums at least
    ``min_terms`` terms per output."""

    min_outputs = 1
    min_terms = 1

    def apply(self, func, target, tunable):
        if not isinstance(func, tvm.tirx.PrimFunc):
            return None
        shape = reduction_shape(func)
        if shape is None or shape[0] < self.min_outputs or shape[1] < self.min_terms:
            return None
        return super().apply(func, target, tunable)


class WideMatmul(_SizeGate, dl.gpu.Matmul):
    """dlight's tiled matmul (shared-memory tiles, a register tile per thread) for matmuls with
    long sums (at least ``min_terms`` terms) and at least ``min_outputs`` outputs: enough 32x32
    tiles to give every compute unit work. Fully connected layers are such (32x4096 outputs
    for AlexNet's first at batch 32, a sum of 9,216 terms each): :class:`LongReduction` would
    give each output a work-group of its own whose threads read a column of the weight matrix
    (238 GFLOP/s on the H100, 10 ms per step). Matmuls with few outputs and long sums (weight
    gradients) stay with :class:`LongReduction`, which splits the sum; those with short sums
    (most 1x1 convolutions) keep the thread-per-output fallback."""

    min_outputs = 1 << 16
    min_terms = 2048


class _LongSums(_SizeGate):
    """Mixin: the rule applies only to kernels whose reduction sums at least ``min_terms``
    terms per output. dlight's reduction rules give each output (or row) a work-group whose
    threads split the sum; for the short sums of convolutions (27 terms for a 3x3x3 filter,
    9 for a depthwise one) that leaves most threads idle where one thread per output does the
    whole sum."""

    min_terms = 256


class LongRowReduction(_LongSums, dl.gpu.Reduction):
    """dlight's ``Reduction`` rule, for long sums only (see :class:`_LongSums`)."""


class LongGeneralReduction(_LongSums, dl.gpu.GeneralReduction):
    """dlight's ``GeneralReduction`` rule, for long sums only (see :class:`_LongSums`)."""


#: dlight's own default GPU rules, in its order (``tvm.s_tir.dlight.gpu``), with no rule of
#: thomas_tune's: what TVM schedules an untuned kernel with. ``thomas-tune bench
#: --stock-defaults`` builds a variant with them, to show what the rules above and tuning each
#: add
STOCK_RULES = (dl.gpu.Matmul, dl.gpu.GEMV, dl.gpu.Reduction, dl.gpu.GeneralReduction)

GPU_RULES = (WinogradTransform, WideMatmul, LongReduction, dl.gpu.Matmul, dl.gpu.GEMV,
             LongRowReduction, LongGeneralReduction)


def default_gpu_schedules(mod: tvm.IRModule, target: tvm.target.Target,
                          rule_classes=None) -> tvm.IRModule:
    """Give every kernel without a schedule (no tuning record) dlight's default GPU schedule.

    ``rule_classes``: the rules to try first, :data:`GPU_RULES` when None (:data:`STOCK_RULES`
    for TVM's own defaults).

    Rules are tried in order per kernel (:class:`WideMatmul` for matmuls with many outputs, long
    reductions split across threads, matmul, GEMV, reduction, general reduction); a rule
    that does not match, or fails on an unusual backward kernel (some dlight rules assert on
    them in this TVM), is skipped, as is a schedule that stages more in shared memory than the
    target allows; then ``Fallback`` (thread-bound loops), and :class:`LeadingLoops` last.
    Kernels with a tuple reduction (:func:`tuple_reduction`) go straight to those two.
    """
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    smem = int(target.attrs.get("max_shared_memory_per_block", 16384))
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and \
                func.attrs.get("tir.is_scheduled", False):
            continue
        sch = None
        rules = ([r() for r in (GPU_RULES if rule_classes is None else rule_classes)]
                 if not tuple_reduction(func) else [])
        for rule in (*rules, dl.gpu.Fallback(), LeadingLoops()):
            try:
                with target:
                    sch = rule.apply(func, target, False)
            except Exception:  # a rule that cannot handle this kernel: try the next
                sch = None
            if isinstance(sch, list):
                sch = sch[0] if sch else None
            if sch is not None and shared_bytes(sch.mod["main"], target) > smem:
                sch = None  # (dlight stages whole tensors of some backward kernels in shared)
            if sch is not None:
                break
        if sch is None:
            raise ValueError(f"no GPU schedule for kernel {gv.name_hint}")
        out[gv] = sch.mod["main"].with_attr("tir.is_scheduled", True)
    return out
