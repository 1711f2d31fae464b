"""The tuning log: MetaSchedule's JSON database on disk, checked before use.

A tuning log is a folder (by convention ``tuning_logs/<device>/<model>/``) with MetaSchedule's two
files: ``database_workload.json`` (one workload per line) and ``database_tuning_record.json``
(one tuning record per line: workload index, trace, run times, target, argument info).
MetaSchedule appends one line per measured trial and closes the file after each, so a killed run
loses at most the record in flight.

MetaSchedule reads the files through :class:`.database.LogDatabase`, which builds a record only
when it hands it out. Before it does, :meth:`TuningLog.check` parses every line. A line that does
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

Every log folder is stamped with the code-generation version its times belong to
(``codegen.json``, :mod:`.codegen`): a log of another or an unknown version is not tuned into,
re-measured in part or exported from until its records are measured again.

Modules: :mod:`.codegen` (the version stamp), :mod:`.carry` (a log carried over to a new
version whose kernels are the same), :mod:`.tuning_log` (the folder, its lock, its
check, packing), :mod:`.database` (MetaSchedule's view of it), :mod:`.errors` (failed trials),
:mod:`.reading` (show, summarize, merge).
"""

from .codegen import STAMP, CodegenMismatch, LogVersion, read_version, write_stamp
from .database import (FAILED_RUN_S, LogDatabase, json_line, mean_run_seconds, mean_seconds,
                       trace_json)
from .errors import TrialErrors, read_errors
from ..files import write_atomically as rewrite_atomically
from .reading import LogContents, MergeReport, merge, read_log, summarize
from .tuning_log import (ERRORS, HASHES, LOCK, PACKED, RECORDS, STALE, WORKLOADS, CheckReport,
                         LogInUse, LogLock, TuningLog, is_packed, pack, set_aside, unpack)

__all__ = [
    "ERRORS", "FAILED_RUN_S", "HASHES", "LOCK", "PACKED", "RECORDS", "STALE", "STAMP", "WORKLOADS",
    "CheckReport", "CodegenMismatch", "LogContents", "LogDatabase", "LogInUse", "LogLock",
    "LogVersion", "MergeReport", "TrialErrors", "TuningLog", "is_packed", "json_line",
    "mean_run_seconds", "mean_seconds", "merge", "pack", "read_errors", "read_log",
    "read_version", "rewrite_atomically", "set_aside", "summarize", "trace_json", "unpack",
    "write_stamp",
]
