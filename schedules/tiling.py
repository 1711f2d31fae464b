"""Multi-level tiling for GPUs, with unstaged spaces for blocks that read through a stride."""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .blocks import strided_read
from .padding import pad_in_fill


def thread_extents(max_threads: int) -> list[int]:
    return [t for t in (16, 32, 64, 128, 256, 512, 1024) if t <= max_threads] or [max_threads]


def tiling_rule(staged: bool = True) -> ms.ScheduleRule:
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
    """Multi-level tiling (:func:`tiling_rule`), plus spaces that stage nothing in shared memory
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
        self._staged, self._direct = tiling_rule(), tiling_rule(staged=False)

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
