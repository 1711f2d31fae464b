"""Device-side order: compiles at low CPU priority and a lock that gives one timed run the device.

Device servers started by thomas_tune (``thomas-tune rpc server``) register
``thomas_tune.device_lock``: timed runs of several servers on one device take turns, so
parallel servers keep timings clean while uploads, loads and the OpenCL compiles of the
candidates (``thomas_tune.opencl.build_programs_low_priority``, before the lock) overlap.
Compiles and builds run at niceness +:data:`COMPILE_NICE`, so they leave the CPU to the timed
run (a small kernel's time is its host thread's launches).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading


# Niceness (added to the caller's) of the CPU work that competes with timed runs on a tuning
# machine: the build processes of :class:`Builder` and the servers' OpenCL program builds.
# A timed run of a small kernel is bound by its host thread's launches: on the H100, with 12
# servers compiling and 8 build processes on 16 cores at normal priority, 169 of 506 default
# kernels of MobileNetV2's step were timed at more than 2x (up to 15x) their time in a step;
# with compiles and builds at +10, 4 were (up to 3.6x).
COMPILE_NICE = 10


def lower_priority(nice: int = COMPILE_NICE) -> None:
    """Add ``nice`` to the niceness of the calling thread (Linux; the calling process
    elsewhere) and so of the threads it starts. Raising niceness needs no privilege. Used as
    the build processes' initializer."""
    who = threading.get_native_id() if sys.platform.startswith("linux") else 0
    try:
        os.setpriority(os.PRIO_PROCESS, who, os.getpriority(os.PRIO_PROCESS, who) + nice)
    except (AttributeError, OSError):  # a platform without setpriority: normal priority
        pass


def on_low_priority_thread(fn, *args):
    """``fn(*args)`` run on a new thread of niceness +:data:`COMPILE_NICE` (:func:`lower_priority`),
    waited for; returns what it returns and raises what it raises."""
    out: list = []

    def run():
        lower_priority()
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            out.append((False, e))

    worker = threading.Thread(target=run, name="low-priority", daemon=True)
    worker.start()
    worker.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def register_low_priority_build() -> None:
    """Register ``thomas_tune.opencl.build_programs_low_priority(mod, device_id)`` in this
    (device server) process: ``thomas_tune.opencl.build_programs`` (the driver's build of the
    OpenCL programs of ``mod``; returns the number built) run on a thread of niceness
    +:data:`COMPILE_NICE`, so that a build in one server's session leaves the CPU to another
    server's timed run. Raises what the build raises."""
    import tvm

    build = tvm.get_global_func("thomas_tune.opencl.build_programs", allow_missing=True)
    if build is None:  # no OpenCL runtime in this server
        return

    def build_low_priority(mod, device_id: int) -> int:
        return on_low_priority_thread(build, mod, device_id)

    tvm.register_global_func("thomas_tune.opencl.build_programs_low_priority",
                             build_low_priority, override=True)


def device_lock_path() -> str:
    """The default device lock of :func:`register_device_lock`: one file per user in the temp
    folder."""
    return os.path.join(tempfile.gettempdir(), f"thomas-tune-device-{os.getuid()}.lock")


def register_device_lock(path: str | None = None) -> str:
    """Register ``thomas_tune.device_lock(on)`` in this (device server) process.

    ``on=1`` waits for an exclusive lock on ``path`` (default: one file per user in the temp
    folder), ``on=0`` releases it: device servers of one machine that share a device take turns
    for their timed runs. The lock is an advisory ``flock`` (released if the process dies).
    Returns the lock file's path.
    """
    import fcntl

    import tvm

    path = path or device_lock_path()
    held: dict[str, int] = {}

    def device_lock(on: int) -> int:
        if on and "fd" not in held:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held["fd"] = fd
        elif not on and "fd" in held:
            fd = held.pop("fd")
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return 0

    tvm.register_global_func("thomas_tune.device_lock", device_lock, override=True)
    return path
