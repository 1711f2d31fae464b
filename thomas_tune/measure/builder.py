"""The builder of the tuner: candidates built in one pool of processes, as shared libraries.

MetaSchedule's own LocalBuilder starts a fresh pool of worker processes for every batch (each
worker imports TVM first) and exports candidates as tar files that the device server links with
its own compiler. :class:`Builder` keeps one pool of build processes for the whole run (recycled
every ``recycle_after`` builds per worker) and exports each candidate as a finished shared
library, so the device server only loads it. An OpenCL candidate whose work-items would each hold
more than :data:`MAX_PRIVATE_BYTES` of private arrays is not measured: its build fails with the
size, and the trial is recorded as a failed build without device time
(:func:`check_private_memory`).
"""

from __future__ import annotations

import os
import re
import tempfile
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from ..opencl_source import SCALAR_BYTES

from .phases import Phases
from .priority import lower_priority


def build_candidate(mod, target, _params=None):
    """Build one candidate (a scheduled TIR IRModule) for ``target``; returns the runtime module.

    MetaSchedule's default also imports ``tvm.s_tir.tensor_intrin`` in every worker (CUDA/ROCm
    intrinsic tables, tens of seconds); kernels tuned here use no tensor intrinsics, so it is
    skipped. The weight-layout rewrite blocks are dropped as MetaSchedule does. The code is
    generated for :func:`thomas_tune.target.codegen_target` (a GPU target's host code
    unoptimised: the runner times the kernel with the device's timer) and lowered by
    :func:`thomas_tune.schedules.tir_pipeline`, as a build of the whole step lowers it.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from ..schedules import tir_pipeline
    from ..target import codegen_target
    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod),
                     target=codegen_target(target), pipeline=tir_pipeline(target))


def export_candidate(rt_mod, target) -> str:
    """Write a built candidate as a shared library for the target's host; returns its path.

    The library is linked here (the device server only loads it): with this machine's C++
    compiler for a native host, with the cross compiler of ``TVM_NDK_CC`` for another one
    (``target.export_shared``; ValueError when it is missing or compiles for another machine)."""
    from ..target import export_shared
    folder = tempfile.mkdtemp(prefix="thomas-tune-cand-")
    path = os.path.join(folder, "candidate.so")
    export_shared(rt_mod, path, target)
    return path


# Private arrays per work-item above which a built OpenCL candidate is not measured. An NVIDIA
# thread addresses at most 255 32-bit registers, 1,020 bytes (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"); an Adreno fiber fewer. Four times that
# spills to memory whatever the compiler does. On the H100, 298 trials of the committed logs
# failed at launch with CL_OUT_OF_HOST_MEMORY or CL_OUT_OF_RESOURCES; 269 of them report the
# driver's private memory per work-item, and 263 of those had 4 KiB or more (most 16 KiB or
# more, up to 1.2 MB). Each such failure also costs its lane a new session.
MAX_PRIVATE_BYTES = 4096


_CL_ARRAY = re.compile(r"^\s*(?:__private\s+)?(" + "|".join(SCALAR_BYTES)
                       + r")(\d*)\s+\w+\[(\d+)\];", re.M)


def private_array_bytes(source: str) -> int:
    """Bytes of the private arrays (declared without ``__local``) of the OpenCL C kernel in
    ``source`` that declares the most; vector types count their lanes (``float3`` as 4)."""
    most = 0
    for kernel in source.split("__kernel ")[1:]:
        total = 0
        for scalar, lanes, count in _CL_ARRAY.findall(kernel):
            n = int(lanes) if lanes else 1
            total += SCALAR_BYTES[scalar] * (4 if n == 3 else n) * int(count)
        most = max(most, total)
    return most


def check_private_memory(rt_mod, target, limit: int = MAX_PRIVATE_BYTES) -> int:
    """Bytes of private arrays per work-item of the built candidate ``rt_mod`` (its OpenCL C
    source, :func:`private_array_bytes`; 0 for a target of another kind). Raises ValueError,
    naming the size and ``limit``, when it is over ``limit``. Counted in the generated source:
    the scheduled TIR can declare a per-thread buffer that lowering widens (a depthwise data
    gradient of MobileNetV2 whose 2,688-byte local tile became a 1.2 MB array)."""
    if target.kind.name != "opencl":
        return 0
    sources = []
    for m in rt_mod.imports:
        try:
            sources.append(m.inspect_source())
        except Exception:  # a module without source (none on OpenCL)
            pass
    n = max((private_array_bytes(src) for src in sources), default=0)
    if n > limit:
        raise ValueError(f"private memory {n} bytes per work-item, over the builder's limit of "
                         f"{limit} (MAX_PRIVATE_BYTES): arrays this large spill to memory; "
                         "not measured")
    return n


def _build_one(mod, target):
    t0 = time.perf_counter()
    rt_mod = build_candidate(mod, target)
    check_private_memory(rt_mod, target)
    t1 = time.perf_counter()
    path = export_candidate(rt_mod, target)
    return path, t1 - t0, time.perf_counter() - t1


@derived_object
class Builder(ms.builder.PyBuilder):
    """Builds candidates in a pool of ``max_workers`` processes kept for the whole run.

    Each candidate: ``build_candidate`` then ``export_candidate``. A build over ``timeout_s``
    kills its worker and is reported as a failed build with that reason. Workers are replaced
    after ``recycle_after`` batches (TVM's build workers grow in memory over many builds).
    """

    def __init__(self, max_workers: int | None = None, timeout_s: float = 60.0,
                 recycle_after: int = 50, phases: Phases | None = None):
        super().__init__()
        self.max_workers = max_workers or max(1, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.recycle_after = recycle_after
        self.phases = phases or Phases()
        self._pool = None
        self._batches = 0

    def _get_pool(self) -> PopenPoolExecutor:
        if self._pool is None or self._batches >= self.recycle_after:
            if self._pool is not None:
                self._pool.shutdown()
            # builds run at low priority: on a machine that also times candidates, the timed
            # runs keep the CPU (:data:`COMPILE_NICE`)
            self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_s,
                                           initializer=lower_priority)
            self._batches = 0
        self._batches += 1
        return self._pool

    def build(self, build_inputs):
        t0 = time.perf_counter()
        pool = self._get_pool()
        results = []
        for r in pool.map_with_error_catching(lambda x: _build_one(*x),
                                              [(b.mod, b.target) for b in build_inputs]):
            if r.status == StatusKind.COMPLETE:
                path, t_build, t_export = r.value
                self.phases.add("build.compile", t_build)
                self.phases.add("build.export", t_export)
                results.append(ms.builder.BuilderResult(path, None))
            elif r.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"build timed out after {self.timeout_s:g} s (worker killed)"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed: {r.value}"))
        self.phases.add("build", time.perf_counter() - t0, wall=True, n=len(build_inputs))
        return results

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
