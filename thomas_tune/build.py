"""Compile a Relax graph for a target, applying the schedules of a tuning log.

Kernels with a tuning record get their tuned schedule (``MetaScheduleApplyDatabase``); on GPU
targets the rest get dlight's default GPU schedules so that every kernel has thread bindings.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms

from .target import is_gpu
from .tasks import fuse


def _pipeline(target: tvm.target.Target, database: ms.Database | None):
    @tvm.transform.module_pass(opt_level=0, name="ThomasTuneBuild")
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = fuse(mod)
        if database is not None:
            with target, database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        if is_gpu(target):
            with target:
                mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                              dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
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
