"""The advice for BatchNorm-fused ONNX imports: ``train`` warns by trainable set, BatchNorm form
and learning rate as the advice says, and the advice agrees with the measurement it rests on
(``bench/results/fused_import.json``, written by ``python bench/fused_import.py``)."""

import json
import os

import numpy as np
import pytest

from thomas_tune.models.fused_advice import (ADVICE, STEADY_LR, fused_import_advice,
                                             fused_import_warning)

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                       "results", "fused_import.json")


def test_train_warns_on_every_fused_path_but_the_advised_one():
    # last layers with the default forms: the advised path, at any learning rate
    assert fused_import_warning("frozen-part", False, 0.01) is None
    assert fused_import_warning("frozen-part", False, None) is None
    # every layer from the import as it is: calibrate on the fine-tuning images
    steady = fused_import_warning("frozen-part", True, STEADY_LR)
    assert "--calibrate on your fine-tuning images" in steady and ADVICE[1] in steady
    assert "This export's lr" not in steady
    assert fused_import_warning("frozen-part", True, None) == steady
    # every layer: training form whatever the suffix says (no layer is frozen)
    assert fused_import_warning("train", True, STEADY_LR) == steady
    # above the steady rate the warning names the export's rate
    fast = fused_import_warning("frozen-part", True, 0.02)
    assert fast.startswith(steady) and "This export's lr 0.02 is above 0.005" in fast
    # frozen BatchNorm: named as the cause, with the advice of the trainable set's case
    for all_layers, case in ((False, ADVICE[0]), (True, ADVICE[1])):
        w = fused_import_warning("frozen", all_layers, STEADY_LR)
        assert "',frozen-bn' on a fused import" in w and w.endswith(case), w
    # last layers with every BatchNorm in training form: the frozen identities normalise
    w = fused_import_warning("train", False, STEADY_LR)
    assert "',train-bn'" in w and w.endswith(ADVICE[0]), w
    with pytest.raises(ValueError, match="frozen-part, train or frozen"):
        fused_import_warning("eval", True, 0.01)
    assert fused_import_advice() == list(ADVICE)


def _means(results):
    """(lr, trainable, path) -> (mean held-out accuracy in %, per-seed accuracies by seed)."""
    out = {}
    for r in results["runs"]:
        out.setdefault((r["lr"], r["trainable"], r["path"]), {})[r["seed"]] = 100 * r["acc_after"]
    return {k: (float(np.mean(list(v.values()))), v) for k, v in out.items()}


def test_the_advice_agrees_with_its_measurement():
    """Each claim of the advice, checked on the result file: a rerun of the benchmark that
    contradicts it fails here until the advice is revised."""
    results = json.load(open(RESULTS))
    m = _means(results)
    lrs = sorted({r["lr"] for r in results["runs"]})
    assert len(lrs) >= 2 and STEADY_LR in lrs and results["config"]["seeds"] >= 3
    fused = ("calibrated 0-4", "calibrated 5-9", "plain", "frozen-bn")
    for lr in lrs:
        # last layers: the import as it is, best of the fused paths (calibrating on the
        # pretraining task's images within 0.5 point of it), within 2 points of PyTorch;
        # calibrating on the new task's images and ',frozen-bn' 4 to 7.5 points lower
        last = {p: m[(lr, "last:2", p)][0] for p in fused + ("PyTorch",)}
        assert abs(last["plain"] - last["PyTorch"]) <= 2, (lr, last)
        assert abs(last["plain"] - last["calibrated 0-4"]) <= 0.5, (lr, last)
        for p in ("calibrated 5-9", "frozen-bn"):
            assert 4 <= last["plain"] - last[p] <= 7.5, (lr, p, last)
        # every layer: calibrated on the fine-tuning images, best of the fused paths, above
        # the import as it is seed by seed
        every = {p: m[(lr, "all", p)] for p in fused + ("PyTorch",)}
        best = every["calibrated 5-9"]
        assert all(best[0] > every[p][0] for p in fused if p != "calibrated 5-9"), (lr, every)
        assert all(best[1][s] > every["plain"][1][s] for s in best[1]), (lr, every)
        if lr <= STEADY_LR:  # level with PyTorch
            assert abs(best[0] - every["PyTorch"][0]) <= 1, (lr, every)
