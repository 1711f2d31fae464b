"""Worker processes kept for the next tuning run of the same process.

Every worker process of the tuner (a build process of :class:`.builder.Builder`, a measuring
lane's process of :class:`.runner.FarmRunner`) starts by importing TVM: 1.4-1.7 s of CPU each.
A process that tunes several times (the default-schedule times, the search, ``remeasure``; a
test session, which tunes dozens of times per process) would pay that once per run and per
worker. Instead, a run that ends hands its workers back here (:func:`keep_builder`,
:func:`keep_lane_worker`) and the next run of the same process takes them
(:func:`take_builder`, :func:`take_lane_worker`).

What a worker computes depends on its process environment (``TVM_NDK_CC`` picks the cross
compiler of a build, ``PYTHONPATH`` the modules it imports), its working directory and its
settings (a builder's process count and build time limit), all fixed when it starts: a kept
worker is handed out only to a run whose environment, directory and settings are those it
started with (:func:`_key`; pytest's name of the running test, :data:`UNREAD`, aside); any
other run starts its own. A lane's worker is kept only after
its session was closed in it (the server freed, nothing of the session left,
:func:`.lane.lane_close`); a worker that failed, timed out or was killed is never kept. At most
:data:`KEEP_BUILDERS` builders and :data:`KEEP_LANES` lane processes wait here, whatever their
keys (a process whose environment changes from run to run leaves no more): beyond that the one
kept longest is shut down, as all of them are when the process exits.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading

#: idle builders kept, all keys together (a run uses one or two at a time, of two settings)
KEEP_BUILDERS = 4
#: idle lane processes kept, all keys together (one per device server of a run)
KEEP_LANES = 4

#: environment variables no worker reads that change while a process runs: pytest's name of
#: the running test (set anew at each test)
UNREAD = frozenset({"PYTEST_CURRENT_TEST"})

_LOCK = threading.Lock()
_BUILDERS: list[tuple[tuple, object]] = []  # (key, builder), the one kept longest first
_LANES: list[tuple[tuple, object]] = []  # (key, PopenWorker), likewise


def _key(*settings) -> tuple:
    """What a worker's results depend on beyond its inputs: ``settings``, the working
    directory and the process environment (a digest of it; all of it but :data:`UNREAD`)."""
    env = hashlib.sha256(repr(sorted((k, v) for k, v in os.environ.items()
                                     if k not in UNREAD)).encode()).hexdigest()
    return (*settings, os.getcwd(), env)


def _take(kept: list, key: tuple):
    """The worker of ``key`` kept last in ``kept``, removed from it; None if there is none."""
    with _LOCK:
        for i in range(len(kept) - 1, -1, -1):
            if kept[i][0] == key:
                return kept.pop(i)[1]
    return None


def _keep(kept: list, key: tuple, worker, limit: int, end) -> None:
    """Keep ``worker`` of ``key`` in ``kept`` if this process's environment is still the one
    of ``key``, ending the one kept longest beyond ``limit`` (``end(worker)`` ends one)."""
    if key is None or key != _key(*key[:-2]):
        end(worker)  # not made by take_*, or made in another environment than this one
        return
    with _LOCK:
        kept.append((key, worker))
        out = kept.pop(0)[1] if len(kept) > limit else None
    if out is not None:
        end(out)


def take_builder(max_workers: int, timeout_s: float, phases=None):
    """A :class:`.builder.Builder` of ``max_workers`` processes and a ``timeout_s`` build
    limit whose times go to ``phases`` (a :class:`.phases.Phases`; None: a new one): a kept
    one of this environment if there is one (its processes already started), else a new one.
    Hand it back with :func:`keep_builder`."""
    from .builder import Builder
    from .phases import Phases
    phases = phases if phases is not None else Phases()
    key = _key(max_workers, float(timeout_s))
    builder = _take(_BUILDERS, key)
    if builder is None:
        builder = Builder(max_workers=max_workers, timeout_s=timeout_s, phases=phases)
        builder.kept_key = key
    else:
        builder.phases = phases
    return builder


def keep_builder(builder) -> None:
    """Keep ``builder`` (made by :func:`take_builder`) for the next run of this process; shut
    it down when the environment it was made in has changed since (or it was not made by
    :func:`take_builder`), or the one kept longest when :data:`KEEP_BUILDERS` wait."""
    _keep(_BUILDERS, getattr(builder, "kept_key", None), builder, KEEP_BUILDERS,
          lambda b: b.shutdown())


def take_lane_worker():
    """A lane's worker process (``tvm.support.popen_pool.PopenWorker``) with no session: a
    kept one of this environment if there is one, else a new one (started at its first call).
    Returns ``(worker, key)``; hand it back with :func:`keep_lane_worker`."""
    from tvm.support.popen_pool import PopenWorker
    key = _key("lane")
    worker = _take(_LANES, key)
    return (worker if worker is not None else PopenWorker()), key


def keep_lane_worker(worker, key: tuple) -> None:
    """Keep a lane's worker whose session was closed in it (:func:`.lane.lane_close`) for the
    next run (as :func:`keep_builder` keeps a builder; :data:`KEEP_LANES` at most)."""
    _keep(_LANES, key, worker, KEEP_LANES, lambda w: w.kill())


@atexit.register
def _shut_down_kept() -> None:
    """End every kept worker when the process exits."""
    with _LOCK:
        builders = [b for _, b in _BUILDERS]
        lanes = [w for _, w in _LANES]
        _BUILDERS.clear()
        _LANES.clear()
    for b in builders:
        b.shutdown()
    for w in lanes:
        w.kill()
