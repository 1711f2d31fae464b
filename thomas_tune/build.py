"""Compile a Relax graph for a target, applying the schedules of a tuning log.

Kernels with a tuning record get their tuned schedule (``MetaScheduleApplyDatabase``); on GPU
targets the rest get dlight's default GPU schedules so that every kernel has thread bindings.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from .schedules import default_gpu_schedules
from .target import is_gpu
from .tasks import fuse


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
