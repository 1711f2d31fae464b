"""Replay: compile from a tuning log with no device, report coverage, check the numbers.

Coverage is the share of tasks, of FLOPs (calls x FLOPs per call), and, where the log folder
holds default-schedule times measured on the device (``default_latency.json``), of the untuned
graphs' kernel time (calls x default time), whose workload has a tuning record that is
compiled (a valid record faster than the default schedule). Logs tuned by time share
(``tune --time-share``) are judged by the time: on a small network the slowest kernels are
rarely the ones with the most FLOPs. The numeric checks: every tuning record the build applies
runs once on this machine's device (PoCL's CPU device for GPU targets) against its default
schedule (:mod:`thomas_tune.compiler.record_check`); and, on ``llvm`` targets of this machine, the
tuned float32 inference and training graphs run against PyTorch in float64 (an independent
reference; without PyTorch no numeric check is claimed), on fresh random inputs and
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ..training_graph import graph as G
from .compile import compile_graph
from .build_plan import BuildPlan, check_plan
from ..models import init_params, spec
from ..logs import TuningLog


@dataclass
class ReplayReport:
    tasks: int = 0
    tuned: int = 0
    flops: float = 0.0
    tuned_flops: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)
    checked: bool = False
    slower: int = 0  # workloads whose best record lost to the default schedule (not applied)
    time_s: float | None = None  # untuned kernel time of the graphs (s), None: not measured
    tuned_time_s: float = 0.0  # of it, the time of tasks with a compiled record (s)
    #: applied records run on this machine's device against their default schedule
    #: (:mod:`thomas_tune.compiler.record_check`): how many, the wrong ones (workload key -> reason,
    #: left out of the build) and, where none could be run, why
    records_checked: int | None = None
    records_wrong: dict[str, str] = field(default_factory=dict)
    records_unchecked: str | None = None
    compiled: bool = False  # the graphs were compiled (not when the replay failed before)

    @property
    def task_coverage(self) -> float:
        return self.tuned / self.tasks if self.tasks else 0.0

    @property
    def flops_coverage(self) -> float:
        return self.tuned_flops / self.flops if self.flops else 0.0

    @property
    def time_coverage(self) -> float | None:
        """Share (0..1) of the untuned graphs' kernel time (calls x default-schedule time, of
        the kernels that ran) held by tasks with a compiled record; None without the times."""
        if self.time_s is None:
            return None
        return self.tuned_time_s / self.time_s if self.time_s else 0.0


def _has_record(database, mod) -> bool:
    """Whether ``database`` holds a valid record of workload ``mod``."""
    return bool(database.has_workload(mod)
                and database.get_top_k(database.commit_workload(mod), 1))


def coverage(tasks, database) -> tuple[int, float]:
    """(number of tasks, FLOPs) of ``tasks`` that have a valid record in ``database``."""
    tuned = [t for t in tasks if _has_record(database, t.mod)]
    return len(tuned), sum(t.total_flops for t in tuned)


def time_coverage(tasks, database, log_path: str, target) -> tuple[float, float] | None:
    """(untuned kernel time, of it the time of tasks with a record in ``database``), in seconds
    per run of every graph once (calls x default-schedule time from ``default_latency.json`` in
    ``log_path``, :func:`thomas_tune.tuning.read_default_times`); None when the folder has no
    times for ``target``. Tasks without a valid time (failed, or measured on another kernel)
    count in neither."""
    from ..tuning.defaults import kernel_time_s, read_default_times
    from ..tasks import key as workload_key
    times = read_default_times(log_path, target, {workload_key(t): t.mod for t in tasks})
    if not times:
        return None
    tuned = [t for t in tasks if _has_record(database, t.mod)]
    return kernel_time_s(tasks, times), kernel_time_s(tuned, times)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(ref))), 1e-12)
    return float(np.max(np.abs(got.astype("float64") - ref))) / scale


#: largest relative error of the logits against PyTorch float64 (float32 rounding of the
#: forward pass reaches 1e-6..1e-5 on the models here; a wrong kernel moves them by about 1)
LOGITS_TOL = 1e-4
#: what the numbers are checked against, as the reports name it
REFERENCE = "PyTorch float64"


def check_numbers(model, target, database, batch: int, trainable: str, seed: int,
                  winograd=None, tuned=None, batches: int | None = None) -> dict:
    """The tuned float32 build's logits, loss and gradients against PyTorch in float64 (an
    independent reference: :mod:`thomas_tune.reference`, never the project's own gradient
    code), the build run on this machine's CPU (``target``: an llvm target of this machine),
    on the check batches of ``seed`` (:func:`thomas_tune.step_check.reference_steps`, default
    :data:`thomas_tune.step_check.CHECK_BATCHES` of them) with fresh random parameters and
    BatchNorm variances drawn from ``seed``.

    Returns ``reference`` (:data:`REFERENCE`, or None where PyTorch is not installed: then
    ``why`` says so and nothing else is returned: no numeric check is claimed), ``logits``
    (largest relative error over the batches, max |got - ref| / max |ref|, against PyTorch's
    inference-form forward), ``loss`` and ``gradients`` (the worst parameter's error) and
    ``step``, the :class:`thomas_tune.step_check.StepCheck` of the gradients and loss (the
    step check's formula, bounds and branch-following reference). ``winograd``: the
    convolutions the tuned build computes in the Winograd form. ``tuned``: the tuned training
    graph already compiled with ``database`` and ``winograd``, or None to compile it here."""
    try:
        import torch
    except ImportError:
        return {"reference": None,
                "why": "PyTorch is not installed: replay has no reference independent of the "
                       "build's own gradient code, so it checks no numbers (pip install "
                       "thomas_tune[test] for it)"}
    from ..reference import torch_module
    from ..step_check import CHECK_BATCHES, compare_step, following_step, reference_steps
    rng = np.random.default_rng(seed)
    tensors = init_params(model, seed=seed)
    for k in tensors:  # non-trivial BN variances; shifted means or biases would put the
        # frozen layers' outputs on offsets their variation is small against, which the
        # training-form BatchNorms after them amplify past any float32 check
        # (docs/journal/precision.md)
        if k.endswith("running_var"):
            tensors[k] = rng.uniform(0.5, 1.5, tensors[k].shape).astype("float32")
    tg32 = G.training_module(model, batch, trainable)
    ref = reference_steps(model, tensors, tg32.trainable, batch, seed, tg32.frozen_bn,
                          batches or CHECK_BATCHES)
    dev = tvm.cpu()
    if tuned is None:
        tuned = compile_graph(tg32.mod, target, database, winograd)
    vm = relax.VirtualMachine(tuned, dev)
    net = torch_module(model, tensors, "float64").eval()
    names_pred = [p.name for p in spec(model).params] + [p.name for p in spec(model).states]
    order = tg32.frozen + tg32.trainable + tg32.states

    def t(a):
        return tvm.runtime.tensor(np.asarray(a, dtype="float32"), dev)

    logits_err, got = 0.0, []
    for (x, y), masks in zip(ref["batches"], ref["masks"]):
        logits = vm[G.PREDICT](t(x), *[t(tensors[n]) for n in names_pred]).numpy()
        with torch.no_grad():
            logits_err = max(logits_err, _rel_err(logits, net(torch.tensor(
                x.astype("float64"))).numpy()))
        r, grads = vm[G.ADJOINT](t(x), *[t(masks[k]) for k in tg32.masks],
                                 *[t(tensors[n]) for n in order],
                                 tvm.runtime.tensor(y.astype("int64"), dev))
        got.append((float((r[0] if tg32.states else r).numpy()),
                    {n: g.numpy() for n, g in zip(tg32.trainable, grads)}))
    follow = [following_step(ref, i, g[1]) for i, g in enumerate(got)]
    yard = ref["yardstick"]
    step = compare_step([g[0] for g in got], [g[1] for g in got], [f.loss for f in follow],
                        [f.grads for f in follow], yard.errors, yard.loss_err, ref["sums"])
    step.flips = [len(f.flips) for f in follow]
    step.unresolved = sum(f.unresolved for f in follow)
    step.few_bn_values, step.coverage = ref["few_bn_values"], ref["coverage"]
    return {"reference": REFERENCE, "logits": logits_err, "loss": step.loss_err,
            "gradients": step.worst[1], "step": step}


def replay(model, target, log: TuningLog, batch: int = 8, infer_batch: int = 1,
           trainable: str = "all", check: bool = True, seed: int = 0,
           min_flops_coverage: float = 0.0, min_time_coverage: float = 0.0,
           say=print) -> ReplayReport:
    """Compile ``model``'s inference and training graphs with ``log``; see the module docstring.

    ``check``: each applied record is first run on this machine's device against its default
    schedule (:func:`thomas_tune.compiler.build_plan.check_plan`; wrong ones are left out and
    listed in the report), and on llvm targets of this machine the compiled graphs are
    compared with float64 (:func:`check_numbers`). ``say`` gets the check's messages.

    When the records cannot be checked here (``check`` and no device of this machine runs the
    target's kernels: ``report.records_unchecked`` says why), when a checked record computes
    wrong numbers (``report.records_wrong``), or the log's FLOP
    coverage is below ``min_flops_coverage`` (0..1), or its time coverage below
    ``min_time_coverage`` (0..1; a log without default-schedule times has none and fails any
    minimum above 0), the replay has failed already: nothing is compiled or checked
    (:func:`failed_minimum` says which minimum).

    Raises ValueError when the log folder has no records at all.
    """
    if not log.exists():
        raise ValueError(f"tuning log {log.path!r} has no records; tune first or fix the path")
    if check:  # a check that cannot run fails first, before the log is read
        from .record_check import CheckUnavailable, local_device
        try:
            local_device(target)
        except CheckUnavailable as err:
            return ReplayReport(records_unchecked=str(err))
    graphs = {"infer": G.inference_module(model, infer_batch),
              "train": G.training_module(model, batch, trainable).mod}
    # what `export` compiles with: every applied record checked on this machine's device
    plan = BuildPlan.from_log(log, target, graphs)
    checks = {"checked": None, "wrong": {}, "unchecked": None}
    if check:
        plan, checks = check_plan(plan, say=say)
    database, chosen = plan.database, plan.winograd
    tasks = plan.tasks  # the kernels `export` builds
    report = ReplayReport(tasks=len(tasks), flops=sum(t.total_flops for t in tasks),
                          slower=plan.slower, records_checked=checks["checked"],
                          records_wrong=checks["wrong"], records_unchecked=checks["unchecked"])
    report.tuned, report.tuned_flops = coverage(tasks, database)
    times = time_coverage(tasks, database, log.path, target)
    if times is not None:
        report.time_s, report.tuned_time_s = times
    if (report.records_unchecked or report.records_wrong
            or failed_minimum(report, min_flops_coverage, min_time_coverage)):
        return report
    executables = {name: compile_graph(mod, target, database, chosen[name])
                   for name, mod in graphs.items()}
    report.compiled = True
    from ..target import is_cross
    if check and target.kind.name == "llvm" and not is_cross(target):  # runs on this machine
        report.errors = check_numbers(model, target, database, batch, trainable, seed,
                                      chosen["train"], tuned=executables["train"])
        report.checked = report.errors.get("reference") is not None
    return report


def failed_minimum(report: ReplayReport, min_flops_coverage: float = 0.0,
                   min_time_coverage: float = 0.0) -> str | None:
    """Why ``report`` falls short of the minimum coverages (0..1), or None when it does not."""
    if report.flops_coverage < min_flops_coverage:
        return (f"FLOP coverage {report.flops_coverage:.3f} is below --min-flops-coverage "
                f"{min_flops_coverage}")
    if min_time_coverage > 0:
        if report.time_coverage is None:
            return ("--min-time-coverage needs default-schedule times measured on the device "
                    "(default_latency.json in the log folder, written by tune --time-share); "
                    "the log has none for this target")
        if report.time_coverage < min_time_coverage:
            return (f"time coverage {report.time_coverage:.3f} is below --min-time-coverage "
                    f"{min_time_coverage}")
    return None
