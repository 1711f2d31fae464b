"""Shared fixtures: small models, random tensors, a per-test random generator; the torch mirror
of the models lives in thomas_tune.reference."""

from __future__ import annotations

import os

# PoCL compiles each OpenCL program for this machine's CPU when a test first launches it: on a
# fresh machine (as CI's) most of the suite's PoCL time. The tests check what kernels compute,
# not how fast PoCL's code runs, so PoCL skips its optimisations for them: every clBuildProgram
# of the tests' processes and of the servers they start (the tvm_rpc ones, the emulated aarch64
# one included) takes the flag. Neither build contracts or reorders float arithmetic (no
# -cl-mad-enable or -cl-fast-relaxed-math): the same numbers (docs/journal/suite.md). Set
# before anything loads an OpenCL driver; tests/test_probe.py turns it off for its probes.
os.environ.setdefault("POCL_EXTRA_BUILD_FLAGS", "-cl-opt-disable")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from thomas_tune.reference import TorchGraph, torch_module  # noqa: F401, E402 (re-exported)
from thomas_tune.compiler.compile import reference_target  # noqa: E402
from thomas_tune.target import parse_target  # noqa: E402

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


@pytest.fixture(scope="session", autouse=True)
def _shared_builds(tmp_path_factory):
    """The folder of the session's shared exports (tests/build_cache.py): under the session's
    temporary folder, the one both pytest-xdist workers' folders are made in."""
    import build_cache
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # <session>/popen-gwN: the session's own folder is its parent
    build_cache.ROOT = str(base / "shared-builds")
    yield build_cache.ROOT
    build_cache.ROOT = None


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


# How tests/run.sh hands the tests to its two workers (--dist loadgroup, in collection order:
# --no-loadscope-reorder). A unit of work is a test file (its module-scoped fixtures are made
# once), or, in the files of SPLIT, one test, or the tests that share one of the fixtures named
# there. Units are ordered by their cost, the costliest first, so that the long ones start
# first and the short ones fill the end of both workers, instead of one worker finishing a
# long unit alone. COST: seconds on 2 cores (docs/journal/suite.md: a clean clone's run on
# empty caches, --durations=0; files under 10 s and split tests under 5 s left out), per test
# file, or per test in the files of SPLIT (the test's name, parameters included); only the
# order matters, and a unit not listed costs nothing and keeps its place (collection order)
# after the others.
SPLIT = {"test_step_check.py": {"right"}, "test_adreno.py": set(), "test_tvm_rpc.py": set()}
COST: dict[str, float] = {
    "test_onnx_finetune.py": 205, "test_faults.py": 201, "test_half_reference.py": 195,
    "test_memory_budget.py": 184, "test_half_grads.py": 182, "test_bench.py": 143,
    "test_memory_mixed16.py": 136, "test_half_arith.py": 134, "test_replay.py": 133,
    "test_kinks.py": 133, "test_opencl_runtime.py": 120, "test_kernel_check.py": 117,
    "test_opencl_tuning.py": 112, "test_half_storage.py": 82, "test_lift.py": 80,
    "test_cost_model_search.py": 80, "test_seed_logs.py": 77, "test_aarch64.py": 74,
    "test_models.py": 63, "test_program_cache.py": 60, "test_probe.py": 56, "test_tuning.py": 54,
    "test_cache_features.py": 44, "test_pretrained.py": 40, "test_remote_device.py": 39,
    "test_export_train.py": 31, "test_search_spaces.py": 26, "test_kernel_scratch.py": 21,
    "test_cpu_sums.py": 21, "test_train_step.py": 18, "test_suite_guard.py": 17,
    "test_winograd.py": 13, "test_memory.py": 12, "test_gradients.py": 10,
    # test_tvm_rpc.py, one unit per test
    "test_tune_export_train_infer_through_tvm_rpc": 201,
    "test_adreno_export_trains_on_the_aarch64_tvm_rpc": 184,
    "test_session_bounds_are_those_of_tvm_rpc": 12,
    "test_a_vectorized_float16_epilogue_runs_on_tvm_rpc": 8,
    # test_adreno.py, one unit per test
    "test_tuned_records_for_the_adreno_target_compute_the_float64_step": 148,
    "test_adreno_builds_compute_the_float64_step_on_pocl[adreno540-mobilenet_v2]": 84,
    "test_adreno_builds_compute_the_float64_step_on_pocl[adreno540-alexnet]": 22,
    "test_dlight_adreno_configuration_is_kept_out_of_default_schedules": 7,
    # test_step_check.py, one unit per test (the right build's tests in one unit)
    "test_the_right_build_passes_on_fresh_seeds_and_the_inputs_reach_every_path": 54,
    "test_every_parameters_gradient_off_fails_by_name[1.01x]": 9,
    "test_every_parameters_gradient_off_fails_by_name[wrong-sign]": 9,
    "test_a_build_with_a_wrong_backward_fails[ReLU6 above 6 (no upper clip)-all-mobilenet_v2]":
        44,
    "test_a_build_with_a_wrong_backward_fails[BatchNorm bias x1.01-last:4-mobilenet_v1]": 21,
    "test_a_build_with_a_wrong_backward_fails[loss, last class x1.1-last:3-alexnet]": 3,
    **{f"test_a_build_with_a_wrong_optimizer_update_fails[{m}]": 5 for m in (
        "momentum update x1.01 (learning rate)", "momentum update wrong sign",
        "momentum buffer x1.01", "momentum buffer wrong sign")},
}


def _unit(item) -> str:
    """The unit of work ``item`` belongs to (see :data:`SPLIT`)."""
    name = item.path.name
    if name not in SPLIT:
        return name
    shared = sorted(SPLIT[name] & set(item.fixturenames))
    return f"{name}::{'+'.join(shared) if shared else item.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Order the collected tests by unit of work, the costliest first (:data:`COST`; a stable
    sort: the tests of a unit keep their order), and under --dist loadgroup mark each with its
    unit (an ``xdist_group`` of the unit's name, brackets and ``@`` replaced)."""
    units = {}
    for item in items:
        unit = _unit(item)
        units[unit] = units.get(unit, 0.0) + COST.get(
            item.name if item.path.name in SPLIT else item.path.name, 0.0)
    for item in items:  # a file's cost is counted once per test above: once is enough
        if item.path.name not in SPLIT:
            units[item.path.name] = COST.get(item.path.name, 0.0)
    items.sort(key=lambda item: -units[_unit(item)])
    if getattr(config.option, "loadgroup", False):
        for item in items:
            group = _unit(item).translate(str.maketrans("[]@", "()_"))
            item.add_marker(pytest.mark.xdist_group(group))


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
