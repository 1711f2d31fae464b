"""The tuning log: MetaSchedule's JSON database on disk, checked before use.

A tuning log is a folder (by convention ``tuning_logs/<device>/<model>/``) with MetaSchedule's two
files: ``database_workload.json`` (one workload per line) and ``database_tuning_record.json``
(one tuning record per line: workload index, trace, run times, target, argument info).
MetaSchedule appends one line per measured trial and closes the file after each, so a killed run
loses at most the record in flight.

MetaSchedule reads the files through :class:`LogDatabase`, which builds a record only when it
hands it out. Before it does, :meth:`TuningLog.check` parses every line. A line that does
not parse (a torn last line, a hand edit, a record whose workload is unreadable) is reported,
moved to ``<file>.rejected`` with the reason, and left out of the file MetaSchedule reads;
nothing is dropped silently.

One tuner at a time: :meth:`TuningLog.lock` takes an advisory lock (``.lock`` in the folder,
holding the pid, host and start time of its holder); a second tuner on the same log is refused
with :class:`LogInUse` naming the holder. The lock goes with the process, however it ends (a
SIGKILL too), so it never goes stale. Trials that fail (a build error, a run that timed out, a
device server lost during the trial) are appended with their reason to ``trial_errors.jsonl``
(:class:`TrialErrors`), next to MetaSchedule's files.

:func:`read_log`, :func:`summarize` and :func:`merge` read logs without changing them (show) and
merge the logs of several devices or runs, keeping every distinct record once.

A log may be *packed* (:func:`pack`): its two files xz-compressed (``database_workload.json.xz``,
``database_tuning_record.json.xz``; traces compress about 100x: the H100 MobileNetV2 log is 19 MB
of records and 0.17 MB packed). A packed log is read-only. :class:`TuningLog` reads it from a
copy unpacked once into the cache folder (keyed by the packed files' sha256); tuning into it or
re-measuring it asks for :func:`unpack` first. The GPU logs committed under ``tuning_logs/`` are
packed.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import lzma
import math
import os
import re
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm.s_tir.meta_schedule import _ffi_api as ms_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule

from .models import share_mode

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
LOCK = ".lock"
PACKED = ".xz"  # suffix of a packed log's files (xz, Python's lzma)
ERRORS = "trial_errors.jsonl"
# the structural hashes of the log's measured schedules, kept to skip replays on a resumed run
HASHES = "schedule_hashes.json"
# MetaSchedule records a trial without a run time (failed build or run) with this many seconds
FAILED_RUN_S = 1e9


class LogInUse(ValueError):
    """Another process holds the tuning log's lock (the message names its pid and the fix)."""


class LogLock:
    """A held lock of a tuning-log folder; ``release()`` (or leaving the ``with`` block) frees
    it. The kernel frees it when the process ends in any way."""

    def __init__(self, log_path: str, fd: int):
        self.log_path, self.fd = log_path, fd

    def release(self) -> None:
        """Free the lock (once; later calls do nothing)."""
        if self.fd is not None:
            _HELD.pop(self.log_path, None)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


_HELD: dict[str, LogLock] = {}  # folders whose lock this process holds


def _holder(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            h = json.load(f)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["since"])))
        return f"pid {h['pid']} on {h['host']}, {h['purpose']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


@dataclass
class CheckReport:
    """Outcome of :meth:`TuningLog.check`: counts, and (file, line number, reason) of rejects."""

    workloads: int = 0
    records: int = 0
    rejected: list[tuple[str, int, str]] = field(default_factory=list)


def _rewrite(path: str, lines: list[str]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    share_mode(tmp)
    os.replace(tmp, path)


def is_packed(path: str) -> bool:
    """Whether the folder ``path`` holds a packed log (:func:`pack`): a packed record file and
    no plain one."""
    return (os.path.exists(os.path.join(path, RECORDS + PACKED))
            and not os.path.exists(os.path.join(path, RECORDS)))


def _unpacked_copy(path: str) -> str:
    """The folder, in the cache, holding the plain files of the packed log ``path``; unpacked
    on first use (into a temporary folder renamed into place, so a reader never sees half)."""
    h = hashlib.sha256()
    for name in (WORKLOADS, RECORDS):
        packed = os.path.join(path, name + PACKED)
        if os.path.exists(packed):
            with open(packed, "rb") as f:
                h.update(name.encode() + f.read())
    from .opencl import _cache_dir  # the project's cache folder (THOMAS_TUNE_CACHE)
    dest = os.path.join(_cache_dir(), "logs", h.hexdigest()[:24])
    if os.path.isdir(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(dest))
    for name in (WORKLOADS, RECORDS):
        packed = os.path.join(path, name + PACKED)
        if os.path.exists(packed):
            with lzma.open(packed, "rb") as src, open(os.path.join(tmp, name), "wb") as out:
                out.write(src.read())
    try:
        os.rename(tmp, dest)
    except OSError:  # another process unpacked it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _hash_stamp() -> str:
    """What a kept schedule hash depends on besides workload and trace: TVM's version (its
    schedule primitives and structural hash)."""
    return f"schedule-hashes-v1 tvm {tvm.__version__}"


def _dumps(obj) -> str:
    """One line of JSON of a workload's, trace's or record's ``as_json()`` form."""
    # imported here, not with the module: the schedules import dlight, which needs TVM's
    # compiler, and processes with the runtime alone import this module (through the CLI)
    from .schedules import json_default
    return json.dumps(obj, default=json_default, separators=(",", ":"))


def trace_json(record) -> str:
    """A tuning record's trace as one line of JSON, as the record's line in a tuning log
    holds it (``_dumps`` of the line's parsed trace gives the same text)."""
    return _dumps(ms_ffi.TuningRecordAsJSON(record)[0])


class _Entry:
    """One record line of a :class:`LogDatabase`: its mean run time (MetaSchedule's), whether
    get_top_k hands it out, the line's text (parsed again when needed: the parsed traces of a
    large log take several times the memory of its text), and the TuningRecord once built."""

    __slots__ = ("mean", "seq", "valid", "line", "record")

    def __init__(self, run_secs, seq: int, line: str, record=None):
        self.mean, self.valid = _ms_mean(run_secs), _ms_valid(run_secs)
        self.seq, self.line, self.record = seq, line, record

    @property
    def body(self) -> list:
        return json.loads(self.line)[1]


# MetaSchedule's stand-in run time of a trial without one (SortTuningRecordByMeanRunSecs)
_MS_NO_TIME = 1e10


def _ms_mean(run_secs) -> float:
    secs = [float(s) for s in run_secs or []]
    return sum(secs) / len(secs) if secs else _MS_NO_TIME


def _ms_valid(run_secs) -> bool:
    """Whether MetaSchedule's get_top_k hands the record out: some run time that is not the
    stand-in of a failed trial."""
    secs = [float(s) for s in run_secs or []]
    return bool(secs) and not all(s == _MS_NO_TIME for s in secs)


@derived_object
class LogDatabase(ms.database.PyDatabase):
    """A tuning log's two files as a MetaSchedule database that builds records when asked.

    MetaSchedule's ``JSONDatabase`` replays every record's trace on its workload when it
    opens the files (``TuningRecord.from_json`` applies the trace to rebuild it): 152 s for
    the 25,354 records of the H100 AlexNet log on 2 cores, before the first trial of a
    resumed run or the first kernel of an export. This database parses the lines as JSON
    (about 4 s there), keeps each workload's records sorted by mean run time as
    ``JSONDatabase`` does (ties in file order), and builds a ``TuningRecord`` only when
    :meth:`get_top_k` hands it out (once; it is kept). What it hands out is what
    ``JSONDatabase`` hands out: records with at least one run time that is not MetaSchedule's
    stand-in for a failed trial (1e10 s), fastest first (checked against ``JSONDatabase`` in
    ``tests/test_faults.py``). A committed workload or record is appended to its file as
    ``JSONDatabase`` appends it: one line, the file closed after each.

    ``workload_path``, ``record_path``: the two files (created on the first commit). Lines
    that do not parse are skipped here; :meth:`TuningLog.check` reports them and sets them
    aside before a log is opened. Raises what ``Workload.from_json`` raises for a workload
    line that parses as JSON but not as TIR.
    """

    def __init__(self, workload_path: str, record_path: str):
        self.workload_path, self.record_path = workload_path, record_path
        self.workloads: list = []              # Workload objects, in file order
        self.by_hash: dict[int, list[int]] = {}  # structural hash -> workload indices
        self.entries: list[list[_Entry]] = []    # per workload, sorted by (mean, seq)
        self.keys: list[str] = []                # per workload: structural hash (decimal)
        self.count = 0
        self.lock = threading.RLock()
        if os.path.exists(workload_path):
            with open(workload_path) as f:
                for line in f:
                    if line.strip():
                        self._add_workload(ms.database.Workload.from_json(json.loads(line)))
        if os.path.exists(record_path):
            with open(record_path) as f:
                for line in f:
                    try:
                        idx, body = json.loads(line)
                        idx = int(idx)
                        if not 0 <= idx < len(self.workloads) or not isinstance(body, list) \
                                or len(body) < 2:
                            continue
                        secs = [float(x) for x in body[1]]
                    except (ValueError, TypeError):  # check() reports such lines
                        continue
                    self.entries[idx].append(_Entry(secs, self.count, line))
                    self.count += 1
        for rows in self.entries:
            rows.sort(key=lambda e: (e.mean, e.seq))

    def _add_workload(self, workload) -> int:
        index = len(self.workloads)
        h = int(tvm_ffi.structural_hash(workload.mod))
        self.workloads.append(workload)
        self.by_hash.setdefault(h, []).append(index)
        self.entries.append([])
        self.keys.append(str(h))
        return index

    def _index(self, mod) -> int | None:
        for i in self.by_hash.get(int(tvm_ffi.structural_hash(mod)), []):
            if tvm_ffi.structural_equal(self.workloads[i].mod, mod):
                return i
        return None

    def _index_of(self, workload) -> int | None:
        for i, w in enumerate(self.workloads):
            if w.same_as(workload):
                return i
        return self._index(workload.mod)

    def _built(self, idx: int, entry: _Entry):
        if entry.record is None:
            entry.record = ms.database.TuningRecord.from_json(entry.body, self.workloads[idx])
        return entry.record

    def workload_key(self, workload) -> str | None:
        """The structural hash (decimal) of a workload of this database, or None."""
        idx = self._index_of(workload)
        return None if idx is None else self.keys[idx]

    def bodies(self, workload) -> list[list]:
        """The JSON bodies (``[trace, run_secs, target, args_info]``) of the records of
        ``workload`` that :meth:`get_top_k` hands out, fastest first; nothing is built."""
        with self.lock:
            idx = self._index_of(workload)
            return [] if idx is None else [e.body for e in self.entries[idx] if e.valid]

    def first(self, accept) -> list:
        """Per workload (in file order) with one: its fastest record whose run times pass
        ``accept(run_secs: list[float]) -> bool``, built; nothing else is built."""
        out = []
        with self.lock:
            for idx, rows in enumerate(self.entries):
                for e in rows:
                    if accept([float(x) for x in e.body[1]]):  # parsed: few per workload
                        out.append(self._built(idx, e))
                        break
        return out

    def has_workload(self, mod) -> bool:
        with self.lock:
            return self._index(mod) is not None

    def commit_workload(self, mod):
        with self.lock:
            idx = self._index(mod)
            if idx is not None:
                return self.workloads[idx]
            workload = ms.database.Workload(mod)
            with open(self.workload_path, "a") as f:
                f.write(_dumps(workload.as_json()) + "\n")
            self._add_workload(workload)
            return workload

    def commit_tuning_record(self, record) -> None:
        with self.lock:
            idx = self._index_of(record.workload)
            if idx is None:
                idx = self._index_of(self.commit_workload(record.workload.mod))
            # (TuningRecord.as_json() stops on a trace holding an IndexMap, the layout of a
            # transform_layout: the record's FFI form goes to json_default as it is)
            line = _dumps([idx, ms_ffi.TuningRecordAsJSON(record)]) + "\n"
            with open(self.record_path, "a") as f:  # closed (flushed) per record
                f.write(line)
            entry = _Entry([float(s) for s in record.run_secs or []], self.count, line, record)
            self.count += 1
            bisect.insort(self.entries[idx], entry, key=lambda e: (e.mean, e.seq))

    def get_top_k(self, workload, top_k: int) -> list:
        if top_k < 0:
            raise ValueError(f"top_k {top_k} is negative")
        with self.lock:
            idx = self._index_of(workload)
            if idx is None:
                return []
            out = []
            for e in self.entries[idx]:
                if len(out) >= top_k:
                    break
                if e.valid:
                    out.append(self._built(idx, e))
            return out

    def get_all_tuning_records(self) -> list:
        """Every record (each built: slow on a large log), fastest first."""
        with self.lock:
            rows = sorted(((e.mean, e.seq, i, e) for i, es in enumerate(self.entries)
                           for e in es), key=lambda r: (r[0], r[1]))
            return [self._built(i, e) for _, _, i, e in rows]

    def query_tuning_record(self, mod, target, workload_name):
        with self.lock:
            idx = self._index(mod)
            if idx is None:
                return None
            top = self.get_top_k(self.workloads[idx], 1)
            return top[0] if top else None

    def query_schedule(self, mod, target, workload_name):
        rec = self.query_tuning_record(mod, target, workload_name)
        if rec is None:
            return None
        sch = Schedule(rec.workload.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        return sch

    def query_ir_module(self, mod, target, workload_name):
        sch = self.query_schedule(mod, target, workload_name)
        return None if sch is None else sch.mod

    def __len__(self) -> int:
        return self.count


class TuningLog:
    """A tuning-log folder. ``path`` is created on first use. A packed folder (:func:`pack`) is
    read from its unpacked copy in the cache (``packed`` is True); it cannot be locked."""

    def __init__(self, path: str):
        self.path = path
        self.packed = is_packed(path)
        files = _unpacked_copy(path) if self.packed else path
        self.workload_path = os.path.join(files, WORKLOADS)
        self.record_path = os.path.join(files, RECORDS)
        self._hash_cache: dict | None = None
        self._replayed = 0

    def exists(self) -> bool:
        return os.path.exists(self.record_path)

    def require_writable(self) -> None:
        """Raise ValueError, naming 'thomas-tune log unpack', when this log is packed."""
        if self.packed:
            raise ValueError(f"tuning log {self.path!r} is packed (read-only: {RECORDS}{PACKED}); "
                             f"unpack it first with 'thomas-tune log unpack {self.path}', then "
                             f"pack it again for a commit ('thomas-tune log pack')")

    def lock(self, purpose: str = "tuning") -> LogLock:
        """Take this folder's lock for ``purpose`` (a word shown to a refused second process).

        Returns a :class:`LogLock` (a context manager). Raises :class:`LogInUse` naming the
        holder (pid, host, since when) when another process, or another lock of this one,
        holds it. Creates the folder.
        """
        self.require_writable()
        os.makedirs(self.path, exist_ok=True)
        lock_path = os.path.join(self.path, LOCK)
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LogInUse(
                f"tuning log {self.path!r} is in use by another tuner ({_holder(lock_path)}); "
                "wait for it to finish or stop it, or give this run another --log and merge "
                "the two afterwards with 'thomas-tune log merge'") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.time(), "purpose": purpose}).encode())
        held = _HELD[os.path.abspath(self.path)] = LogLock(os.path.abspath(self.path), fd)
        return held

    def check(self, report_to=sys.stderr, set_aside: bool = True) -> CheckReport:
        """Parse every line; move bad ones to ``<file>.rejected`` (see the module docstring).

        Records keep pointing at the right workload when a workload line is rejected (indices
        are renumbered). With ``set_aside=False`` bad lines are only reported and no file
        changes. Returns a :class:`CheckReport`; raises :class:`LogInUse` when bad lines must
        be set aside while another process holds the log's lock (a tuner still appending).
        """
        if self.packed:
            set_aside = False  # a packed log is read-only: bad lines are reported only
        os.makedirs(self.path, exist_ok=True)
        report = CheckReport()
        new_index: dict[int, int] = {}
        good_workloads, bad_workloads = [], []
        if os.path.exists(self.workload_path):
            with open(self.workload_path) as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        ms.database.Workload.from_json(json.loads(line))
                        new_index[i] = len(good_workloads)
                        good_workloads.append(line if line.endswith("\n") else line + "\n")
                    except Exception as err:  # JSON or TVM parse error: reject, keep the text
                        bad_workloads.append((i, line, f"bad workload: {err}"))
        good_records, bad_records = [], []
        if os.path.exists(self.record_path):
            with open(self.record_path) as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                        idx, body = int(obj[0]), obj[1]
                        if idx not in new_index:
                            raise ValueError(f"workload #{idx} is missing or was rejected")
                        if not isinstance(body, list) or len(body) < 2:
                            raise ValueError("record body is not [trace, run_secs, ...]")
                        [float(s) for s in body[1]]
                        good_records.append(json.dumps([new_index[idx], body]) + "\n")
                    except Exception as err:
                        bad_records.append((i, line, f"bad record: {err}"))
        report.workloads, report.records = len(good_workloads), len(good_records)
        if not set_aside:
            for path, bad in ((self.workload_path, bad_workloads),
                              (self.record_path, bad_records)):
                for i, _, why in bad:
                    report.rejected.append((os.path.basename(path), i + 1, why))
                    if report_to is not None:
                        print(f"tuning log {path}:{i + 1}: {why}", file=report_to)
            return report
        temporary = None
        if (bad_workloads or bad_records) and os.path.abspath(self.path) not in _HELD:
            temporary = self.lock("setting aside bad lines")
        try:
            self._set_aside(bad_workloads, bad_records, good_workloads, good_records, report,
                            report_to)
        finally:
            if temporary is not None:
                temporary.release()
        return report

    def _set_aside(self, bad_workloads, bad_records, good_workloads, good_records, report,
                   report_to) -> None:
        for path, bad in ((self.workload_path, bad_workloads), (self.record_path, bad_records)):
            if not bad:
                continue
            with open(path + ".rejected", "a") as f:
                for i, line, why in bad:
                    f.write(json.dumps({"line": i + 1, "reason": why, "text": line.rstrip("\n")})
                            + "\n")
                    report.rejected.append((os.path.basename(path), i + 1, why))
                    if report_to is not None:
                        print(f"tuning log {path}:{i + 1}: {why}; moved to {path}.rejected",
                              file=report_to)
        if bad_workloads:
            _rewrite(self.workload_path, good_workloads)
        if bad_workloads or bad_records:
            _rewrite(self.record_path, good_records)

    def database(self, check: bool = True) -> LogDatabase:
        """This folder's records as a MetaSchedule database (:class:`LogDatabase`: records are
        built when handed out), after :meth:`check` unless told not to."""
        if check:
            self.check()
        return LogDatabase(self.workload_path, self.record_path)

    def workloads(self) -> list[tvm.IRModule]:
        """The kernels (one PrimFunc module each) of this log's workload file, in its order;
        a line that does not parse is left out (:meth:`check` reports and sets it aside)."""
        mods = []
        if os.path.exists(self.workload_path):
            with open(self.workload_path) as f:
                for line in f:
                    try:
                        mods.append(ms.database.Workload.from_json(json.loads(line)).mod)
                    except Exception:  # TVM's errors of a bad line; check() names them
                        continue
        return mods

    @property
    def hash_path(self) -> str:
        return os.path.join(self.path, HASHES)

    def measured(self, database: LogDatabase, mod) -> set[int]:
        """Structural hashes of the schedules of ``mod`` (a task's workload) measured so far,
        as ``database`` (this log's :meth:`database`) holds them.

        Each record's trace is replayed on the workload; the hash of the result identifies the
        candidate as MetaSchedule's own de-duplication does. The replays run on a thread per
        core (TVM lets go of Python's lock while it replays). The hashes are kept in
        ``schedule_hashes.json`` in the log folder (:data:`HASHES`, keyed by workload, trace
        and TVM version; :meth:`save_hashes` writes them), so that a resumed run replays only
        the records added since its last start: the 25,354 records of the H100 AlexNet log
        took 151 s to replay on 2 cores. Raises TypeError for another kind of database.
        """
        from concurrent.futures import ThreadPoolExecutor

        if not isinstance(database, LogDatabase):
            raise TypeError(f"measured() reads a LogDatabase (TuningLog.database()), not a "
                            f"{type(database).__name__}")
        if not database.has_workload(mod):
            return set()
        workload = database.commit_workload(mod)
        known = self._hashes().setdefault(database.workload_key(workload), {})
        todo, out = [], set()
        for body in database.bodies(workload):
            key = hashlib.sha1(_dumps(body[0]).encode()).hexdigest()[:20]
            if key not in known:
                todo.append((key, body[0]))
            elif known[key] is not None:
                out.add(int(known[key]))

        def replayed(item):
            sch = Schedule(mod)
            try:
                tvm.s_tir.schedule.Trace.apply_json_to_schedule(item[1], sch)
            except Exception:  # a trace that no longer applies cannot be a duplicate
                return item[0], None
            return item[0], tvm_ffi.structural_hash(sch.mod)

        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            for key, h in pool.map(replayed, todo, chunksize=16):
                known[key] = None if h is None else str(h)
                if h is not None:
                    out.add(int(h))
        self._replayed += len(todo)
        return out

    def _hashes(self) -> dict:
        """``{workload key: {trace key: schedule hash or None}}`` as :data:`HASHES` holds it
        (empty when missing, unreadable, or written under another TVM version)."""
        if self._hash_cache is None:
            self._hash_cache = {}
            try:
                with open(self.hash_path) as f:
                    data = json.load(f)
                if isinstance(data, dict) and data.get("stamp") == _hash_stamp() \
                        and isinstance(data.get("hashes"), dict):
                    self._hash_cache = data["hashes"]
            except (OSError, ValueError):  # none yet, or torn: replay again
                pass
        return self._hash_cache

    def save_hashes(self) -> int:
        """Write the schedule hashes replayed by :meth:`measured` (atomically) to
        :data:`HASHES`; returns how many records were replayed since the log was opened."""
        if self._hash_cache is not None and self._replayed and not self.packed:
            os.makedirs(self.path, exist_ok=True)
            _rewrite(self.hash_path, [json.dumps({"stamp": _hash_stamp(),
                                                  "hashes": self._hash_cache})])
        return self._replayed

    def best_seconds(self, database: ms.Database, mod) -> float | None:
        """Mean run time (s) of the fastest record of workload ``mod``, or None if it has none."""
        if not database.has_workload(mod):
            return None
        top = database.get_top_k(database.commit_workload(mod), 1)
        secs = mean_run_seconds(top[0].run_secs) if top else math.inf
        return secs if math.isfinite(secs) else None

    def records_per_workload(self, database: ms.Database, mod) -> int:
        """Number of records with a valid run time for workload ``mod``."""
        if not database.has_workload(mod):
            return 0
        return len(database.get_top_k(database.commit_workload(mod), 1 << 30))


# ---- failed trials, with their reasons --------------------------------------------------------
@derived_object
class TrialErrors(ms.measure_callback.PyMeasureCallback):
    """Measure callback appending each failed trial of a run to ``<log>/trial_errors.jsonl``:
    one JSON object per line, ``{"time", "task", "stage": "build"|"run", "reason"}`` (time in
    seconds since the epoch). ``count`` is the number written by this run."""

    def __init__(self, log: "TuningLog", task_names: list[str]):
        self.path = os.path.join(log.path, ERRORS)
        self.task_names = list(task_names)
        self.count = 0

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        failed = []
        for b, r in zip(builder_results, runner_results):
            if b.error_msg is not None:
                failed.append(("build", str(b.error_msg)))
            elif r.error_msg is not None or not r.run_secs:
                failed.append(("run", str(r.error_msg or "no run time")))
        self._write([(self.task_names[task_id], stage, why) for stage, why in failed])

    def add(self, task: str, stage: str, reason: str) -> None:
        """Append one failed trial of ``task`` (``stage`` "build" or "run")."""
        self._write([(task, stage, reason)])

    def _write(self, failed: list[tuple[str, str, str]]) -> None:
        lines = []
        for task, stage, reason in failed:
            reason = [ln for ln in reason.strip().splitlines() if ln.strip()] or [""]
            lines.append(json.dumps({"time": round(time.time(), 3), "task": task,
                                     "stage": stage, "reason": reason[-1][:500]}) + "\n")
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)
            self.count += len(lines)


def read_errors(log: "TuningLog") -> list[dict]:
    """The failed trials recorded in ``log`` (see :class:`TrialErrors`), oldest first."""
    path = os.path.join(log.path, ERRORS)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last line: the trial is still counted in the records
                continue
    return out


def pack(path: str) -> tuple[int, int]:
    """Compress the log folder ``path`` in place: its two files become ``<file>.xz`` (xz preset
    6) and the plain files are removed; the log is read-only from then on. Takes the log's
    lock (raises :class:`LogInUse` while a tuner appends). Returns (bytes before, bytes after).
    Raises ValueError when ``path`` holds no plain log."""
    log = TuningLog(path)
    if log.packed or not os.path.exists(log.record_path):
        raise ValueError(f"{path!r} holds no plain tuning log to pack (no {RECORDS})")
    before = after = 0
    with log.lock("packing"):
        for name in (WORKLOADS, RECORDS):
            plain = os.path.join(path, name)
            if not os.path.exists(plain):
                continue
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path)
            os.close(fd)
            with open(plain, "rb") as src, lzma.open(tmp, "wb", preset=6) as out:
                out.write(src.read())
            share_mode(tmp)
            os.replace(tmp, plain + PACKED)
            before += os.path.getsize(plain)
            after += os.path.getsize(plain + PACKED)
        for name in (WORKLOADS, RECORDS):
            if os.path.exists(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
    return before, after


def unpack(path: str) -> int:
    """Undo :func:`pack` in place (plain files back, ``.xz`` files removed), so that the log
    can be tuned into again. Returns the bytes of the plain files. Raises ValueError when
    ``path`` is not packed."""
    if not is_packed(path):
        raise ValueError(f"{path!r} is not a packed tuning log (no {RECORDS}{PACKED}, or a "
                         f"plain {RECORDS} beside it)")
    size = 0
    for name in (WORKLOADS, RECORDS):
        packed = os.path.join(path, name + PACKED)
        if not os.path.exists(packed):
            continue
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path)
        with lzma.open(packed, "rb") as src, os.fdopen(fd, "wb") as out:
            out.write(src.read())
        share_mode(tmp)
        os.replace(tmp, os.path.join(path, name))
        size += os.path.getsize(os.path.join(path, name))
    for name in (WORKLOADS, RECORDS):
        if os.path.exists(os.path.join(path, name + PACKED)):
            os.remove(os.path.join(path, name + PACKED))
    return size


# ---- reading, summarising and merging logs without changing them ------------------------------
@dataclass
class LogContents:
    """What :func:`read_log` found: ``workloads`` (one per good workload line: its JSON object
    and structural hash), ``records`` (workload position in ``workloads``, record body), and
    ``rejected`` ((file path, line number, reason) of lines that do not parse)."""

    path: str
    workloads: list[tuple[object, int]] = field(default_factory=list)
    records: list[tuple[int, list]] = field(default_factory=list)
    rejected: list[tuple[str, int, str]] = field(default_factory=list)


def read_log(path: str) -> LogContents:
    """Parse the tuning-log folder ``path`` without changing it (bad lines are listed in
    ``rejected`` with file and line). Raises ValueError when the folder holds no tuning log."""
    log = TuningLog(path)
    if not os.path.isdir(path) or not (os.path.exists(log.workload_path)
                                       or os.path.exists(log.record_path)):
        raise ValueError(f"{path!r} is not a tuning-log folder (no {WORKLOADS} or {RECORDS} "
                         "in it); give the folder that 'thomas-tune tune --log' wrote")
    out = LogContents(path)
    index: dict[int, int] = {}
    if os.path.exists(log.workload_path):
        with open(log.workload_path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    wl = ms.database.Workload.from_json(obj)
                    index[i] = len(out.workloads)
                    out.workloads.append((obj, int(tvm_ffi.structural_hash(wl.mod))))
                except Exception as err:
                    out.rejected.append((log.workload_path, i + 1, f"bad workload: {err}"))
    if os.path.exists(log.record_path):
        with open(log.record_path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    idx, body = json.loads(line)
                    if int(idx) not in index:
                        raise ValueError(f"workload #{idx} is missing or unreadable")
                    if not isinstance(body, list) or len(body) < 2:
                        raise ValueError("record body is not [trace, run_secs, ...]")
                    [float(s) for s in body[1]]
                    out.records.append((index[int(idx)], body))
                except Exception as err:
                    out.rejected.append((log.record_path, i + 1, f"bad record: {err}"))
    return out


def mean_seconds(body: list) -> float:
    """Mean run time (s) of a record body; ``inf`` for a failed trial."""
    return mean_run_seconds(body[1])


def mean_run_seconds(run_secs) -> float:
    """Mean of a record's run times (s); ``inf`` for a failed trial (none, or FAILED_RUN_S)."""
    secs = [float(s) for s in run_secs]
    if not secs or max(secs) >= FAILED_RUN_S:
        return math.inf
    return sum(secs) / len(secs)


def _workload_label(bodies: list[list]) -> str:
    # the blocks the first trace instruction names and the shapes of the arguments: enough to
    # tell workloads apart in a listing without building anything
    blocks, shapes = [], ""
    for body in bodies:
        text = json.dumps(body[0])
        blocks = re.findall(r'"GetSBlock", \[\], \["([^"]+)"', text)
        if len(body) > 3:
            shapes = " ".join("x".join(str(d) for d in a[2]) for a in body[3]
                              if isinstance(a, list) and len(a) > 2)
        if blocks:
            break
    names = [b for b in dict.fromkeys(blocks) if b != "root"]
    return f"{'+'.join(names[:3]) or '?'} [{shapes}]"


def summarize(contents: LogContents) -> list[dict]:
    """Per workload of a read log: ``{"workload": position, "label", "hash", "records",
    "failed", "best_ms", "target"}`` (best_ms None when no trial succeeded), in the order of
    the workload file."""
    rows = []
    for w, (_, h) in enumerate(contents.workloads):
        bodies = [b for i, b in contents.records if i == w]
        times = [mean_seconds(b) for b in bodies]
        ok = [t for t in times if t < math.inf]
        kinds = sorted({str(b[2].get("kind")) for b in bodies
                        if len(b) > 2 and isinstance(b[2], dict)})
        rows.append({"workload": w, "label": _workload_label(bodies), "hash": h,
                     "records": len(bodies), "failed": len(bodies) - len(ok),
                     "best_ms": min(ok) * 1e3 if ok else None, "target": ",".join(kinds)})
    return rows


@dataclass
class MergeReport:
    """Outcome of :func:`merge`: workloads and records written, duplicates dropped, and the
    lines of the sources that did not parse (file, line, reason; left where they were)."""

    workloads: int = 0
    records: int = 0
    duplicates: int = 0
    rejected: list[tuple[str, int, str]] = field(default_factory=list)


def merge(sources: list[str], dest: str) -> MergeReport:
    """Merge the tuning logs ``sources`` (folders) into the folder ``dest``.

    Workloads are unified by structural hash; every distinct record (same workload, trace,
    run times, target and arguments) is kept once, so merging is idempotent and the logs of
    several devices or runs keep all their measurements. ``dest`` may be one of the sources
    or an existing log (its records come first). Sources are not changed; their bad lines are
    reported in ``rejected``. ``dest`` is written atomically under its lock. Raises ValueError
    for a source that is not a tuning log and :class:`LogInUse` when ``dest`` is in use.
    """
    target = TuningLog(dest)
    paths = list(sources)
    if target.exists() and os.path.abspath(dest) not in {os.path.abspath(p) for p in paths}:
        paths.insert(0, dest)
    contents = [read_log(p) for p in paths]  # all sources readable before anything is written
    report = MergeReport()
    with target.lock("merging"):
        wl_lines: list[str] = []
        wl_pos: dict[int, int] = {}
        seen: set[tuple[int, str]] = set()
        rec_lines: list[str] = []
        for c in contents:
            report.rejected.extend(c.rejected)
            local = []
            for obj, h in c.workloads:
                if h not in wl_pos:
                    wl_pos[h] = len(wl_lines)
                    wl_lines.append(json.dumps(obj) + "\n")
                local.append(wl_pos[h])
            for w, body in c.records:
                key = (local[w], json.dumps(body, sort_keys=True))
                if key in seen:
                    report.duplicates += 1
                    continue
                seen.add(key)
                rec_lines.append(json.dumps([local[w], body]) + "\n")
        _rewrite(target.workload_path, wl_lines)
        _rewrite(target.record_path, rec_lines)
    report.workloads, report.records = len(wl_lines), len(rec_lines)
    return report
