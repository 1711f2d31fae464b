"""Search spaces for MetaSchedule: schedule rules, postprocessors and mutators per target.

CPU (``llvm``) uses MetaSchedule's own defaults. GPU targets (OpenCL above all: PoCL, NVIDIA, a
phone's Adreno) get the rule set written out here, its limits read from the target: thread
counts from ``max_threads_per_block`` and shared-memory tiling that respects
``max_shared_memory_per_block`` (16 KiB on the ``qcom/adreno-opencl`` tag; the Adreno 540 has
1 MB of on-chip memory in all, per Qualcomm's description), and ``thread_warp_size`` (1 on Adreno,
so cross-thread reductions use plain workgroup barriers).

One rule family per module: :mod:`.space` (the design space per target), :mod:`.tiling`,
:mod:`.padding`, :mod:`.split_reduction`, :mod:`.matmul_tiles`, :mod:`.skinny`, :mod:`.unroll`,
:mod:`.transfer` (schedules moved between twin kernels), :mod:`.defaults` (default schedules of
untuned kernels: the rules in :mod:`.default_rules`, kept by :mod:`.schedule_cache`; the CPU
passes in :mod:`.cpu_splits`), :mod:`.winograd`, :mod:`.accumulate` (long sums in two levels,
after scheduling), :mod:`.bool_casts` (vector casts of comparisons, after vectorizing);
:mod:`.traces`, :mod:`.blocks` and :mod:`.intrinsics` hold what they share. This package
re-exports their public names.
"""

from .accumulate import (CHAIN, MAX_ACCUMULATORS, TwoLevelSums, tir_pipeline,
                         two_level_sums)
from .blocks import contraction, padding_block, strided_read, tuple_reduction
from .cpu_splits import LONG_LOOP, split_long_loops, split_long_sums
from .default_rules import (GPU_RULES, STOCK_RULES, LeadingLoops, LongGeneralReduction,
                            LongReduction, LongRowReduction, ReductionEpilogue, WideMatmul,
                            reduction_shape)
from .defaults import default_gpu_schedules, default_schedules, dlight_target, shared_bytes
from .intrinsics import load_tensor_intrinsics
from .padding import (KEEP_PADDING, PaddingInFill, pad_in_fill, pads_a_contraction,
                      with_padding_in_fill)
from .space import gpu_mutators, gpu_postprocs, gpu_rules, space_generator
from .split_reduction import (SPLIT_MAX_OUTPUTS, SPLIT_MIN_TERMS, SPLIT_PARTIALS, SplitReduction,
                              split_parts)
from .tiling import Tiling
from .traces import before_postproc, json_default, plain_json, postprocessed
from .transfer import anchor_key, transferred
from .unroll import UNROLL_STEPS, sampled_unroll, unroll_steps, with_unroll, within_unroll
from .winograd import WinogradTransform

__all__ = [
    "CHAIN", "LONG_LOOP", "MAX_ACCUMULATORS", "TwoLevelSums", "tir_pipeline", "two_level_sums",
    "GPU_RULES", "KEEP_PADDING", "SPLIT_MAX_OUTPUTS", "SPLIT_MIN_TERMS", "SPLIT_PARTIALS",
    "STOCK_RULES", "UNROLL_STEPS", "LeadingLoops", "LongGeneralReduction", "LongReduction",
    "LongRowReduction", "PaddingInFill", "ReductionEpilogue", "SplitReduction", "Tiling",
    "WideMatmul",
    "WinogradTransform", "anchor_key", "before_postproc", "contraction", "default_gpu_schedules",
    "default_schedules",
    "dlight_target",
    "gpu_mutators", "gpu_postprocs", "gpu_rules", "json_default", "load_tensor_intrinsics",
    "pad_in_fill", "padding_block", "pads_a_contraction", "plain_json", "postprocessed",
    "reduction_shape", "sampled_unroll", "shared_bytes", "space_generator", "split_parts",
    "split_long_loops", "split_long_sums",
    "strided_read", "transferred", "tuple_reduction", "unroll_steps", "with_padding_in_fill",
    "with_unroll", "within_unroll",
]
