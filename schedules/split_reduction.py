"""Split reductions (split-K): long sums factored across work-groups."""

from __future__ import annotations

import math

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .blocks import indexed_contraction, reduction_blocks
from .padding import pad_in_fill
from .tiling import thread_extents, tiling_rule


#: partial sums a split-K space aims at (G x outputs), one space for each: enough work-groups
#: for a large GPU (the H100 has 132 multiprocessors) at every tiling the search draws
SPLIT_PARTIALS = (1 << 20, 1 << 22)


#: each partial sum keeps at least this many terms
SPLIT_MIN_TERMS = 64


#: kernels with more outputs are never split (splitting one loop into parts: up to 2^19 outputs,
#: so that up to 8 parts fit in the largest of :data:`SPLIT_PARTIALS`, 2^22 partial sums)
SPLIT_MAX_OUTPUTS = 1 << 19


#: a reduction of several values at once (BatchNorm's statistics, the two sums of its backward)
#: is split only with at most this many outputs (channels) and at least
#: :data:`TUPLE_MIN_TERMS` terms per output: a work-group per channel leaves most of a GPU idle
#: there (32 channels of 32x112x112 values ran at 105 GB/s on the H100), while a split costs a
#: second launch per call, which a kernel with enough channels does not repay
TUPLE_MAX_OUTPUTS = 256
TUPLE_MIN_TERMS = 1 << 14


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

    A reduction of several values at once (BatchNorm's statistics, a tuple reduction whose
    combiner TVM's registry knows: ``models/batchnorm.py``) is factored the same way, its
    partial results joined by its own combiner, where it has few outputs and long sums
    (:data:`TUPLE_MAX_OUTPUTS`, :data:`TUPLE_MIN_TERMS`); it is never tiled.

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
        self._tile = tiling_rule()
        self._threads = [t for t in thread_extents(max_threads) if t >= 32]
        self._tile._initialize_with_tune_context(context)

    def _factor_loops(self, sch, block) -> tuple[int, list[tuple[int, int | None]]]:
        """(number of spatial loops, [(index among the block's loops of a reduction loop to
        factor out, None to factor it out whole or the number of parts to split it into
        first)]); an empty list when the rule does not apply."""
        b = sch.get(block)
        loops = sch.get_loops(block)
        if b.init is None or not b.writes or len(loops) != len(b.iter_vars):
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
        if len(b.writes) > 1 and (outputs > TUPLE_MAX_OUTPUTS or terms < TUPLE_MIN_TERMS):
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
        contraction = indexed_contraction(sch.get(block)) and len(sch.get(block).writes) == 1
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
        if spaces and len(reduction_blocks(sch.mod["main"])) > 1:
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
