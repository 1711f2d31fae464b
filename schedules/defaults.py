"""Default GPU schedules of untuned kernels: dlight's rules with thomas_tune's gated ones first."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import tempfile

import tvm
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .blocks import tuple_reduction
from .winograd import WinogradTransform


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

        begun = _begin(self, func, target)
        if begun is None:
            return None
        sch, _, threads = begun
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


def _spread(sch, loops, threads: int):
    """Fuse ``loops`` and spread them over work-groups of ``threads`` work-items; returns the
    work-item loop."""
    bx, tx = sch.split(sch.fuse(*loops), factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return tx


def _begin(rule: GPUScheduleRule, func, target):
    """(schedule, its root block, ``max_threads_per_block``) of ``func`` for ``rule``, or
    None when ``func`` is not a PrimFunc or ``target`` not one the rule serves."""
    if not isinstance(func, tvm.tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = tvm.s_tir.Schedule(func)
    return sch, sch.get_sblock("root"), int(target.attrs.get("max_threads_per_block", 256))


def _n_spatial(sch, block) -> int:
    """The number of data-parallel (spatial) axes of ``block``."""
    return sum(1 for iv in sch.get(block).iter_vars if iv.iter_type == tvm.tirx.IterVar.DataPar)


class LeadingLoops(GPUScheduleRule):
    """Last-resort GPU schedule: per block, the leading loops of constant extent that run over
    its spatial axes are fused and spread over work-groups of ``max_threads_per_block``; the
    rest runs inside each thread. It takes kernels the other rules refuse, such as adaptive
    pooling whose window bounds depend on the output index."""

    def apply(self, func, target, _):
        begun = _begin(self, func, target)
        if begun is None:
            return None
        sch, root, threads = begun
        for block in sch.get_child_blocks(root):
            loops = sch.get_loops(block)
            lead = []
            for loop in loops[:_n_spatial(sch, block)]:
                if not isinstance(sch.get(loop).extent, tvm.tirx.IntImm):
                    break
                lead.append(loop)
            _spread(sch, lead or [sch.add_unit_loop(block)], threads)
        return sch


class ReductionEpilogue(GPUScheduleRule):
    """One reduction with element-wise work after it, in one kernel: a depthwise or grouped
    convolution with its bias, BatchNorm and activation, a pooling with what follows. dlight's
    ``Fallback`` gives such a kernel two launches, the reduction writing an intermediate tensor
    that the element-wise part reads back; on a phone each launch and each pass over memory
    costs. Here the producers of the reduction that are element-wise (padding) are inlined,
    the element-wise consumers chained after it are inlined into the last of them, the
    reduction's spatial loops are spread over work-groups of ``max_threads_per_block``
    work-items, each summing its own output element in order (Fallback's order), and the
    element-wise part is computed right after, under the same work-item. It applies only to a
    kernel of exactly that shape; others go on to the next rule."""

    def apply(self, func, target, _):
        begun = _begin(self, func, target)
        if begun is None:
            return None
        sch, root, threads = begun

        def is_reduction(block):
            return any(iv.iter_type == tvm.tirx.IterVar.CommReduce
                       for iv in sch.get(block).iter_vars)

        reductions = [b for b in sch.get_child_blocks(root) if is_reduction(b)]
        if len(reductions) != 1:
            return None
        (red,) = reductions
        # every element-wise block that feeds another is inlined into it: the padding into the
        # reduction, the epilogue's steps (and what they read of the parameters, a BatchNorm's
        # scale) into its last block
        for block in sch.get_child_blocks(root):
            if not sch.get(block).same_as(sch.get(red)) and sch.get_consumers(block):
                sch.compute_inline(block)
        rest = [b for b in sch.get_child_blocks(root) if not sch.get(b).same_as(sch.get(red))]
        if len(rest) != 1 or not any(sch.get(c).same_as(sch.get(rest[0]))
                                     for c in sch.get_consumers(red)):
            return None
        tx = _spread(sch, sch.get_loops(red)[:_n_spatial(sch, red)], threads)
        sch.reverse_compute_at(rest[0], tx)
        sch.set_scope(red, 0, "local")  # the reduction's value stays in the work-item
        return sch


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
             LongRowReduction, LongGeneralReduction, ReductionEpilogue)


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
      :class:`LongReduction`).
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
            sch = tvm.s_tir.Schedule(func)
            name = blocks[0].name_hint
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
                continue
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
            elif terms >= chain:
                # parts of the outermost summed axis (a convolution's input channels), so
                # that the loops over the others (the filter's rows and columns) stay whole:
                # k of its values per part, k dividing its extent, k times the other axes'
                # terms nearest sqrt(terms)
                first = int(sch.get(r_loops[0]).extent)
                rest = terms // first
                k = min((d for d in range(1, first + 1) if first % d == 0),
                        key=lambda d: abs(math.log(d * rest / terms ** 0.5)))
                if first // k < 2:
                    continue
                outer, _ = sch.split(r_loops[0], [first // k, k])
                sch.reorder(*s_loops, outer)
                rf = sch.rfactor(outer, 0)
                # the write-back block's loops: the outputs, then the parts; the partial
                # sums of one output are made right before they are added
                wb_loops = sch.get_loops(sch.get_sblock(name))
                sch.compute_at(rf, wb_loops[len(s_loops) - 1])
            else:
                continue
            out[gv] = sch.mod["main"]
        except Exception:  # the kernel stays unsplit (right, with longer sums)
            continue
    return out


def default_schedules(mod: tvm.IRModule, target: tvm.target.Target,
                      rule_classes=None) -> tvm.IRModule:
    """The kernels of ``mod`` as an untuned build compiles them for ``target``: on GPU targets
    (:func:`thomas_tune.target.is_gpu`), :func:`default_gpu_schedules` (``rule_classes`` as
    there); on CPUs, the long sums and long loops split
    (:func:`split_long_sums`, then :func:`split_long_loops`). Kernels already scheduled are
    left as they are. Raises what :func:`default_gpu_schedules` raises."""
    from ..target import is_gpu
    if is_gpu(target):
        return default_gpu_schedules(mod, target, rule_classes)
    return split_long_loops(split_long_sums(mod))


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


def default_gpu_schedules(mod: tvm.IRModule, target: tvm.target.Target,
                          rule_classes=None) -> tvm.IRModule:
    """Give every kernel without a schedule (no tuning record) dlight's default GPU schedule.

    ``rule_classes``: the rules to try first, :data:`GPU_RULES` when None (:data:`STOCK_RULES`
    for TVM's own defaults).

    Rules are tried in order per kernel (:class:`WideMatmul` for matmuls with many outputs, long
    reductions split across threads, matmul, GEMV, reduction, general reduction, then
    :class:`ReductionEpilogue` for a reduction and its element-wise epilogue in one kernel,
    depthwise convolutions above all); a rule
    that does not match, or fails on an unusual backward kernel (some dlight rules assert on
    them in this TVM), is skipped, as is a schedule that stages more in shared memory than the
    target allows; then ``Fallback`` (thread-bound loops), and :class:`LeadingLoops` last.
    Kernels with a tuple reduction (:func:`tuple_reduction`) get :class:`LongReduction`
    (threads split the sum) where their sums are long, else go straight to those two.

    Each kernel's schedule is kept (:func:`cached_schedule`): a kernel met again, in this
    process or another (the untuned and the tuned build of one step share most kernels), is
    not scheduled again. Raises ValueError naming a kernel no rule schedules.
    """
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    rules = GPU_RULES if rule_classes is None else tuple(rule_classes)
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and \
                func.attrs.get("tir.is_scheduled", False):
            continue
        scheduled = cached_schedule(func, target, rules, _schedule_one)
        if scheduled is None:
            raise ValueError(f"no GPU schedule for kernel {gv.name_hint}")
        out[gv] = scheduled
    return out


def dlight_target(target: tvm.target.Target) -> tvm.target.Target:
    """The target dlight's rules schedule for: ``target`` itself, except an OpenCL target that
    dlight reads as an Adreno or Android device (``"adreno"`` in its attributes, ``"android"``
    in its host: ``tvm/s_tir/dlight/gpu/matmul.py`` and ``gemv.py`` then switch to their own
    Adreno configurations), which is given with ``device`` ``generic``, without the ``adreno``
    key and with a plain ``llvm`` host; its limits are unchanged.

    Why: with the Adreno configuration, dlight's ``Matmul`` schedules the data gradient of a
    1x1 convolution fused with the ReLU6 gradient mask (``conv2d_transpose ... where``) into a
    kernel that computes wrong numbers (relative error about 1 against the same kernel's
    generic schedule, on PoCL, for 11 kernels of MobileNetV2's training step;
    ``tests/test_adreno.py``), and a wrong default schedule would also be the reference that
    every tuned candidate is checked against."""
    if target.kind.name != "opencl":
        return target
    host = str(target.host) if target.host is not None else ""
    if "adreno" not in str(target.attrs) and "android" not in host:
        return target
    spec = {k: v for k, v in target.export().items() if k not in ("host", "tag", "keys")}
    spec["device"] = "generic"
    return tvm.target.Target(spec, host={"kind": "llvm"})


def _schedule_one(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rule_classes
                  ) -> tvm.tirx.PrimFunc | None:
    """``func`` with the first default schedule that applies (see
    :func:`default_gpu_schedules`), marked scheduled; None when none does. The rules see
    :func:`dlight_target` of ``target``."""
    smem = int(target.attrs.get("max_shared_memory_per_block", 16384))
    view = dlight_target(target)
    sch = None
    # a tuple reduction (two sums in one pass) can be split across threads, not rfactored
    rules = [r() for r in rule_classes] if not tuple_reduction(func) else [LongReduction()]
    for rule in (*rules, dl.gpu.Fallback(), LeadingLoops()):
        try:
            with view:
                sch = rule.apply(func, view, False)
        except Exception:  # a rule that cannot handle this kernel: try the next
            sch = None
        if isinstance(sch, list):
            sch = sch[0] if sch else None
        if sch is not None and shared_bytes(sch.mod["main"], target) > smem:
            sch = None  # (dlight stages whole tensors of some backward kernels in shared)
        if sch is not None:
            return sch.mod["main"].with_attr("tir.is_scheduled", True)
    return None


_SCHEDULED: dict[str, tvm.tirx.PrimFunc] = {}  # key -> scheduled kernel, for this process


@functools.cache
def _rules_version() -> str:
    """sha256 of this folder's Python sources and TVM's version: what a kept schedule was made
    with (a change of either makes every kept schedule stale)."""
    h = hashlib.sha256(tvm.__version__.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _schedule_dir() -> str | None:
    """The on-disk store of default schedules, ``$THOMAS_TUNE_CACHE/default_schedules`` (else
    ``~/.cache/thomas_tune/default_schedules``); None when ``THOMAS_TUNE_SCHEDULE_CACHE=off``
    (schedules are then kept for the process only)."""
    if os.environ.get("THOMAS_TUNE_SCHEDULE_CACHE") == "off":
        return None
    from ..opencl import _cache_dir  # the sidecar's, which every thomas_tune cache shares
    return os.path.join(_cache_dir(), "default_schedules")


def cached_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rule_classes,
                    schedule) -> tvm.tirx.PrimFunc | None:
    """``schedule(func, target, rule_classes)``, kept per kernel: in this process, and on disk
    (:func:`_schedule_dir`, one JSON file per kernel written atomically) for other processes.
    The key is the sha256 of the rules' version (:func:`_rules_version`), the rule classes'
    names, the target and the kernel's TVM JSON, so a kept schedule is only reused for the same
    kernel under the same rules. A kept file that does not load is scheduled again and
    rewritten."""
    h = hashlib.sha256()
    for part in (_rules_version(), ",".join(f"{r.__module__}.{r.__qualname__}"
                                            for r in rule_classes),
                 str(target), tvm.ir.save_json(func)):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()
    if key in _SCHEDULED:
        return _SCHEDULED[key]
    folder = _schedule_dir()
    path = os.path.join(folder, key[:2], key + ".json") if folder else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                _SCHEDULED[key] = tvm.ir.load_json(f.read())
            return _SCHEDULED[key]
        except Exception:  # damaged or torn (TVM raises its own errors): make it again
            pass
    scheduled = schedule(func, target, rule_classes)
    if scheduled is None:
        return None
    _SCHEDULED[key] = scheduled
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(tvm.ir.save_json(scheduled))
            os.replace(tmp, path)
        except OSError:  # a read-only or full cache: the schedule is kept for this process
            pass
    return scheduled
