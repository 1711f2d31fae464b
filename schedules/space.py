"""The design space per target: GPU schedule rules, postprocessors, mutators and their union."""

from __future__ import annotations

import tvm
from tvm.s_tir import meta_schedule as ms

from .intrinsics import load_tensor_intrinsics
from .matmul_tiles import tiled_spaces
from .padding import PaddingInFill
from .skinny import skinny_spaces
from .split_reduction import SplitReduction
from .tiling import Tiling, thread_extents
from .unroll import unroll_steps


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
    extents = thread_extents(max_threads)
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
