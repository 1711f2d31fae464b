"""Tuning: MetaSchedule over an RPC tracker, with the XGBoost cost model and evolutionary search.

Each task's candidates are built locally (:class:`thomas_tune.measure.builder.Builder`) and
measured on the device servers that the tracker hands out for the device key
(:class:`thomas_tune.measure.runner.FarmRunner`). Records go to the tuning log as they arrive
(one line per trial, see :mod:`thomas_tune.logs`). A run on an existing log resumes:
MetaSchedule's evolutionary search only de-duplicates within one run, so
:class:`.search.ResumingSearch` drops every candidate whose schedule is already in the log before
it is built, and the new run measures only new ones.

Modules: :mod:`.driver` (:func:`tune` and its :class:`TuneOptions`), :mod:`.search` (the search
strategy and its view of the database), :mod:`.task_scheduler` (which task gets the next batch),
:mod:`.refine` (refinement passes), :mod:`.defaults` (default-schedule timing and selection by
time), :mod:`.report` (the run's report), :mod:`.pretrained` (the cost model trained on tuning
logs, saved and loaded), :mod:`.local_search` (schedules one decision from the best records),
:mod:`.remeasure` (a log's best records measured again on the device, their times kept).
"""

from .defaults import (DEFAULT_LATENCY, default_schedule_key, defaults_stamp, kernel_time_s,
                       measure_defaults, measure_kernels, read_default_times, select_by_time)
from .driver import TuneOptions, note_signals, rpc_runner, tune
from .report import TuneReport
from .search import OnceSpaces, ResumingSearch, UnrollLimitedView, cost_model, search_context

__all__ = [
    "DEFAULT_LATENCY", "OnceSpaces", "ResumingSearch", "TuneOptions", "TuneReport",
    "UnrollLimitedView", "cost_model", "default_schedule_key", "defaults_stamp", "kernel_time_s",
    "measure_defaults", "measure_kernels", "note_signals", "read_default_times", "rpc_runner",
    "search_context", "select_by_time", "tune",
]
