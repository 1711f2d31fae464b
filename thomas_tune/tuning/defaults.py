"""Default-schedule timing: each kernel's untuned time, cached, and tasks chosen by it."""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import sys

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..files import write_json_atomically
from ..kernel_check import default_kernel
from ..measure.builder import Builder
from ..measure.kept import keep_builder, take_builder
from ..measure.runner import error_line
from ..tasks import Task
from ..tasks import key as workload_key
from ..logs import FAILED_RUN_S, TuningLog

DEFAULT_LATENCY = "default_latency.json"


def measure_defaults(tasks: list[Task], target, runner, log: TuningLog | None = None,
                     builder_workers: int | None = None, refresh: bool = False
                     ) -> dict[str, float]:
    """Time every task's kernel with its default schedule (no tuning) on the runner's device.

    Returns ``{workload key: seconds per call}`` (key: :func:`thomas_tune.tasks.key`); a
    kernel whose build or run fails gets ``inf``. With ``log``, results are cached in the tuning-log
    folder (``default_latency.json``, written atomically) and only missing tasks are measured; the
    cache is stamped with :func:`defaults_stamp` (TVM version and target), and each time is kept
    with the key of the kernel it timed (:func:`default_schedule_key`): a cache of another
    stamp, or a kernel that the rules now make differently, is measured again, not reused. These
    times x call counts say where an untuned training step spends its time, which is what
    ``select_by_time`` ranks tasks by. On CPU targets the default is MetaSchedule's unscheduled
    kernel, compiled as is. ``refresh``: measure every task again and replace its cached time
    (``thomas-tune remeasure --defaults``, for times measured under a noisy load).
    """
    cache_path = os.path.join(log.path, DEFAULT_LATENCY) if log is not None else None
    keys = [workload_key(t) for t in tasks]
    wanted = dict(zip(keys, (t.mod for t in tasks)))
    cache = _read_cache(log.path, target) if log is not None else None
    if cache is None and cache_path and os.path.exists(cache_path):
        print(f"default schedules: the times in {cache_path} were measured with another TVM "
              "or another target (or by an older thomas_tune); measuring again",
              file=sys.stderr)
    known = _valid_times(cache, wanted, target) if cache is not None and not refresh else {}
    stale = 0 if refresh else sum(1 for k in wanted if cache is not None
                                  and k in cache["seconds"] and k not in known)
    if stale:
        print(f"default schedules: {stale} kernel(s) of {cache_path} are no longer what "
              "the default-schedule rules make; measuring them again", file=sys.stderr)
    schedules = {k: cache["schedules"][k] for k in known}  # keys of still-valid times
    todo = [(k, t) for k, t in zip(keys, tasks) if k not in known]
    if todo:
        mods = []
        for k, t in todo:
            mods.append(default_kernel(t.mod, target))
            schedules[k] = str(tvm_ffi.structural_hash(mods[-1]["main"]))
            _SCHEDULE_KEYS[(str(tvm_ffi.structural_hash(t.mod)), str(target))] = schedules[k]
        builder = take_builder(builder_workers, timeout_s=120)
        try:
            results = measure_kernels(mods, target, runner, builder)
        except BaseException:
            builder.shutdown()  # a build may still be running in it
            raise
        keep_builder(builder)  # for the next run of this process (measure.kept)
        errors = collections.Counter()
        for (k, _), (secs, why) in zip(todo, results):
            known[k] = math.inf if secs is None else sum(secs) / len(secs)
            if why is not None:
                errors[why] += 1
        for why, n in errors.most_common(5):
            print(f"default schedules: {n} kernel(s) failed: {why}", file=sys.stderr)
        if cache_path:
            # entries of workloads not asked about now stay as they were
            seconds = {}
            for k, v in (cache["seconds"] if cache is not None else {}).items():
                if k not in wanted and k in cache["schedules"]:
                    seconds[k], schedules[k] = v, cache["schedules"][k]
            seconds.update({k: (v if math.isfinite(v) else None) for k, v in known.items()})
            write_json_atomically(cache_path, {"stamp": defaults_stamp(target), "seconds": seconds,
                                               "schedules": schedules}, indent=0, sync=False)
    return {k: (math.inf if v is None else v) for k, v in known.items()}


def measure_kernels(mods: list[tvm.IRModule], target, runner, builder: Builder,
                    references: list | None = None
                    ) -> list[tuple[list[float] | None, str | None]]:
    """Build each module of ``mods`` (one kernel, function ``main``) for ``target`` with
    ``builder`` and time it on ``runner``'s device. Per module, in order: (run seconds, one
    per repeat; None) or (None; the error of the build or the run, one line). Build artifacts
    are removed. ``references``: per module, the
    :class:`~thomas_tune.kernel_reference.Reference` of its task, whose outputs it must reproduce
    before it is timed (:meth:`thomas_tune.measure.runner.FarmRunner.expect`; "wrong result: ..."
    otherwise), or None for a module timed unchecked (a default schedule)."""

    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from ..target import device_kind

    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    out: list = [None] * len(mods)
    inputs, owners = [], []
    for i, (m, b) in enumerate(zip(mods, built)):
        if b.error_msg is not None:
            out[i] = (None, error_line(b.error_msg, 160))
            continue
        inputs.append(ms.runner.RunnerInput(b.artifact_path, device_kind(target),
                                            ArgInfo.from_prim_func(m["main"])))
        owners.append(i)
    refs = references or [None] * len(mods)
    futures: dict[int, object] = {}
    groups: dict[int, list[int]] = {}  # one runner call per reference (per task)
    for n, i in enumerate(owners):
        groups.setdefault(id(refs[i]), []).append(n)
    try:
        for members in groups.values():
            if hasattr(runner, "expect"):
                runner.expect(refs[owners[members[0]]])
            for n, fut in zip(members, runner.run([inputs[n] for n in members])):
                futures[n] = fut
        for n, i in enumerate(owners):
            r = futures[n].result()
            secs = [float(x) for x in (r.run_secs or [])]
            if r.error_msg is None and secs and max(secs) < FAILED_RUN_S:
                out[i] = (secs, None)
            else:
                out[i] = (None, error_line(str(r.error_msg), 160) if r.error_msg is not None
                          else "the run returned no valid time")
    finally:
        for inp in inputs:
            shutil.rmtree(os.path.dirname(str(inp.artifact_path)), ignore_errors=True)
    return out


def kernel_time_s(tasks: list[Task], seconds: dict[str, float]) -> float:
    """Seconds per run of every graph once: each task's time in ``seconds`` (``{workload key:
    seconds per call}``) x its calls, over the tasks with a finite time there."""
    total = 0.0
    for t in tasks:
        s = seconds.get(workload_key(t), math.inf)
        if math.isfinite(s):
            total += s * t.weight
    return total


def _read_cache(log_path: str, target) -> dict | None:
    """The cache of :func:`measure_defaults` in ``log_path`` as ``{"seconds": {key: s or
    None}, "schedules": {key: default_schedule_key}}``, or None when there is none or it was
    written under another :func:`defaults_stamp` (or by an older thomas_tune)."""
    path = os.path.join(log_path, DEFAULT_LATENCY)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        cached = json.load(f)
    if (not isinstance(cached, dict) or cached.get("stamp") != defaults_stamp(target)
            or not isinstance(cached.get("schedules"), dict)):
        return None
    return {"seconds": cached.get("seconds") or {}, "schedules": cached["schedules"]}


def _valid_times(cache: dict, workloads: dict, target) -> dict[str, float]:
    """The cached times of ``workloads`` whose timed kernel is the one the default rules make
    today (seconds; ``inf``: failed to run)."""
    seconds, schedules = cache["seconds"], cache["schedules"]
    out = {}
    for key, mod in workloads.items():
        if key in seconds and key in schedules and \
                schedules[key] == default_schedule_key(mod, target):
            v = seconds[key]
            out[key] = math.inf if v is None else float(v)  # null: failed to run
    return out


def read_default_times(log_path: str, target,
                       workloads: dict[str, tvm.IRModule]) -> dict[str, float] | None:
    """The default-schedule times cached in the tuning-log folder ``log_path`` by
    :func:`measure_defaults` for ``workloads`` (``{workload key: IRModule}``):
    ``{workload key: seconds per call}`` (``inf``: failed to run), or None when there is no
    cache or it was measured under another :func:`defaults_stamp`.

    A time is returned only where the kernel that the default-schedule rules make of the
    workload today is the one that was timed (:func:`default_schedule_key`, cached beside each
    time): an edit of the rules that changes some kernels invalidates their times only."""
    cache = _read_cache(log_path, target)
    return None if cache is None else _valid_times(cache, workloads, target)


def default_schedule_key(mod: tvm.IRModule, target) -> str:
    """What a default-schedule time was measured on: the structural hash (decimal) of the
    kernel that :func:`~thomas_tune.kernel_check.default_kernel` makes of workload ``mod`` for
    ``target``.

    Making that kernel applies the default GPU rules (tens of milliseconds per kernel), so
    keys are kept for the life of the process, per workload (structural hash) and
    target: a demo that re-times, tunes and exports one training step (500 workloads, each
    looked up three times or more) makes each kernel once. The rules are code, so they cannot
    change within a process."""
    memo = (str(tvm_ffi.structural_hash(mod)), str(target))
    key = _SCHEDULE_KEYS.get(memo)
    if key is None:
        key = _SCHEDULE_KEYS[memo] = str(tvm_ffi.structural_hash(
            default_kernel(mod, target)["main"]))
    return key


#: default_schedule_key's keys made in this process: (workload hash, target JSON) -> key
_SCHEDULE_KEYS: dict[tuple[str, str], str] = {}


def defaults_stamp(target) -> str:
    """What every default-schedule time depends on besides its kernel: sha256 (hex) of the
    TVM version (its code generators and dlight rules) and the target's JSON. Times measured
    under another stamp are not reused."""
    import hashlib

    h = hashlib.sha256()
    h.update(b"default-latency-v2")
    h.update(tvm.__version__.encode())
    h.update(str(target).encode())  # the target's JSON
    return h.hexdigest()


def select_by_time(tasks: list[Task], latency: dict[str, float], time_share: float) -> list[Task]:
    """The fewest tasks whose default-schedule time x calls covers ``time_share`` (0..1] of the
    untuned step's kernel time, slowest first. Tasks that failed to run by default (``inf``)
    are taken first: they must be tuned. Raises ValueError for a share outside (0, 1]."""
    if not 0 < time_share <= 1:
        raise ValueError(f"--time-share must be in (0, 1], got {time_share}")
    cost = {id(t): latency.get(workload_key(t), 0.0) * t.weight for t in tasks}
    ranked = sorted(tasks, key=lambda t: -cost[id(t)])
    finite = sum(c for c in cost.values() if math.isfinite(c))
    out, acc = [], 0.0
    for t in ranked:
        c = cost[id(t)]
        if math.isfinite(c) and acc >= time_share * finite:
            break
        out.append(t)
        acc += c if math.isfinite(c) else 0.0
    return out


def untuned(tasks: list[Task], latency: dict[str, float], log: TuningLog,
            database=None) -> list[Task]:
    """The tasks of ``tasks`` (order kept) that an export would run on their default schedule:
    their workload has no record in ``log`` (read through ``database``, its
    :meth:`TuningLog.database` when None) that ran, or its best record's mean time (seconds,
    :meth:`TuningLog.best_seconds`) is not below the default schedule's in ``latency``
    (``{workload key: seconds per call}``, :func:`measure_defaults`). A task without a default
    time counts only when it has no record. ``export`` makes the same choice on the device (a
    default schedule faster than the best record is kept), so these are the kernels further
    tuning can still speed up from nothing."""
    database = log.database(check=False) if database is None else database
    out = []
    for t in tasks:
        best = log.best_seconds(database, t.mod)
        default = latency.get(workload_key(t))
        if best is None or (default is not None and best >= default):
            out.append(t)
    return out
