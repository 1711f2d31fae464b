"""Default schedules of untuned kernels: on GPUs, dlight's rules with thomas_tune's gated ones
first (:mod:`.default_rules`), each kernel's kept (:mod:`.schedule_cache`); on CPUs, the long sums
and loops split (:mod:`.cpu_splits`)."""

from __future__ import annotations

import contextlib

import tvm
from tvm.s_tir import dlight as dl

from .blocks import tuple_reduction
from .cpu_splits import split_long_loops, split_long_sums
from .default_rules import GPU_RULES, LeadingLoops, LongReduction
from .schedule_cache import cached_schedule


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



def default_gpu_schedules(mod: tvm.IRModule, target: tvm.target.Target,
                          rule_classes=None) -> tvm.IRModule:
    """Give every kernel without a schedule (no tuning record) dlight's default GPU schedule.

    ``rule_classes``: the rules to try first, :data:`.default_rules.GPU_RULES` when None
    (:data:`.default_rules.STOCK_RULES` for TVM's own defaults).

    Rules are tried in order per kernel (:class:`.default_rules.WideMatmul` for matmuls with
    many outputs, long reductions split across threads, matmul, GEMV, reduction, general
    reduction, then :class:`.default_rules.ReductionEpilogue` for a reduction and its
    element-wise epilogue in one kernel, depthwise convolutions above all); a rule that does
    not match, or fails on an unusual backward kernel (some dlight rules assert on them in this
    TVM), is skipped, as is a schedule that stages more in shared memory than the target
    allows; then ``Fallback`` (thread-bound loops), and :class:`LeadingLoops` last. Kernels
    with a tuple reduction (:func:`tuple_reduction`) get :class:`LongReduction` (threads split
    the sum) where their sums are long, else go straight to those two.

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

    Why: with the Adreno configuration, dlight's ``Matmul`` vectorizes the ReLU6 gradient mask
    fused into a 1x1 convolution's data gradient (``conv2d_transpose ... where``), which TVM's
    OpenCL wrote wrong (relative error about 1, for 11 kernels of MobileNetV2's training step,
    on PoCL) until the build's vector-cast rewrite (``schedules/bool_casts.py``); a default
    schedule is the reference every tuned candidate is checked against. The generic
    configuration stays the default: both compute right now (``tests/test_adreno.py``), and
    which is faster on an Adreno has not been measured."""
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

