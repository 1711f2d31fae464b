"""Tuning records checked where they are applied: ``export`` and ``replay``.

A tuning log can hold a record whose kernel computes wrong numbers: measured before candidates
were checked, tuned with another TVM, or wrong only on this device. Before a build applies the
log, each record it would apply is run once on random inputs on a device of this machine and
compared with the task's default schedule on the same inputs
(:mod:`thomas_tune.kernel_check`); a record that fails is left out, so its kernel keeps its
default schedule, and the reason is reported.

The device is this machine's: the first OpenCL device (``THOMAS_TUNE_OPENCL_PLATFORM`` chooses
the platform) for OpenCL targets, the CPU for llvm targets of this machine's architecture. A
GPU target's kernels run on PoCL's CPU device as long as its work-group and local-memory
limits fit PoCL's (4,096 work-items; the H100 target asks for at most 256), which is how CI
checks the committed GPU logs. Results are cached per record, target and device in
``$THOMAS_TUNE_CACHE/record_checks.jsonl`` (default ``~/.cache/thomas_tune``): a second
export of the same log checks nothing again. ``export`` starts the checks in child processes
(:func:`check_in_background`: one per core, at most 4, each with a share of the records) and
compiles with every record meanwhile, then reads their results (:func:`wrong_records`) and
compiles again only when a record turns out wrong. What a build applies comes from its
:class:`thomas_tune.compiler.build_plan.BuildPlan`; this module only checks records: it builds
nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import tvm
import tvm_ffi

from .. import kernel_check as kc
from .. import kernel_reference as kr


class _Kernel(NamedTuple):
    """A kernel to check: its name (for messages) and its TIR module; a
    :class:`thomas_tune.tasks.Task` serves as well."""

    name: str
    mod: tvm.IRModule


def _key(mod: tvm.IRModule) -> str:
    """A workload's key: the structural hash of its TIR module in decimal, as
    :func:`thomas_tune.tasks.key` and the tuning records have it."""
    return str(tvm_ffi.structural_hash(mod))


class CheckUnavailable(RuntimeError):
    """No device of this machine can run the target's kernels; the message says why."""


#: bumped when what a check compares changes: older cached results are not reused
CHECK_VERSION = "1"


def local_device(target):
    """The device of this machine that runs ``target``'s kernels and its name: the first OpenCL
    device for OpenCL targets, the CPU for an llvm target of this machine. Raises
    :class:`CheckUnavailable` naming what is missing (no OpenCL device, a cross target, a
    work-group or local-memory limit over the device's)."""
    from ..target import is_cross
    kind = target.kind.name
    if kind == "llvm":
        if is_cross(target):
            raise CheckUnavailable(f"the target's host ({target.attrs.get('mtriple', '')}) is "
                                   "another architecture than this machine's")
        return tvm.cpu(0), "cpu"
    if kind != "opencl":
        raise CheckUnavailable(f"targets of kind {kind!r} are not run here")
    from .. import opencl
    if not opencl.available():
        raise CheckUnavailable("no OpenCL device on this machine (install PoCL: apt-get install "
                               "pocl-opencl-icd)")
    dev = tvm.opencl(0)
    threads = int(target.attrs.get("max_num_threads", 0) or 0)
    shared = int(target.attrs.get("max_shared_memory_per_block", 0) or 0)
    if threads > int(dev.max_threads_per_block) or shared > int(dev.max_shared_memory_per_block):
        raise CheckUnavailable(
            f"the target allows {threads} work-items and {shared} bytes of local memory per "
            f"work-group, over this OpenCL device's {int(dev.max_threads_per_block)} and "
            f"{int(dev.max_shared_memory_per_block)}")
    return dev, opencl.devices().split(";")[0].strip()


def _cache_path() -> str:
    base = os.environ.get("THOMAS_TUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thomas_tune")
    os.makedirs(base, exist_ok=True)
    return os.path.join(base, "record_checks.jsonl")


def _read_cache() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    try:
        with open(_cache_path()) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    out[row["key"]] = row["wrong"]
                except (ValueError, KeyError, TypeError):  # a torn last line: check again
                    continue
    except FileNotFoundError:
        pass
    return out


def _append_cache(key: str, wrong: str | None) -> None:
    with open(_cache_path(), "a") as f:
        f.write(json.dumps({"key": key, "wrong": wrong}) + "\n")
        f.flush()


def record_id(record, target, device_name: str) -> str:
    """sha256 (hex) of what a record's check depends on: its workload, its trace, the target,
    the device and :data:`CHECK_VERSION`."""
    from ..logs import trace_json
    h = hashlib.sha256()
    for part in (CHECK_VERSION, tvm.__version__, device_name, str(target),
                 tvm.ir.save_json(record.workload.mod), trace_json(record)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def check_records(tasks, database, target, seed: int = 0, progress=None,
                  build_workers: int | None = None) -> dict[str, str | None]:
    """Check the record ``database`` applies to each task of ``tasks`` (those with one) on
    this machine's device (:func:`local_device`). Returns ``{workload key: None (right) or the
    reason ("wrong result: ...", or the build or run error)}``. Raises
    :class:`CheckUnavailable` when no device here runs the target. ``progress(done, total)``
    is called after each record; ``build_workers``: processes building the kernels (None: one
    per core)."""
    dev, device_name = local_device(target)
    out, todo = _pending(tasks, database, target, device_name)
    for (key, rid, _, _), why in zip(todo, run_checks([(t, rec) for _, _, t, rec in todo],
                                                       target, dev, seed, progress,
                                                       build_workers)):
        out[key] = why
        _append_cache(rid, why)
    return out


def _pending(tasks, database, target, device_name: str):
    """The results cached for the records ``database`` applies to ``tasks`` on the device
    ``device_name`` (workload key -> None or the reason), and the records not checked there
    yet: (workload key, record id, task, record)."""
    cached = _read_cache()
    out: dict[str, str | None] = {}
    todo = []
    for t in tasks:
        rec = database.query_tuning_record(t.mod, target, "main")
        if rec is None:
            continue
        key, rid = _key(t.mod), record_id(rec, target, device_name)
        if rid in cached:
            out[key] = cached[rid]
        else:
            todo.append((key, rid, t, rec))
    return out, todo


class BackgroundChecks:
    """Records being checked in child processes (``python -m thomas_tune.compiler.record_check
    FOLDER WORKERS``), each with its share of the records in a MetaSchedule JSON database in a
    temporary folder of its own; :func:`wait_background` waits for them and removes the
    folders."""

    def __init__(self):
        self.children: list[tuple[subprocess.Popen, str]] = []  # (process, its folder)


def check_in_background(tasks, database, target,
                        processes: int | None = None) -> BackgroundChecks | None:
    """Start checking, in child processes, the records ``database`` applies to ``tasks`` that
    were not checked on this machine's device before; each child appends its results to the
    cache (:func:`check_records` then finds them there). ``processes``: how many children
    share the records (None: one per core, at most 4), so that the device runs, which compile
    each kernel on one core on PoCL, use the cores that the caller's own work leaves. Returns
    None when there is nothing to check or no device here runs the target. A child's output
    goes to ``checks.log`` in its folder, printed by :func:`wait_background` when it fails."""
    import tempfile

    from tvm.s_tir import meta_schedule as ms
    try:
        _, device_name = local_device(target)
    except CheckUnavailable:
        return None
    _, todo = _pending(tasks, database, target, device_name)
    if not todo:
        return None
    cores = os.cpu_count() or 1
    n = max(1, min(len(todo), processes or min(cores, 4)))
    checks = BackgroundChecks()
    for i in range(n):
        folder = tempfile.mkdtemp(prefix="thomas-tune-checks-")
        db = ms.database.JSONDatabase(os.path.join(folder, "workloads.json"),
                                      os.path.join(folder, "records.json"), allow_missing=True)
        for _, _, _, rec in todo[i::n]:  # dealt in turn: each share has large and small tasks
            db.commit_tuning_record(ms.database.TuningRecord(
                rec.trace, db.commit_workload(rec.workload.mod), rec.run_secs, rec.target,
                rec.args_info))
        with open(os.path.join(folder, "target.json"), "w") as f:
            f.write(str(target))
        with open(os.path.join(folder, "checks.log"), "w") as log:
            proc = subprocess.Popen(
                [sys.executable] + (["-P"] if sys.flags.safe_path else []) +
                ["-m", "thomas_tune.compiler.record_check", folder, str(max(1, cores // n))],
                stdout=log, stderr=subprocess.STDOUT)
        checks.children.append((proc, folder))
    return checks


def wait_background(checks: BackgroundChecks | None, kill: bool = False, say=print) -> None:
    """Wait for the children of :func:`check_in_background` (``kill``: stop them first) and
    remove their folders. A child that failed is reported with the end of its output through
    ``say`` (the records it did not check are then checked by :func:`check_records`)."""
    import shutil
    if checks is None:
        return
    for proc, _ in checks.children:
        if kill and proc.poll() is None:
            proc.kill()
    for proc, folder in checks.children:
        proc.wait()
        if proc.returncode != 0 and not kill:
            with open(os.path.join(folder, "checks.log"), errors="replace") as f:
                tail = f.read()[-2000:]
            say(f"a process checking tuning records failed (exit status {proc.returncode}); "
                f"the records it left are checked here:\n{tail}")
        shutil.rmtree(folder, ignore_errors=True)


def _check_folder(folder: str, build_workers: int | None = None) -> None:
    """A child of :func:`check_in_background`: check every record of the JSON database in
    ``folder`` on this machine's device (results appended to the cache), its kernels built by
    ``build_workers`` processes (None: one per core)."""
    from tvm.s_tir import meta_schedule as ms

    with open(os.path.join(folder, "target.json")) as f:
        target = tvm.target.Target(json.loads(f.read()))
    db = ms.database.JSONDatabase(os.path.join(folder, "workloads.json"),
                                  os.path.join(folder, "records.json"), allow_missing=False)
    tasks = [_Kernel(f"record {i}", rec.workload.mod)
             for i, rec in enumerate(db.get_all_tuning_records())]
    check_records(tasks, db, target, build_workers=build_workers)


def run_checks(items, target, dev, seed: int = 0, progress=None,
                build_workers: int | None = None) -> list[str | None]:
    """Check each (task, record) of ``items`` on ``dev``: None (right) or the reason. Both
    kernels of every record are built at once by ``build_workers`` processes (None: one per
    core); then they run one after another."""
    import shutil

    from tvm.s_tir import meta_schedule as ms

    from ..measure.kept import keep_builder, take_builder
    from ..measure.runner import error_line
    if not items:
        return []
    builder = take_builder(build_workers or os.cpu_count() or 1, timeout_s=600)
    try:
        built = builder.build([ms.builder.BuilderInput(m, target) for t, rec in items
                               for m in (kc.default_kernel(t.mod, target), kc.record_kernel(rec))])
    except BaseException:
        builder.shutdown()  # a build may still be running in it
        raise
    keep_builder(builder)  # for the next check of this process (measure.kept)
    out: list[str | None] = []
    for n, (t, _) in enumerate(items):
        ref_b, rec_b = built[2 * n], built[2 * n + 1]
        try:
            for b in (ref_b, rec_b):
                if b.error_msg is not None:
                    raise RuntimeError(error_line(b.error_msg, 200))
            spec = kc.check_spec(t.mod["main"])
            ref = tvm.runtime.load_module(str(ref_b.artifact_path))
            args, expected = kr.reference_outputs(ref["main"], dev, t.mod["main"], seed, spec)
            lib = tvm.runtime.load_module(str(rec_b.artifact_path))
            out.append(kc.compare(kr.run_checked(lib["main"], dev, args), expected, spec.tol))
        except Exception as err:  # TVM's build and run errors: the record is not applied
            out.append(f"check failed: {error_line(err, 200)}")
        finally:
            for b in (ref_b, rec_b):
                if b.artifact_path is not None:
                    shutil.rmtree(os.path.dirname(str(b.artifact_path)), ignore_errors=True)
        if progress is not None:
            progress(n + 1, len(items))
    return out


class RecordChecks:
    """The results of the record checks of one build, over every round of
    :func:`wrong_records`: ``results`` (workload key -> None, right, or the reason it is
    wrong) and ``unchecked`` (why no record could be checked, or None)."""

    def __init__(self):
        self.results: dict[str, str | None] = {}
        self.unchecked: str | None = None

    @property
    def checked(self) -> int | None:
        """Records checked, or None where they could not be."""
        return None if self.unchecked is not None else len(self.results)


def wrong_records(plan, tally: RecordChecks, say=print,
                  started: float | None = None) -> dict[str, str]:
    """Check the records that ``plan`` (a :class:`thomas_tune.compiler.build_plan.BuildPlan`: its
    ``tasks``, ``database``, ``target`` and ``log``) applies and ``tally`` holds no result for
    (:func:`check_records`); the results go into ``tally``. Returns the records found wrong
    (workload key -> reason); {} when every one is right, and when none can be checked here
    (``tally.unchecked`` then says why). ``say`` gets one line per wrong record, one for the
    round, and one when the log has no record for this build; ``started``: when the checks
    began (``time.perf_counter()``, for the message; None: now)."""
    tasks = [t for t in plan.tasks if _key(t.mod) not in tally.results]
    try:
        t0 = time.perf_counter() if started is None else started
        results = check_records(tasks, plan.database, plan.target)
    except CheckUnavailable as err:
        tally.unchecked = str(err)
        say(f"tuning records not checked: {err}")
        return {}
    tally.results.update(results)
    if not tally.results:
        say(f"tuning log {plan.log.path} holds no usable record for this build: none of its "
            f"{len(tasks)} kernels has a record faster than its default schedule, so every "
            "kernel keeps its default schedule (tune this model, batch and target into the "
            "log first)")
    new = {k: why for k, why in results.items() if why is not None}
    for k, why in new.items():
        name = next((t.name for t in tasks if _key(t.mod) == k), k)
        say(f"tuning record of {name} left out, the kernel keeps its default schedule: "
            f"{why}")
    if results:
        say(f"checked {len(results)} tuning record(s) on this machine's device in "
            f"{time.perf_counter() - t0:.0f} s: {len(new)} wrong")
    return new


def move_aside(log, aside: dict[str, list[tuple[list[float], str]]]) -> int:
    """Move the record lines of ``aside`` (workload key -> [(run times, reason)]: a line is
    found by its workload and its run times, read back exactly as written) to
    ``database_tuning_record.json.rejected`` with the reason. Returns the lines moved. Raises
    RuntimeError when none is found."""
    from tvm.s_tir import meta_schedule as ms

    from ..logs import rewrite_atomically
    with open(log.workload_path) as f:
        wl_keys = [_key(ms.database.Workload.from_json(json.loads(line)).mod)
                   if line.strip() else None for line in f]
    with open(log.record_path) as f:
        lines = f.readlines()
    wanted = {(k, tuple(secs)): why for k, found in aside.items() for secs, why in found}
    kept, moved = [], []
    for i, line in enumerate(lines):
        try:
            w, body = json.loads(line)
            k = wl_keys[w] if 0 <= w < len(wl_keys) else None
            why = wanted.get((k, tuple(float(x) for x in body[1])))
        except (ValueError, TypeError, IndexError):
            why = None
        if why is None:
            kept.append(line)
        else:
            moved.append((i, line, why))
    if not moved:
        raise RuntimeError(f"the wrong records were not found in {log.record_path}")
    with open(log.record_path + ".rejected", "a") as f:
        for i, line, why in moved:
            f.write(json.dumps({"line": i + 1, "reason": why, "text": line.rstrip("\n")})
                    + "\n")
    rewrite_atomically(log.record_path, kept)
    return len(moved)


if __name__ == "__main__":
    # python -m thomas_tune.compiler.record_check FOLDER [BUILD_WORKERS]: see check_in_background
    _check_folder(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
