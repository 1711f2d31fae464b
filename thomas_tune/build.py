"""Compile a Relax graph for a target, applying the schedules of a tuning log.

Kernels with a tuning record get their tuned schedule (``MetaScheduleApplyDatabase``); on GPU
targets the rest get dlight's default GPU schedules so that every kernel has thread bindings.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms

from .target import is_gpu
from .tasks import fuse


GPU_RULES = (dl.gpu.Matmul, dl.gpu.GEMV, dl.gpu.Reduction, dl.gpu.GeneralReduction)


def default_gpu_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Give every kernel without a schedule (no tuning record) dlight's default GPU schedule.

    Rules are tried in order per kernel (matmul, GEMV, reduction, general reduction); a rule
    that does not match, or fails on an unusual backward kernel (some dlight rules assert on
    them in this TVM), is skipped, and ``Fallback`` (thread-bound loops) always applies.
    """
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is not None and \
                func.attrs.get("tir.is_scheduled", False):
            continue
        sch = None
        for rule in (*[r() for r in GPU_RULES], dl.gpu.Fallback()):
            try:
                with target:
                    sch = rule.apply(func, target, False)
            except Exception:  # a rule that cannot handle this kernel: try the next
                sch = None
            if isinstance(sch, list):
                sch = sch[0] if sch else None
            if sch is not None:
                break
        if sch is None:
            raise ValueError(f"no GPU schedule for kernel {gv.name_hint}")
        out[gv] = sch.mod["main"].with_attr("tir.is_scheduled", True)
    return out


def _pipeline(target: tvm.target.Target, database: ms.Database | None):
    @tvm.transform.module_pass(opt_level=0, name="ThomasTuneBuild")
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = fuse(mod)
        if database is not None:
            before = dict(mod.functions)
            with target, database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
            # kernels that got their tuned schedule are final: mark them so that the default
            # GPU schedules below leave them alone
            for gv, func in list(mod.functions.items()):
                if isinstance(func, tvm.tirx.PrimFunc) and not tvm_ffi.structural_equal(
                        func, before.get(gv)):
                    mod[gv] = func.with_attr("tir.is_scheduled", True)
        if is_gpu(target):
            mod = default_gpu_schedules(mod, target)
        passes = [relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
                  relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
                  relax.transform.StaticPlanBlockMemory(), relax.transform.LowerAllocTensor(),
                  relax.transform.KillAfterLastUse(), relax.transform.LowerRuntimeBuiltin(),
                  relax.transform.ComputePrimValue(), relax.transform.VMShapeLower(),
                  relax.transform.AttachGlobalSymbol()]
        return tvm.transform.Sequential(passes)(mod)

    return pipeline


def compile_graph(mod: tvm.IRModule, target: tvm.target.Target,
                  database: ms.Database | None = None) -> relax.VMExecutable:
    """Compile ``mod`` (unfused Relax) for ``target``; returns a Relax VM executable.

    ``database``: a MetaSchedule database (the tuning log) or None for default schedules.
    """
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target, relax_pipeline=_pipeline(target, database))
