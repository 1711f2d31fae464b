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
:data:`KEEP_BUILDERS` builders and :data:`KEEP_LANES` lane processes per key wait here; the
rest are shut down, as all of them are when the process exits.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading

#: idle builders kept per key (one run uses one builder at a time)
KEEP_BUILDERS = 1
#: idle lane processes kept per key (one per device server of a run)
KEEP_LANES = 4

#: environment variables no worker reads that change while a process runs: pytest's name of
#: the running test (set anew at each test)
UNREAD = frozenset({"PYTEST_CURRENT_TEST"})

_LOCK = threading.Lock()
_BUILDERS: dict[tuple, list] = {}
_LANES: dict[tuple, list] = {}


def _key(*settings) -> tuple:
    """What a worker's results depend on beyond its inputs: ``settings``, the working
    directory and the process environment (a digest of it; all of it but :data:`UNREAD`)."""
    env = hashlib.sha256(repr(sorted((k, v) for k, v in os.environ.items()
                                     if k not in UNREAD)).encode()).hexdigest()
    return (*settings, os.getcwd(), env)


def take_builder(max_workers: int, timeout_s: float, phases=None):
    """A :class:`.builder.Builder` of ``max_workers`` processes and a ``timeout_s`` build
    limit whose times go to ``phases`` (a :class:`.phases.Phases`; None: a new one): a kept
    one of this environment if there is one (its processes already started), else a new one.
    Hand it back with :func:`keep_builder`."""
    from .builder import Builder
    from .phases import Phases
    phases = phases if phases is not None else Phases()
    key = _key(max_workers, float(timeout_s))
    with _LOCK:
        idle = _BUILDERS.get(key)
        builder = idle.pop() if idle else None
    if builder is None:
        builder = Builder(max_workers=max_workers, timeout_s=timeout_s, phases=phases)
        builder.kept_key = key
    else:
        builder.phases = phases
    return builder


def keep_builder(builder) -> None:
    """Keep ``builder`` (made by :func:`take_builder`) for the next run of this process, or
    shut it down when :data:`KEEP_BUILDERS` of its key already wait (or the environment it
    was made in has changed since)."""
    key = getattr(builder, "kept_key", None)
    if key is None:  # not made by take_builder
        builder.shutdown()
        return
    with _LOCK:
        idle = _BUILDERS.setdefault(key, [])
        if key == _key(*key[:2]) and len(idle) < KEEP_BUILDERS:
            idle.append(builder)
            return
    builder.shutdown()


def take_lane_worker():
    """A lane's worker process (``tvm.support.popen_pool.PopenWorker``) with no session: a
    kept one of this environment if there is one, else a new one (started at its first call).
    Returns ``(worker, key)``; hand it back with :func:`keep_lane_worker`."""
    from tvm.support.popen_pool import PopenWorker
    key = _key("lane")
    with _LOCK:
        idle = _LANES.get(key)
        worker = idle.pop() if idle else None
    return (worker if worker is not None else PopenWorker()), key


def keep_lane_worker(worker, key: tuple) -> None:
    """Keep a lane's worker whose session was closed in it (:func:`.lane.lane_close`) for the
    next run, or kill it when :data:`KEEP_LANES` of its key already wait."""
    with _LOCK:
        idle = _LANES.setdefault(key, [])
        if key == _key("lane") and len(idle) < KEEP_LANES:
            idle.append(worker)
            return
    worker.kill()


@atexit.register
def _shut_down_kept() -> None:
    """End every kept worker when the process exits."""
    with _LOCK:
        builders = [b for idle in _BUILDERS.values() for b in idle]
        lanes = [w for idle in _LANES.values() for w in idle]
        _BUILDERS.clear()
        _LANES.clear()
    for b in builders:
        b.shutdown()
    for w in lanes:
        w.kill()
