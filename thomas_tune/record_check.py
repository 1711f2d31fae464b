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
export of the same log checks nothing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import tvm
import tvm_ffi

from . import kernel_check as kc


class CheckUnavailable(RuntimeError):
    """No device of this machine can run the target's kernels; the message says why."""


#: bumped when what a check compares changes: older cached results are not reused
CHECK_VERSION = "1"


def local_device(target):
    """The device of this machine that runs ``target``'s kernels and its name: the first OpenCL
    device for OpenCL targets, the CPU for an llvm target of this machine. Raises
    :class:`CheckUnavailable` naming what is missing (no OpenCL device, a cross target, a
    work-group or local-memory limit over the device's)."""
    from .target import is_cross
    kind = target.kind.name
    if kind == "llvm":
        if is_cross(target):
            raise CheckUnavailable(f"the target's host ({target.attrs.get('mtriple', '')}) is "
                                   "another architecture than this machine's")
        return tvm.cpu(0), "cpu"
    if kind != "opencl":
        raise CheckUnavailable(f"targets of kind {kind!r} are not run here")
    from . import opencl
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
    from .tuning_log import trace_json
    h = hashlib.sha256()
    for part in (CHECK_VERSION, tvm.__version__, device_name, str(target),
                 tvm.ir.save_json(record.workload.mod), trace_json(record)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def check_records(tasks, database, target, seed: int = 0, progress=None) -> dict[str, str | None]:
    """Check the record ``database`` applies to each task of ``tasks`` (those with one) on
    this machine's device (:func:`local_device`). Returns ``{workload key: None (right) or the
    reason ("wrong result: ...", or the build or run error)}``. Raises
    :class:`CheckUnavailable` when no device here runs the target. ``progress(done, total)``
    is called after each record."""
    from .runner import build_candidate, error_line
    from .tasks import key as workload_key
    dev, device_name = local_device(target)
    cached = _read_cache()
    todo = []
    for t in tasks:
        rec = database.query_tuning_record(t.mod, target, "main")
        if rec is not None:
            todo.append((t, rec))
    out: dict[str, str | None] = {}
    for n, (t, rec) in enumerate(todo):
        key = workload_key(t)
        rid = record_id(rec, target, device_name)
        if rid in cached:
            out[key] = cached[rid]
        else:
            try:
                spec = kc.check_spec(t.mod["main"])
                ref = build_candidate(kc.default_kernel(t.mod, target), target)
                args, expected = kc.reference_outputs(ref["main"], dev, t.mod["main"], seed, spec)
                lib = build_candidate(kc.record_kernel(rec), target)
                got = kc.run_checked(lib["main"], dev, args)
                out[key] = kc.compare(got, expected, spec.tol)
            except Exception as err:  # TVM's build and run errors: the record is not applied
                out[key] = f"check failed: {error_line(err, 200)}"
            _append_cache(rid, out[key])
        if progress is not None:
            progress(n + 1, len(todo))
    return out


def checked_build(log, target, graphs: dict[str, tvm.IRModule], check: bool = True,
                  say=print) -> dict:
    """What a build with tuning log ``log`` compiles ``graphs`` (name -> unfused Relax module)
    with, every applied record checked (:func:`check_records`) unless ``check`` is False:
    ``{"database", "slower", "kernel_ms", "winograd" (graph name -> convolutions in the
    Winograd form), "wrong" (workload key -> reason, the records left out), "checked" (records
    checked, or None where they could not be: ``"unchecked"`` says why)}``.

    Leaving a record out can change which convolutions take the Winograd form (the choice
    compares kernel times), and so the tasks: the check runs again on the new tasks until no
    new record fails. ``say`` gets one line per record left out."""
    from .build import tuned_build, winograd_choice
    from .tasks import extract
    from .tasks import key as workload_key
    wrong: dict[str, str] = {}
    checked: dict[str, str | None] = {}
    out = {"wrong": wrong, "checked": None, "unchecked": None}
    while True:
        database, slower, kernel_ms = tuned_build(log, target, exclude=set(wrong))
        chosen = {name: winograd_choice(mod, kernel_ms) for name, mod in graphs.items()}
        out.update(database=database, slower=slower, kernel_ms=kernel_ms, winograd=chosen)
        if not check:
            return out
        tasks = [t for t in extract(graphs, target, chosen) if workload_key(t) not in checked]
        try:
            t0 = time.perf_counter()
            results = check_records(tasks, database, target)
        except CheckUnavailable as err:
            out["unchecked"] = str(err)
            say(f"tuning records not checked: {err}")
            return out
        checked.update(results)
        out["checked"] = len(checked)
        new = {k: why for k, why in results.items() if why is not None}
        for k, why in new.items():
            name = next((t.name for t in tasks if workload_key(t) == k), k)
            say(f"tuning record of {name} left out, the kernel keeps its default schedule: "
                f"{why}")
        if results:
            say(f"checked {len(results)} tuning record(s) on this machine's device in "
                f"{time.perf_counter() - t0:.0f} s: {len(new)} wrong")
        if not new:
            return out
        wrong.update(new)



def set_aside_wrong(log, target, graphs: dict[str, tvm.IRModule], say=print) -> int:
    """Check the records a build of ``graphs`` applies from ``log`` (an unpacked
    :class:`~thomas_tune.tuning_log.TuningLog`) and move each wrong one to
    ``database_tuning_record.json.rejected`` with its reason; again, until every applied record
    is right (the next-fastest record of a workload is checked in its turn). Returns the
    number of records set aside. Raises ValueError for a packed log ('thomas-tune log unpack'
    first) and :class:`CheckUnavailable` when no device here runs the target."""
    from tvm.s_tir import meta_schedule as ms

    from .build import tuned_build, winograd_choice
    from .tasks import extract
    from .tasks import key as workload_key
    from .tuning_log import _dumps, _rewrite, trace_json
    log.require_writable()
    total = 0
    while True:
        database, _, kernel_ms = tuned_build(log, target)
        chosen = {name: winograd_choice(mod, kernel_ms) for name, mod in graphs.items()}
        tasks = extract(graphs, target, chosen)
        results = check_records(tasks, database, target)
        wrong = {k: why for k, why in results.items() if why is not None}
        if not wrong:
            return total
        # the applied record of each wrong workload: its trace and run times, as in the file
        applied = {}
        for t in tasks:
            k = workload_key(t)
            if k in wrong:
                rec = database.query_tuning_record(t.mod, target, "main")
                applied[k] = (trace_json(rec),
                              [float(x) for x in rec.run_secs], t.name)
        with open(log.workload_path) as f:
            wl_keys = [str(tvm_ffi.structural_hash(ms.database.Workload.from_json(
                json.loads(line)).mod)) if line.strip() else None for line in f]
        with open(log.record_path) as f:
            lines = f.readlines()
        kept, aside = [], []
        for i, line in enumerate(lines):
            try:
                w, body = json.loads(line)
            except ValueError:
                kept.append(line)
                continue
            k = wl_keys[w] if 0 <= w < len(wl_keys) else None
            if k in applied and _dumps(body[0]) == applied[k][0] and \
                    [float(x) for x in body[1]] == applied[k][1]:
                aside.append((i, line, wrong[k]))
            else:
                kept.append(line)
        if not aside:
            raise RuntimeError("the wrong records were not found in "
                               f"{log.record_path}: " + ", ".join(a[2] for a in applied.values()))
        with open(log.record_path + ".rejected", "a") as f:
            for i, line, why in aside:
                f.write(json.dumps({"line": i + 1, "reason": why, "text": line.rstrip("\n")})
                        + "\n")
        _rewrite(log.record_path, kept)
        for k, (_, secs, name) in applied.items():
            say(f"{name}: record of {1e3 * sum(secs) / len(secs):.4f} ms set aside: {wrong[k]}")
        total += len(aside)
