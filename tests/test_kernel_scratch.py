"""The scratch buffers of tuned kernels in the step's memory estimate
(``memory_plan.kernel_scratch``, the workspace pool of ``memory_plan._Pool.scratch``)."""

import os

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_a_budget_leaves_out_the_records_whose_scratch_costs_least_to_give_up():
    """``trade_records`` on MobileNetV1 0.25@32's compiled step (batch 8), three of its kernels
    given scratch buffers of their records: a budget the step fits only without some of them
    leaves out the record that loses the fewest ms per byte first, puts back one the fit does
    not need, never leaves out a record with no default time, and its estimate is the step's
    memory with the rest of the scratch."""
    from thomas_tune.memory_plan import lowered_training_module, step_memory, trade_records
    from thomas_tune.models import build
    from thomas_tune.manifest import TRAIN_STEP
    from thomas_tune.tasks import callees, workload_key
    model = build("mobilenet_v1", num_classes=5, resolution=32, width=0.25)
    mod, tg = lowered_training_module(model, 8, "all")
    once = sorted(n for n, c in callees(mod[TRAIN_STEP]).items() if c == 1)[:3]
    small, large, untimed = once
    bare = step_memory(mod, tg).peak
    mb = 1 << 20
    # no buffer within twice another's size: the pool serves none from another's
    scratch = {small: [mb], large: [4 * mb], untimed: [16 * mb]}
    full = step_memory(mod, tg, scratch=scratch).peak
    assert full >= bare + 16 * mb
    key = {n: workload_key(mod[n]) for n in once}
    gains = {key[small]: 0.01, key[large]: 0.2}  # ms per call: 0.01 and 0.05 ms per MB
    seen = []

    def gain(workloads):
        seen.append(set(workloads))
        return {k: v for k, v in gains.items() if k in workloads}

    def without(*names):
        return step_memory(mod, tg, scratch={n: v for n, v in scratch.items()
                                             if n not in names}).peak

    # over by less than the small one's 1 MB: the cheapest per byte goes, alone
    mem, left = trade_records(mod, tg, scratch, full - mb // 2, gain)
    assert seen == [set(key.values())]
    assert left == {key[small]: {"kernel": small, "scratch_bytes": mb, "ms_added": 0.01}}
    assert mem.peak == without(small) <= full - mb // 2
    # over by 3 MB: the small one first, not enough; then the large one, enough without the
    # small one, which is put back
    mem, left = trade_records(mod, tg, scratch, full - 3 * mb, gain)
    assert set(left) == {key[large]}, left
    assert left[key[large]]["ms_added"] == 0.2
    assert mem.peak == without(large) <= full - 3 * mb
    # over by more than the timed ones hold: no fit (the untimed one is never left out)
    mem, left = trade_records(mod, tg, scratch, full - 6 * mb, gain)
    assert mem is None and left == {}


def test_the_memory_verb_counts_a_logs_scratch_and_trades_records_for_a_budget(capsys):
    """``thomas-tune memory --log`` with the shipped PoCL log (three of its records allocate
    scratch buffers in the demo's step): a budget one page above the step without them fits
    at no recomputation with records left out, each named with the ms its default schedule
    adds; without ``--log`` the same budget also fits, with nothing left out."""
    import json

    from thomas_tune.cli.main import main
    from thomas_tune.memory_plan import PAGE, compiled_step_memory
    from thomas_tune.models import load_checkpoint
    ckpt = os.path.join(ROOT, "models", "pretrained", "mobilenet_v2-w0.35-r64-mnist0to4.npz")
    model, _, _ = load_checkpoint(ckpt)
    bare = compiled_step_memory(model, 8, "all").peak
    budget = bare + PAGE
    assert main(["memory", "--checkpoint", ckpt, "--batch", "8", "--trainable", "all",
                 "--json", "--memory-budget", f"{budget / 1e6}", "--target", "opencl",
                 "--log", os.path.join(ROOT, "tuning_logs", "pocl-x86_64",
                                       "mobilenet_v2-w0.35-r64-c5-b8")]) == 0
    out = json.loads(capsys.readouterr().out)
    first = out["tried"][0]
    assert out["plan"]["level"] == "none" == first["level"]
    assert bare <= first["peak_bytes"] <= budget
    assert first["saved_bytes"] > 0 and first["records_left_out"]
    assert all(v["ms_added"] > 0 and v["scratch_bytes"] > 0
               for v in first["records_left_out"].values())
