"""Carry a tuning log over to a new code-generation version whose kernels are the same.

A log's times belong to the code-generation version it was measured with
(:mod:`.codegen`); its fingerprint of the code is conservative, so a change that moves code
without changing what it generates (a module split in two) makes a new version too, and every
log of the old one would have to be measured again on its device. Here that is decided by the
kernels themselves: for every record of the log, its trace is applied to its workload and the
result built through the tuner's own build path
(:func:`thomas_tune.measure.builder.build_candidate`: the project's TIR pipeline, the OpenCL
source rewrite of :mod:`thomas_tune.opencl_source`), and the sha256 of every source of the built
module (the device's OpenCL C, the host's LLVM IR with the launch sizes; the LLVM IR alone for a
CPU; the buffer addresses that LLVM's alias-analysis names hold, which differ from process to
process, numbered in order instead) is its *kernel digest*. A record whose trace does not apply
or whose build fails has the digest ``"error: <exception class>: <first line>"``. The default
schedule of each workload with records, for the records' target, is digested the same way
(:func:`default_digest`): the kernel whose time ``default_latency.json`` keeps.

:func:`write_digests` writes the digests of a log's records under the installed code (a JSON
file, :func:`read_digests`); the digests of the old version are made with the old code (a git
worktree at a commit of that version, its own virtual environment: ``python
tools/kernel_digests.py LOG --out-dir DIR`` loads this module into whatever ``thomas_tune`` that
Python imports). :func:`carry` then compares them with the digests under this installation: only
when every record's and default schedule's digest is the same (byte-identical kernels), the
digests of the old version were made by the version the log is stamped with and cover exactly
the log's records, is the log restamped with this installation's version (``"how"``: ``carried:
N records' kernels identical to version OLD``; the old stamp kept as ``"carried_from"``).
Otherwise nothing is written and :class:`CarryRefused` names the records that differ.

One difference is taken: a record of a failed trial (no time: MetaSchedule's stand-in, or
:data:`~thomas_tune.logs.FAILED_RUN_S`) whose kernel is another now. Its failure was the old
kernel's (a change of the code generation that fixes what made such kernels fail is the usual
cause: ``schedules/bool_casts.py``), so it holds nothing of the new one: it is moved to
:data:`~thomas_tune.logs.STALE` with the reason, and a later search may measure its schedule
again. Every measured time stays tied to an identical kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field

from .codegen import current, read_version, write_stamp

#: the format of a digests file (:func:`write_digests`)
DIGESTS_FORMAT = "thomas-tune kernel digests v1"


class CarryRefused(ValueError):
    """A log was not carried over: the message says why (records whose kernels differ, a
    digests file of another version or of other records) and what to do instead."""


def _key(*parts) -> str:
    """sha256 (24 hex digits) of ``parts`` written as canonical JSON."""
    text = json.dumps(list(parts), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def record_key(workload_json, body: list) -> str:
    """The key of a record in a digests file: :func:`_key` of its workload's JSON, its trace
    and its target (``body[0]``, ``body[2]``). Its run times are left out: a re-measured
    record keeps its key."""
    return _key(workload_json, body[0], body[2] if len(body) > 2 else None)


#: a buffer's address in the name of an LLVM type-based alias-analysis node
#: (``!{!"0x55d0c1a2b3c0.w4.b0", ...}``): it differs from process to process
_ADDRESS = re.compile(r'(?<=")0x[0-9a-f]+(?=[."])')


def _canonical(text: str) -> str:
    """``text`` with each address of :data:`_ADDRESS` replaced by ``addr<n>``, ``n`` counting
    the distinct addresses in order of first appearance (distinct buffers stay distinct)."""
    names: dict[str, str] = {}
    return _ADDRESS.sub(lambda m: names.setdefault(m.group(0), f"addr{len(names)}"), text)


def _module_digest(rt_mod) -> str:
    """sha256 of every source of the built module ``rt_mod`` and its imports (the host's LLVM
    IR, the device's OpenCL C), with their kinds, addresses made canonical
    (:func:`_canonical`)."""
    h = hashlib.sha256()
    for mod in [rt_mod, *rt_mod.imports]:
        for fmt in ("ll", ""):
            try:
                text = mod.inspect_source(fmt)
            except Exception:  # noqa: BLE001 - a module without that source
                continue
            if text:
                h.update(f"{mod.kind}:{fmt}\0".encode() + _canonical(text).encode() + b"\0")
                break
    return h.hexdigest()


def _failure(err: Exception) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return f"error: {type(err).__name__}: {first}"


def default_key(workload_json, target_json) -> str:
    """The key of a workload's default schedule for a target in a digests file: :func:`_key`
    of both."""
    return _key(workload_json, target_json)


def kernel_digest(workload, body: list) -> str:
    """sha256 of the code the trace of the record ``body`` (``[trace, run_secs, target,
    args_info]``) makes of ``workload`` (a MetaSchedule ``Workload``), built as a tuning
    candidate; ``"error: ..."`` when the trace does not apply or the build fails."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    from ..measure.builder import build_candidate
    try:
        rec = ms.database.TuningRecord.from_json(body, workload)
        sch = Schedule(workload.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        return _module_digest(build_candidate(sch.mod, rec.target))
    except Exception as err:  # noqa: BLE001 - any failure is the record's outcome, compared
        return _failure(err)


def default_digest(workload, target_json) -> str:
    """sha256 of the code of ``workload``'s default schedule for the target ``target_json``
    (a record's target), as an untuned build schedules it
    (:func:`thomas_tune.schedules.default_schedules`) and built as a candidate: the kernel
    whose time ``default_latency.json`` keeps; ``"error: ..."`` when that fails."""
    import tvm

    from ..measure.builder import build_candidate
    from ..schedules import default_schedules
    try:
        target = tvm.target.Target(target_json)
        mod = default_schedules(tvm.IRModule({"main": workload.mod["main"]}), target)
        return _module_digest(build_candidate(mod, target))
    except Exception as err:  # noqa: BLE001 - compared like a record's failure
        return _failure(err)


@dataclass
class Digests:
    """The kernel digests of a log's records: ``codegen`` the version that made them
    (:func:`thomas_tune.logs.codegen.current` of that process), ``records`` ``{record key:
    digest}`` (:func:`record_key`, :func:`kernel_digest`), ``defaults`` ``{default key:
    digest}`` of the default schedules of the workloads with records, per target
    (:func:`default_key`, :func:`default_digest`), ``seconds`` how long they took."""

    log: str
    codegen: dict
    records: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _log_records(log_path: str) -> list[tuple[str, object, list, object, int]]:
    """(record key, Workload, body, workload JSON, line number from 1) of every good record of
    the log ``log_path`` (packed or not), in file order. Raises CarryRefused when a line does
    not parse (set it aside first: ``thomas-tune log check``)."""
    from .tuning_log import TuningLog, parse_lines
    log = TuningLog(log_path)
    lines = parse_lines(log.workload_path, log.record_path)
    if lines.bad_workloads or lines.bad_records:
        raise CarryRefused(f"tuning log {log_path!r} has lines that do not parse; set them "
                           f"aside first ('thomas-tune log check {log_path} ...')")
    return [(record_key(lines.workloads[w][2], body), lines.workloads[w][3], body,
             lines.workloads[w][2], i + 1) for i, w, body in lines.records]


def compute_digests(log_path: str, progress=None) -> Digests:
    """The kernel digests of every record of the log ``log_path`` under the installed code;
    ``progress(done, total)`` after each record."""
    from .. import schedules  # noqa: F401 - the schedule rules' instructions, registered
    out = Digests(log_path, current())
    t0 = time.perf_counter()
    records = _log_records(log_path)
    for i, (key, workload, body, workload_json, _) in enumerate(records):
        if key not in out.records:
            out.records[key] = kernel_digest(workload, body)
        target = body[2] if len(body) > 2 else None
        dkey = default_key(workload_json, target)
        if target is not None and dkey not in out.defaults:
            out.defaults[dkey] = default_digest(workload, target)
        if progress is not None:
            progress(i + 1, len(records))
    out.seconds = time.perf_counter() - t0
    return out


def write_digests(digests: Digests, path: str) -> None:
    """Write ``digests`` as JSON to ``path`` (atomically)."""
    from ..files import write_atomically
    body = {"format": DIGESTS_FORMAT, "log": digests.log, "codegen": digests.codegen,
            "seconds": round(digests.seconds, 1), "records": digests.records,
            "defaults": digests.defaults}
    write_atomically(path, json.dumps(body, indent=0, sort_keys=True) + "\n")


def read_digests(path: str) -> Digests:
    """The digests file ``path`` (:func:`write_digests`). Raises CarryRefused for a file of
    another format."""
    try:
        with open(path) as f:
            body = json.load(f)
        if body.get("format") != DIGESTS_FORMAT:
            raise ValueError(f"format {body.get('format')!r}, not {DIGESTS_FORMAT!r}")
        return Digests(str(body["log"]), dict(body["codegen"]), dict(body["records"]),
                       dict(body["defaults"]), float(body.get("seconds", 0.0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CarryRefused(f"{path!r} is not a kernel-digests file ({err}); write one with "
                           "'thomas-tune log digests LOG --out-dir DIR' (or "
                           "tools/kernel_digests.py under the old code)") from err


@dataclass
class CarryReport:
    """What :func:`carry` found: the version carried from and to, ``records`` compared (all of
    the log's, distinct), ``defaults`` (the default schedules of their workloads, per target),
    ``errors`` (records whose build fails under both, identically), ``changed`` (distinct
    records of failed trials whose kernels changed) and ``set_aside`` (their lines, moved to
    :data:`~thomas_tune.logs.STALE`)."""

    old: str
    new: str
    records: int
    defaults: int
    errors: int
    changed: int = 0
    set_aside: int = 0


def carry(log_path: str, old: Digests, new: Digests | None = None, progress=None
          ) -> CarryReport:
    """Restamp the log ``log_path`` with this installation's code-generation version when
    every record's kernel under it is byte-identical to its kernel under the version the log
    is stamped with (see the module docstring).

    ``old``: the digests under the log's version (made with that code); ``new``: those under
    this installation (computed here when None, ``progress`` as :func:`compute_digests`).
    Raises CarryRefused, writing nothing, when the log is of unknown version or already of
    this one, when ``old`` was made by another version than the stamp's or ``new`` by another
    than this installation, when either does not cover exactly the log's records, or when a
    record's digests differ (the message names up to 10 of them: workload position, record
    line, digests)."""
    version = read_version(log_path)
    now = current()
    if version.status == "unknown":
        raise CarryRefused(f"tuning log {log_path!r}: {version.line()}: there is no version to "
                           "carry from; measure it again ('thomas-tune remeasure --restamp')")
    if version.status == "current":
        raise CarryRefused(f"tuning log {log_path!r} is already of this installation's code "
                           f"generation {now['id']}: nothing to carry")
    stamped = version.stamp["id"]
    if old.codegen.get("id") != stamped:
        raise CarryRefused(f"the old digests were made under code generation "
                           f"{old.codegen.get('id')}, but {log_path!r} is stamped "
                           f"{stamped}: make them with the code of {stamped}")
    if new is None:
        new = compute_digests(log_path, progress)
    if new.codegen.get("id") != now["id"]:
        raise CarryRefused(f"the new digests were made under code generation "
                           f"{new.codegen.get('id')}, not this installation's {now['id']}")
    records = _log_records(log_path)
    keys = {r[0] for r in records}
    where: dict[str, str] = {}  # key -> where it comes from, for the message
    for key, _, body, workload_json, line in records:
        where.setdefault(key, f"record line {line}")
        if len(body) > 2:
            where.setdefault(default_key(workload_json, body[2]),
                             f"default schedule of the workload of record line {line}")
    default_keys = set(where) - keys
    for name, d in (("old", old), ("new", new)):
        if set(d.records) != keys or set(d.defaults) != default_keys:
            raise CarryRefused(
                f"the {name} digests ({d.log!r}) are not of the records of {log_path!r} "
                f"({len(keys ^ set(d.records))} records and {len(default_keys ^ set(d.defaults))}"
                f" default schedules differ in the two lists); make them from this log as it is")
    both = {**old.records, **old.defaults}, {**new.records, **new.defaults}
    differ = [k for k in where if both[0][k] != both[1][k]]
    failed = _failed_keys(records)
    aside = {k for k in differ if k in failed}
    differ = [k for k in differ if k not in aside]
    if differ:
        names = "; ".join(f"{where[k]}: {both[0][k][:16]} -> {both[1][k][:16]}"
                          for k in differ[:10])
        raise CarryRefused(
            f"tuning log {log_path!r} not carried from {stamped} to {now['id']}: "
            f"{len(differ)} of {len(keys)} records and {len(default_keys)} default schedules "
            f"make other kernels under this installation ({names}); their times are not those "
            f"of the new kernels: measure the log again ('thomas-tune remeasure --restamp "
            f"--log {log_path} ...')")
    moved = _set_aside(log_path, [r[4] for r in records if r[0] in aside],
                       f"a failed trial of a kernel that code generation {now['id']} no longer "
                       f"makes (log carried from {stamped})") if aside else 0
    errors = sum(1 for k in keys - aside if new.records[k].startswith("error:"))
    how = f"carried: {len(keys) - len(aside)} records' kernels identical to version {stamped}"
    if moved:
        how += f"; {moved} failed trials of changed kernels set aside"
    write_stamp(log_path, how, carried_from=version.stamp)
    return CarryReport(stamped, now["id"], len(keys), len(default_keys), errors, len(aside),
                       moved)


def _failed_keys(records: list) -> set[str]:
    """The keys of ``records`` (:func:`_log_records`) whose every line is a failed trial."""
    from .database import mean_run_seconds
    ok, failed = set(), set()
    for key, _, body, _, _ in records:
        (failed if mean_run_seconds(body[1] or ()) == float("inf") else ok).add(key)
    return failed - ok


def _set_aside(log_path: str, line_numbers: list[int], reason: str) -> int:
    """Move the record lines ``line_numbers`` (from 1) of the unpacked log ``log_path`` to
    :data:`~thomas_tune.logs.STALE` with ``reason`` (:func:`.tuning_log.set_aside`); returns
    how many moved. Raises CarryRefused for a packed log (its files are read-only)."""
    from .tuning_log import TuningLog, set_aside
    log = TuningLog(log_path)
    if log.packed:
        raise CarryRefused(f"tuning log {log_path!r} is packed, and {len(line_numbers)} failed "
                           "trials of changed kernels must be set aside: 'thomas-tune log "
                           f"unpack {log_path}', carry, then 'thomas-tune log pack {log_path}'")
    with open(log.record_path) as f:
        lines = f.readlines()
    return set_aside(log_path, lines, (n - 1 for n in line_numbers), reason)


def digests_name(log_path: str) -> str:
    """A file name for the digests of the log ``log_path``: its folder's parent and name."""
    parts = os.path.normpath(os.path.abspath(log_path)).split(os.sep)
    return "-".join(parts[-2:]) + ".digests.json"
