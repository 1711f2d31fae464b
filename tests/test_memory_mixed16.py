"""Device memory of the half-storage step (``--precision mixed16``): ``thomas-tune memory
--precision mixed16`` plans the mixed16 step (its estimate within 10% of the peak PoCL measures
in a fresh process, ``benchmark.device_memory``), and that step holds less than the float32
one by what the design claims (docs/benchmarks.md, memory section): its float16 and float32
tensors share storages (:mod:`thomas_tune.storage_merge`), its convolutions read stored
float16 data directly, and an activation of a stored value is stored too
(:mod:`thomas_tune.half_storage`)."""

import json

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard
from thomas_tune.models import build, init_params

BATCH = 8
#: MobileNetV2 0.35@64, 5 classes, batch 8: the mixed16 step's compiled peak at most these
#: fractions of float32's (estimated 0.770 and 0.844; without shared storages 0.84 and 0.94,
#: with convolutions reading float32 copies 0.77 and 0.99, without stored activations 0.77
#: and 0.98: docs/journal/memory.md)
AT_64 = {"all": 0.80, "last:2": 0.90}
#: MobileNetV2 0.35@32, 5 classes, batch 8, every layer: measured mixed16 peak at most this
#: fraction of float32's estimate (estimated 0.887; without shared storages 0.944)
AT_32 = 0.92


def test_half_storage_holds_less_than_float32_by_the_claim():
    """The compiled mixed16 step of MobileNetV2 0.35@64 at most :data:`AT_64` of float32's
    peak, every layer trained and the last two."""
    from thomas_tune.memory_plan import compiled_step_memory
    from thomas_tune.training_graph import graph as G
    model = build("mobilenet_v2", num_classes=5, resolution=64, width=0.35)
    for mode, most in AT_64.items():
        tg = G.training_module(model, BATCH, mode)  # (one graph for both precisions)
        f32 = compiled_step_memory(model, BATCH, mode, tg=tg).peak
        m16 = compiled_step_memory(model, BATCH, mode, tg=tg, precision="mixed16").peak
        print(mode, "float32", f32, "mixed16", m16, round(m16 / f32, 3))
        assert m16 <= most * f32, (mode, m16, f32)


def test_the_memory_verb_plans_the_precision_it_is_given(capsys):
    """``thomas-tune memory --precision mixed16`` reports the mixed16 step (below float32's),
    and with ``--memory-budget`` plans recomputation for that step: a budget between the
    mixed16 step and float32's needs none at mixed16."""
    from thomas_tune.cli.main import main
    common = ["memory", "--model", "mobilenet_v2", "--width", "0.35", "--resolution", "32",
              "--classes", "5", "--batch", str(BATCH), "--trainable", "last:2", "--json"]
    rows = {}
    for precision in ("float32", "mixed16"):
        assert main(common + ["--precision", precision]) == 0
        rows[precision] = json.loads(capsys.readouterr().out)[0]
    assert rows["mixed16"]["precision"] == "mixed16"
    f32, m16 = rows["float32"]["compiled_peak"], rows["mixed16"]["compiled_peak"]
    assert m16 < f32
    assert rows["mixed16"]["activations_kept"] < rows["float32"]["activations_kept"]
    budget_mb = (f32 + m16) / 2 / 1e6
    assert main(common + ["--precision", "mixed16", "--memory-budget", f"{budget_mb}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["level"] == "none" and plan["tried"][0]["peak_bytes"] == m16


@needs_opencl
def test_the_mixed16_estimate_is_within_ten_percent_of_the_measured_peak(tmp_path):
    """MobileNetV2 0.35@32, batch 8, every layer, exported at mixed16 for PoCL: the compiled
    estimate within 10% of the sidecar's measured peak, which is at most :data:`AT_32` of the
    float32 step's estimate (itself within about 1% of its measured peak:
    docs/journal/memory.md)."""
    from thomas_tune import opencl
    from thomas_tune.benchmark.exports import device_memory
    from thomas_tune.compiler.export import export
    from thomas_tune.memory_plan import compiled_step_memory
    from thomas_tune.training_graph import graph as G
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    out = str(tmp_path / "m16")
    export(out, model, init_params(model, seed=7), opencl.target_for(0), batch=BATCH,
           progress=lambda *_: None, check_records=False, precision="mixed16")
    measured = device_memory(out)
    tg = G.training_module(model, BATCH, "all")  # (one graph for both precisions)
    estimate = compiled_step_memory(model, BATCH, "all", tg=tg, precision="mixed16").peak
    f32 = compiled_step_memory(model, BATCH, "all", tg=tg).peak
    print("measured", measured, "estimate", estimate, "float32 estimate", f32)
    assert abs(estimate - measured) <= 0.1 * measured
    assert measured <= AT_32 * f32
