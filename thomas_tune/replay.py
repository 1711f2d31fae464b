"""Replay: compile from a tuning log with no device, report coverage, check the numbers.

Coverage is the share of tasks, of FLOPs (calls x FLOPs per call), and, where the log folder
holds default-schedule times measured on the device (``default_latency.json``), of the untuned
graphs' kernel time (calls x default time), whose workload has a tuning record that is
compiled (a valid record faster than the default schedule). Logs tuned by time share
(``tune --time-share``) are judged by the time: on a small network the slowest kernels are
rarely the ones with the most FLOPs. The numeric checks: every tuning record the build applies
runs once on this machine's device (PoCL's CPU device for GPU targets) against its default
schedule (:mod:`thomas_tune.record_check`); and, on ``llvm`` targets of this machine, the
tuned float32 inference and training graphs run against the same graphs built in float64 with
default schedules, on fresh random inputs and parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from . import graph as G
from .compile import compile_graph, reference_target
from .record_check import checked_build
from .models import init_params, spec
from .tasks import extract
from .logs import TuningLog


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
    #: (:mod:`thomas_tune.record_check`): how many, the wrong ones (workload key -> reason,
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
    from .tuning.defaults import kernel_time_s, read_default_times
    from .tasks import key as workload_key
    times = read_default_times(log_path, target, {workload_key(t): t.mod for t in tasks})
    if not times:
        return None
    tuned = [t for t in tasks if _has_record(database, t.mod)]
    return kernel_time_s(tasks, times), kernel_time_s(tuned, times)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(ref))), 1e-12)
    return float(np.max(np.abs(got.astype("float64") - ref))) / scale


#: largest relative error of the logits against float64 (float32 rounding of the forward pass
#: reaches 1e-6..1e-5 on the models here; a wrong kernel moves them by about 1)
LOGITS_TOL = 1e-4


def check_numbers(model, target, database, batch: int, trainable: str, seed: int,
                  winograd=None, tuned=None, batches: int | None = None) -> dict:
    """The tuned float32 build's logits, loss and gradients against the float64 graph, both run
    on this machine's CPU (``target``: an llvm target of this machine), on ``batches``
    (default :data:`thomas_tune.step_check.CHECK_BATCHES`) batches drawn from ``seed`` with
    fresh random parameters, BatchNorm statistics and dropout masks.

    Returns ``logits`` (largest relative error over the batches, max |got - ref| / max |ref|),
    ``loss`` and ``gradients`` (the worst parameter's error) and ``step``, the
    :class:`thomas_tune.step_check.StepCheck` of the gradients and loss: the project's one
    error formula and bounds (:mod:`thomas_tune.step_check`), with the float32 graph with
    default schedules as the yardstick (PyTorch is not needed here). That yardstick is built
    only when some error is above the rounding floors' bound; ``gradients_default_schedules``
    is its worst error, else None. ``winograd``: the convolutions the tuned build computes in
    the Winograd form (:func:`thomas_tune.compile.winograd_choice`). ``tuned``: the tuned
    training graph already compiled with ``database`` and ``winograd``, or None to compile it
    here. The float64 graph and the yardstick are built at LLVM ``opt-level`` 0
    (:func:`thomas_tune.compile.reference_target`)."""
    from .step_check import CHECK_BATCHES, FACTOR, LOSS_ROUNDING, ROUNDING, compare_step
    batches = batches or CHECK_BATCHES
    rng = np.random.default_rng(seed)
    tensors = init_params(model, seed=seed)
    for k in tensors:  # non-trivial BN statistics and biases
        if k.endswith(("running_mean", "bias")):
            tensors[k] = rng.normal(0, 0.1, tensors[k].shape).astype("float32")
        elif k.endswith("running_var"):
            tensors[k] = rng.uniform(0.5, 1.5, tensors[k].shape).astype("float32")
    tg32 = G.training_module(model, batch, trainable)
    tg64 = G.training_module(model, batch, trainable, dtype="float64")
    dev = tvm.cpu()
    if tuned is None:
        tuned = compile_graph(tg32.mod, target, database, winograd)
    vm32 = relax.VirtualMachine(tuned, dev)
    vm64 = relax.VirtualMachine(compile_graph(tg64.mod, reference_target(target), None), dev)
    inputs = [(rng.standard_normal(model.input_shape(batch)),
               rng.integers(0, model.num_classes, batch),
               [(rng.random(shape) >= p) / (1 - p) for shape, p in tg32.masks.values()])
              for _ in range(batches)]
    s = spec(model)
    names_pred = [p.name for p in s.params] + [p.name for p in s.states]
    order = tg32.frozen + tg32.trainable + tg32.states

    def run(vm, dt):
        def t(a):
            return tvm.runtime.tensor(np.asarray(a, dtype=dt), dev)
        out = []
        for x, y, masks in inputs:
            logits = vm[G.PREDICT](t(x), *[t(tensors[n]) for n in names_pred]).numpy()
            ret, grads = vm[G.ADJOINT](t(x), *[t(m) for m in masks],
                                       *[t(tensors[n]) for n in order],
                                       tvm.runtime.tensor(y.astype("int64"), dev))
            loss = float((ret[0] if tg32.states else ret).numpy())
            out.append((logits, loss, dict(zip(tg32.trainable, (g.numpy() for g in grads)))))
        return out

    got, ref = run(vm32, "float32"), run(vm64, "float64")

    def check(steps, yardstick=None):
        return compare_step([o[1] for o in steps], [o[2] for o in steps], [r[1] for r in ref],
                            [r[2] for r in ref], yardstick and yardstick.errors,
                            yardstick and yardstick.loss_err)

    step = check(got)
    errors = {"logits": max(_rel_err(o[0], r[0]) for o, r in zip(got, ref)),
              "loss": step.loss_err, "gradients": step.worst[1],
              "gradients_default_schedules": None}
    if step.worst[1] > FACTOR * ROUNDING or step.loss_err > FACTOR * LOSS_ROUNDING:
        default = compile_graph(tg32.mod, reference_target(target), None)
        yard = check(run(relax.VirtualMachine(default, dev), "float32"))
        errors["gradients_default_schedules"] = yard.worst[1]
        step = check(got, yard)
    errors["step"] = step
    return errors


def replay(model, target, log: TuningLog, batch: int = 8, infer_batch: int = 1,
           trainable: str = "all", check: bool = True, seed: int = 0,
           min_flops_coverage: float = 0.0, min_time_coverage: float = 0.0,
           say=print) -> ReplayReport:
    """Compile ``model``'s inference and training graphs with ``log``; see the module docstring.

    ``check``: each applied record is first run on this machine's device against its default
    schedule (:func:`thomas_tune.record_check.checked_build`; wrong ones are left out and
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
    built = checked_build(log, target, graphs, check=check, say=say)
    database, slower, chosen = built["database"], built["slower"], built["winograd"]
    tasks = extract(graphs, target, chosen)  # the kernels `export` builds
    report = ReplayReport(tasks=len(tasks), flops=sum(t.total_flops for t in tasks),
                          slower=slower, records_checked=built["checked"],
                          records_wrong=built["wrong"], records_unchecked=built["unchecked"])
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
    from .target import is_cross
    if check and target.kind.name == "llvm" and not is_cross(target):  # runs on this machine
        report.errors = check_numbers(model, target, database, batch, trainable, seed,
                                      chosen["train"], tuned=executables["train"])
        report.checked = True
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
