"""Default GPU schedule rules of thomas_tune: its own (long sums split across threads, a
reduction with its epilogue in one kernel, a last resort) and dlight's, gated by the size of the
kernel's reduction; :data:`GPU_RULES` in the order :func:`.defaults.default_gpu_schedules` tries
them, :data:`STOCK_RULES` dlight's own."""

from __future__ import annotations

import tvm
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

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
