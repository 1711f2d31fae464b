"""Shared fixtures: small models, random tensors, a per-test random generator; the torch mirror
of the models lives in thomas_tune.reference."""

from __future__ import annotations

import os

import numpy as np
import pytest

from thomas_tune.reference import TorchGraph, torch_module  # noqa: F401 (re-exported)
from thomas_tune.compile import reference_target
from thomas_tune.target import parse_target

# llvm builds whose numbers are a reference and whose speed does not matter (LLVM opt-level 0)
REFERENCE = reference_target(parse_target("llvm"))


def random_tensors(model, rng):
    """Parameters from the model's initialisers plus non-trivial BN statistics and biases."""
    from thomas_tune.models import init_params
    t = init_params(model, seed=int(rng.integers(1 << 30)))
    for k in t:
        if k.endswith("running_mean") or k.endswith(".bias"):
            t[k] = rng.normal(0, 0.1, t[k].shape).astype("float32")
        elif k.endswith("running_var"):
            t[k] = rng.uniform(0.5, 1.5, t[k].shape).astype("float32")
        elif k.endswith(".weight") and t[k].ndim == 1:
            t[k] = rng.uniform(0.5, 1.5, t[k].shape).astype("float32")
    return t


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the OS: inputs differ from run to run."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def target():
    """The target of OpenCL device 0 (PoCL in tests and CI) as thomas_tune builds for it."""
    from thomas_tune import opencl
    return opencl.target_for(0)


SMALL = {
    "mobilenet_v2": dict(num_classes=5, resolution=64, width=0.35),
    "mobilenet_v1": dict(num_classes=5, resolution=64, width=0.25),
    "alexnet": dict(num_classes=5, resolution=67, width=0.1),
}


# The test files, costliest first (seconds of one clean-clone run on 2 cores: 221 down to 54),
# in the order the workers take them: tests/run.sh hands out whole files (--dist loadfile) in
# collection order (--no-loadscope-reorder), so the long files start first and the short
# ones, unlisted here, fill the end of both workers instead of one worker finishing a long
# file alone.
COSTLIEST_FIRST = ("test_onnx_finetune.py", "test_memory_budget.py", "test_faults.py",
                   "test_tuning.py",
                   "test_opencl_tuning.py", "test_opencl_runtime.py", "test_adreno.py",
                   "test_kernel_check.py", "test_replay.py", "test_models.py", "test_bench.py",
                   "test_aarch64.py", "test_export_train.py", "test_pretrained.py")


def pytest_collection_modifyitems(config, items):
    """Order the collected tests by file, :data:`COSTLIEST_FIRST` first (a stable sort: the
    tests of a file keep their order)."""
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


#: Set (as .ci/run does) to make every skip of the suite a failure: CI installs every
#: dependency (PyTorch, ONNX Runtime, PoCL, the emulated aarch64 device), so a test that skips
#: there is a test that did not run. Every skip goes through pytest's skip (``importorskip``,
#: ``skipif`` marks, ``pytest.skip``), and the two hooks below see them all, at collection
#: (module-level ``importorskip``) and at each test.
NO_SKIP = "THOMAS_TUNE_NO_SKIP"


def _fail_a_skip(report) -> None:
    if report.skipped and os.environ.get(NO_SKIP) and not hasattr(report, "wasxfail"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{NO_SKIP} is set, so a skip is a failure: {why}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_a_skip(outcome.get_result())
