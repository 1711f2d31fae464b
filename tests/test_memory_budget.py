"""The compiled step's memory estimate against the device's measured peak, and the memory
budget: real OpenCL exports on PoCL (MobileNetV2 0.35@32, 5 classes, batch 8; AlexNet
w0.1@67; the planner on MobileNetV1 0.25@32), their peak measured by the sidecar in a fresh process
(``benchmark.device_memory``), the budgeted step checked against PyTorch float64."""

import os

import pytest

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard
from thomas_tune.models import build, init_params
from thomas_tune.manifest import Manifest

V1 = dict(num_classes=5, resolution=32, width=0.25)
V2 = dict(num_classes=5, resolution=32, width=0.35)
BATCH = 8  # the step check's bounds hold for a BatchNorm over 8 values or more (1x1 x 8 here)


def _export(out, model, **kw):
    from thomas_tune import opencl
    from thomas_tune.compiler.export import export
    export(out, model, init_params(model, seed=7), opencl.target_for(0), batch=BATCH,
           progress=lambda *_: None, check_records=False, **kw)
    return out


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    """MobileNetV2 0.35@32, batch 8 (test_step_check's network, whose check holds on fresh
    seeds) with a budget between the step's peak with recomputation and without."""
    from thomas_tune.memory_plan import compiled_step_memory
    from thomas_tune.recompute import RecomputePlan
    from thomas_tune.training_graph import graph as G
    model = build("mobilenet_v2", **V2)
    tg = G.training_module(model, BATCH, "all")  # (one graph for both estimates)
    full = compiled_step_memory(model, BATCH, "all", tg=tg).peak
    cheap = compiled_step_memory(model, BATCH, "all", budget_plan=RecomputePlan("elementwise"),
                                 tg=tg)
    budget = (full + cheap.peak) // 2
    out = _export(str(tmp_path_factory.mktemp("budget") / "v1"), model, memory_budget=budget)
    return {"dir": out, "budget": budget, "full": full, "estimate": cheap.peak}


def test_the_planner_recomputes_and_the_compiled_plan_lends_the_storage():
    """Recomputing the BatchNorm-with-activation outputs in the backward leaves each of them
    read only by copies made there (none by the backward from the forward), the FLOPs added are
    7 per element recomputed, and the compiled step's peak drops by at least half of the bytes
    no longer kept from the forward to the backward (the rest: the copies' own short lives)."""
    from thomas_tune.training_graph import graph as G
    from thomas_tune.memory_plan import compiled_step_memory
    from thomas_tune.recompute import RecomputePlan, apply_plan
    model = build("mobilenet_v1", **V1)
    tg = G.training_module(model, BATCH, "all")
    plan = RecomputePlan("elementwise")
    new = apply_plan(tg, plan)
    assert plan.recomputed and all(r.op.startswith("bn_act") for r in plan.recomputed)
    assert plan.flops_added == sum(7 * r.bytes // 4 for r in plan.recomputed)
    text = new.mod[G.ADJOINT].script()
    assert text.count("_recomputed") >= 2 * len(plan.recomputed)
    full = compiled_step_memory(model, BATCH, "all", tg=tg).peak
    less = compiled_step_memory(model, BATCH, "all", budget_plan=RecomputePlan("elementwise"),
                                tg=tg).peak
    kept = sum(r.bytes for r in plan.recomputed)
    assert full - less >= kept / 2, (full, less, kept)


@needs_opencl
def test_a_budget_forces_recomputation_measured_under_it_and_the_step_is_right(budgeted):
    """The export under a budget below its plain step's estimated peak recomputes (its
    manifest says what), measures at most the budget on the device, within 10% of the
    estimate; and its training step passes the step check (the same math)."""
    from thomas_tune.benchmark.exports import device_memory
    from thomas_tune.export_check import check_export
    pytest.importorskip("torch")
    b = Manifest.read(budgeted["dir"]).memory_budget
    assert b["level"] == "elementwise" and b["recomputed"] and b["flops_added"] > 0
    assert b["budget_bytes"] == budgeted["budget"] < budgeted["full"]
    measured = device_memory(budgeted["dir"])
    print("budget", budgeted["budget"], "measured", measured, "estimate", budgeted["estimate"],
          "plain estimate", budgeted["full"])
    assert measured <= budgeted["budget"]
    assert abs(budgeted["estimate"] - measured) <= 0.1 * measured
    check = check_export(budgeted["dir"], seed=int.from_bytes(os.urandom(3), "little"))
    assert check.ok, check.line()


@needs_opencl
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(tmp_path):
    """AlexNet w0.1@67, last:3, batch 4 (the lifted frozen part's transforms held beside the
    step): ``thomas-tune memory``'s compiled peak within 10% of the sidecar's measured peak,
    where the training graph's liveness bound is not what a device holds. (The session's
    build of tests/test_lift.py and tests/test_train_step.py, built once.)"""
    from build_cache import export  # the session's build of these inputs
    from thomas_tune import opencl
    from thomas_tune.benchmark.exports import device_memory
    from thomas_tune.memory_plan import compiled_step_memory
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    out = str(tmp_path / "ax")
    export(out, model, init_params(model, seed=7), opencl.target_for(0), batch=4,
           infer_batch=1, trainable="last:3", progress=lambda *_: None)
    measured = device_memory(out)
    estimate = compiled_step_memory(model, 4, "last:3").peak
    print("measured", measured, "estimate", estimate)
    assert abs(estimate - measured) <= 0.1 * measured


def test_a_budget_too_small_is_refused_naming_the_smallest_that_fits():
    """A budget below every plan: BudgetError (a ValueError) whose message names the smallest
    budget in MB, the least peak of the levels it tried (every level of
    :data:`~thomas_tune.recompute.LEVELS`, recomputing more than none). That a budget of a
    level's peak is accepted is the planner's comparison (``<=``), which the budgeted export
    above goes through."""
    from thomas_tune.memory_plan import plan_for_budget
    from thomas_tune.recompute import LEVELS, BudgetError
    model = build("mobilenet_v1", **V1)
    with pytest.raises(BudgetError) as err:
        plan_for_budget(model, BATCH, "all", None, 10**6)
    smallest, tried = err.value.smallest, err.value.tried
    assert f"{-(-smallest // 10**5) / 10:.1f} MB" in str(err.value), str(err.value)
    assert "--memory-budget" in str(err.value)
    assert [t["level"] for t in tried] == list(LEVELS)
    least = min(tried, key=lambda t: t["peak_bytes"])
    assert least["peak_bytes"] == smallest and least["level"] != "none"
    assert smallest < tried[0]["peak_bytes"] and least["recomputed"] > 0


def test_segments_keep_the_convolutions_of_their_phase():
    """``segments:k@p`` recomputes every BatchNorm layer's convolution output but those at
    positions p, p + k, ... in forward order: the three phases of k = 3 each keep a different
    third and recompute the rest, so each output is recomputed by exactly two of them
    (``segments:3`` is ``segments:3@0``); the budget planner tries every phase
    (:data:`~thomas_tune.recompute.LEVELS`); a phase out of range is refused by name."""
    from thomas_tune.training_graph import graph as G
    from thomas_tune.recompute import LEVELS, RecomputePlan, apply_plan
    model = build("mobilenet_v1", **V1)
    tg = G.training_module(model, BATCH, "all")

    def convs(level):
        plan = RecomputePlan(level)
        apply_plan(tg, plan)
        return {r.name for r in plan.recomputed if r.op == "relax.nn.conv2d"}
    phases = [convs(f"segments:3@{p}") for p in range(3)]
    every = set().union(*phases)
    counts = {n: sum(n in c for c in phases) for n in every}
    assert len(every) >= 6 and set(counts.values()) == {2}, counts
    assert convs("segments:3") == phases[0] != phases[1]
    assert {f"segments:{k}@{p}" for k in (2, 3) for p in range(k)} <= set(LEVELS)
    with pytest.raises(ValueError, match="segments:3@3"):
        convs("segments:3@3")
