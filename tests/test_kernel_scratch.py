"""The scratch buffers of tuned kernels in the step's memory estimate
(``memory_plan.kernel_scratch``, the workspace pool of ``memory_plan._Pool.scratch``)."""

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms


def _row_sums(n: int = 64, m: int = 256) -> tvm.IRModule:
    a = te.placeholder((n, m), name="a")
    k = te.reduce_axis((0, m), name="k")
    s = te.compute((n,), lambda i: te.sum(a[i, k], axis=k), name="s")
    return tvm.IRModule({"main": te.create_prim_func([a, s])})


def test_a_record_with_an_rfactor_in_global_memory_is_counted_and_the_others_are_not():
    """A record that splits a row sum with ``rfactor`` (partial sums of 8 x 64 floats in
    global memory) gives its kernel 2,048 bytes of scratch; the same kernel without a record
    and a record that only splits loops give none."""
    from thomas_tune.memory_plan import kernel_scratch
    mod = _row_sums()
    target = tvm.target.Target({"kind": "opencl", "host": "llvm"})

    def record(rf: bool) -> ms.Database:
        sch = tvm.s_tir.Schedule(mod)
        block = sch.get_sblock("s")
        _, k = sch.get_loops(block)
        ko, _ = sch.split(k, [8, None])
        if rf:
            sch.rfactor(ko, 0)
        db = ms.database.MemoryDatabase()
        w = db.commit_workload(mod)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, w, [1e-4], target,
                                                         ms.arg_info.ArgInfo.from_prim_func(
                                                             mod["main"])))
        return db

    assert kernel_scratch(mod, target, record(True)) == {"main": [8 * 64 * 4]}
    assert kernel_scratch(mod, target, record(False)) == {}
    assert kernel_scratch(mod, target, ms.database.MemoryDatabase()) == {}


def test_the_workspace_pool_reuses_a_buffer_of_up_to_twice_the_request():
    """As the sidecar's ``AllocWorkspace``: a freed buffer serves a later request of half to
    all of its size; one that serves none is allocated and kept."""
    from thomas_tune.memory_plan import PAGE, _Pool
    pool = _Pool()
    pool.scratch([1000])
    assert pool.direct == 1000
    pool.scratch([600])  # 1000 <= 2 x 600 + PAGE: served by the kept buffer
    assert pool.direct == 1000
    pool.scratch([1000, 1000])  # two at once: a second buffer
    assert pool.direct == 2000
    big = 10 * PAGE
    pool.scratch([big])
    pool.scratch([big // 4])  # too small for the big one; the 1000-byte ones do not fit
    assert pool.direct == 2000 + big + big // 4
    assert pool.peak == pool.direct
    assert np.all(np.diff(pool.scratch_free) >= 0)
