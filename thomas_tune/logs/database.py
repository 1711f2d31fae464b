"""MetaSchedule's view of a tuning log: a database that builds each record when it hands it out."""

from __future__ import annotations

import bisect
import json
import math
import os
import threading

import tvm_ffi
from tvm.s_tir.meta_schedule import _ffi_api as ms_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule


# MetaSchedule records a trial without a run time (failed build or run) with this many seconds
FAILED_RUN_S = 1e9


def json_line(obj) -> str:
    """One line of JSON of a workload's, trace's or record's ``as_json()`` form."""
    # imported here, not with the module: the schedules import dlight, which needs TVM's
    # compiler, and processes with the runtime alone import this module (through the CLI)
    from ..schedules import json_default
    return json.dumps(obj, default=json_default, separators=(",", ":"))


def trace_json(record) -> str:
    """A tuning record's trace as one line of JSON, as the record's line in a tuning log
    holds it (``json_line`` of the line's parsed trace gives the same text)."""
    return json_line(ms_ffi.TuningRecordAsJSON(record)[0])


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

    def find_workload(self, mod):
        """The workload of this database whose kernel is ``mod`` (structurally equal), or
        None; unlike :meth:`commit_workload` it never adds one."""
        with self.lock:
            idx = self._index(mod)
            return None if idx is None else self.workloads[idx]

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

    def times_in_order(self, mod) -> list[float]:
        """Mean run time (s) of each record of the workload ``mod``, in the order the records
        were measured (file order; a failed trial as ``inf``); empty for a workload not in the
        database."""
        with self.lock:
            idx = self._index(mod)
            rows = [] if idx is None else sorted(self.entries[idx], key=lambda e: e.seq)
            return [e.mean if e.valid and e.mean < FAILED_RUN_S else math.inf for e in rows]

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
                f.write(json_line(workload.as_json()) + "\n")
            self._add_workload(workload)
            return workload

    def commit_tuning_record(self, record) -> None:
        with self.lock:
            idx = self._index_of(record.workload)
            if idx is None:
                idx = self._index_of(self.commit_workload(record.workload.mod))
            # (TuningRecord.as_json() stops on a trace holding an IndexMap, the layout of a
            # transform_layout: the record's FFI form goes to json_default as it is)
            line = json_line([idx, ms_ffi.TuningRecordAsJSON(record)]) + "\n"
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


def mean_seconds(body: list) -> float:
    """Mean run time (s) of a record body; ``inf`` for a failed trial."""
    return mean_run_seconds(body[1])


def mean_run_seconds(run_secs) -> float:
    """Mean of a record's run times (s); ``inf`` for a failed trial (none, or FAILED_RUN_S)."""
    secs = [float(s) for s in run_secs]
    if not secs or max(secs) >= FAILED_RUN_S:
        return math.inf
    return sum(secs) / len(secs)
