"""A tuning-log folder: its files, the one-tuner lock, the check before use, and packing."""

from __future__ import annotations

import fcntl
import hashlib
import json
import lzma
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule

from ..files import replacing, write_atomically
from .codegen import LogVersion, mismatch, read_version, write_stamp
from .database import LogDatabase, json_line, mean_run_seconds

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
# records set aside when a log changes code generation (remeasure --restamp, log carry), one JSON
# object per line: the reason and the record's line
STALE = RECORDS + ".stale"
LOCK = ".lock"
PACKED = ".xz"  # suffix of a packed log's files (xz, Python's lzma)
ERRORS = "trial_errors.jsonl"
# the structural hashes of the log's measured schedules, kept to skip replays on a resumed run
HASHES = "schedule_hashes.json"


def set_aside(path: str, lines: list[str], drop, reason: str) -> int:
    """Move the record lines ``drop`` (indices from 0 into ``lines``, the record file of the
    unpacked log folder ``path`` in order, newlines kept) to :data:`STALE`, each with
    ``reason`` (appended and on disk before the record file changes), and rewrite the record
    file with the other lines in their order. Returns how many moved."""
    drop = set(drop)
    if drop:
        with open(os.path.join(path, STALE), "a") as f:
            for i in sorted(drop):
                f.write(json.dumps({"reason": reason, "text": lines[i].rstrip("\n")}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    write_atomically(os.path.join(path, RECORDS),
                     [line for i, line in enumerate(lines) if i not in drop])
    return len(drop)


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


@dataclass
class LogLines:
    """The lines of a log's two files, parsed (:func:`parse_lines`); line numbers count from 0.
    ``workloads``: (line number, text ending in a newline, JSON object, MetaSchedule
    ``Workload``) of each good workload line; ``records``: (line number, position of its
    workload in ``workloads``, record body ``[trace, run_secs, ...]``) of each good record
    line; ``bad_workloads`` / ``bad_records``: (line number, text, reason) of the others."""

    workloads: list[tuple[int, str, object, object]] = field(default_factory=list)
    records: list[tuple[int, int, list]] = field(default_factory=list)
    bad_workloads: list[tuple[int, str, str]] = field(default_factory=list)
    bad_records: list[tuple[int, str, str]] = field(default_factory=list)


def parse_lines(workload_path: str, record_path: str) -> LogLines:
    """Parse a log's workload file and record file (either may be missing), the one reader of
    their lines. A workload line is good when MetaSchedule builds a ``Workload`` from it; a
    record line when it is ``[workload index, [trace, run_secs, ...]]`` with every run time a
    number and its workload one of the good ones. Blank lines are skipped."""
    out = LogLines()
    position: dict[int, int] = {}  # workload line -> position among the good ones
    if os.path.exists(workload_path):
        with open(workload_path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    wl = ms.database.Workload.from_json(obj)
                    position[i] = len(out.workloads)
                    out.workloads.append((i, line if line.endswith("\n") else line + "\n",
                                          obj, wl))
                except Exception as err:  # JSON or TVM parse error: reject, keep the text
                    out.bad_workloads.append((i, line, f"bad workload: {err}"))
    if os.path.exists(record_path):
        with open(record_path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    idx, body = json.loads(line)
                    if int(idx) not in position:
                        raise ValueError(f"workload #{idx} is missing or was rejected")
                    if not isinstance(body, list) or len(body) < 2:
                        raise ValueError("record body is not [trace, run_secs, ...]")
                    [float(s) for s in body[1]]
                    out.records.append((i, position[int(idx)], body))
                except Exception as err:
                    out.bad_records.append((i, line, f"bad record: {err}"))
    return out


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
    from ..opencl import cache_dir  # the project's cache folder (THOMAS_TUNE_CACHE)
    dest = os.path.join(cache_dir(), "logs", h.hexdigest()[:24])
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

    def has_records(self) -> bool:
        """Whether the record file holds a line (of any kind)."""
        if not os.path.exists(self.record_path):
            return False
        with open(self.record_path) as f:
            return any(line.strip() for line in f)

    def version(self) -> LogVersion:
        """The code-generation version of this log's times (:mod:`.codegen`)."""
        return read_version(self.path)

    def require_version(self, action: str) -> LogVersion:
        """This log's version, when its records may be trusted for ``action`` (words after
        "used to", e.g. "tune into it"): it has no records, or it is stamped with this
        installation's version. Raises :class:`.codegen.CodegenMismatch` naming the fixes
        otherwise; changes nothing."""
        version = self.version()
        if version.status != "current" and self.has_records():
            raise mismatch(self.path, version, action)
        return version

    def claim_version(self, action: str, how: str) -> None:
        """Before measuring into this log: :meth:`require_version`, then stamp the log with
        this installation's version where it has no stamp of it (a log with no records);
        ``how`` names what measures (kept in the stamp)."""
        if self.require_version(action).status != "current":
            write_stamp(self.path, how)

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
        lines = parse_lines(self.workload_path, self.record_path)
        bad_workloads, bad_records = lines.bad_workloads, lines.bad_records
        good_workloads = [text for _, text, _, _ in lines.workloads]
        # records renumbered to their workload's position among the good workloads
        good_records = [json.dumps([w, body]) + "\n" for _, w, body in lines.records]
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
            write_atomically(self.workload_path, good_workloads)
        if bad_workloads or bad_records:
            write_atomically(self.record_path, good_records)

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
            key = hashlib.sha1(json_line(body[0]).encode()).hexdigest()[:20]
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
            write_atomically(self.hash_path, json.dumps({"stamp": _hash_stamp(),
                                                         "hashes": self._hash_cache}))
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
            with (replacing(plain + PACKED) as tmp, open(plain, "rb") as src,
                  lzma.open(tmp, "wb", preset=6) as out):
                out.write(src.read())
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
        with (replacing(os.path.join(path, name)) as tmp, lzma.open(packed, "rb") as src,
              open(tmp, "wb") as out):
            out.write(src.read())
        size += os.path.getsize(os.path.join(path, name))
    for name in (WORKLOADS, RECORDS):
        if os.path.exists(os.path.join(path, name + PACKED)):
            os.remove(os.path.join(path, name + PACKED))
    return size
