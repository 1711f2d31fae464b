"""TVM RPC tracker and device-server launchers (TVM's own ``tvm.rpc`` tracker and servers).

A device server registers with the tracker under a *device key* (e.g. ``pocl-cpu``, ``h100``,
``galaxy-s8``); the tuner asks the tracker for a server of that key for each measurement. A
phone runs TVM's C++ server ``tvm_rpc``, registered with the same tracker over ``adb reverse``
(``rpc/android_server.sh``, docs/android.md). Every session is asked for a lifetime in whole
seconds (:func:`request_session`). Everything binds to 127.0.0.1 unless told otherwise.

TVM RPC has no authentication and no encryption: whoever reaches a device server's port can
upload and run code on that device, and whoever reaches the tracker can take its servers.
Binding to another address prints a warning (:func:`exposure_warning`); do it only on a network
you trust (a USB tether, a lab Wi-Fi behind a firewall), or tunnel the ports over SSH.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time

from tvm import rpc
from tvm.rpc import tracker as rpc_tracker

# The session lifetime (s) asked of a device server when none is given: long enough for a
# first training step that builds every OpenCL program (20-42 s measured on the H100), short
# enough that a session orphaned by a lost client frees its server within the quarter hour.
DEFAULT_SESSION_TIMEOUT_S = 900


def whole_seconds(seconds, what: str = "session timeout") -> int:
    """``seconds`` (s, > 0) rounded up to whole seconds, as every TVM RPC server can parse it.

    A client asks for a session lifetime by appending ``-timeout=N`` to its key
    (``python/tvm/rpc/client.py``: ``key += f" -timeout={session_timeout}"``). TVM's C++ server
    ``tvm_rpc`` (``apps/cpp_rpc/rpc_server.cc``, ``GetTimeOutFromOpts``) accepts only digits
    (``support::IsNumber``, then ``std::stoi``); for anything else, such as ``900.0``, it throws
    outside the ``try`` of its listening loop and the whole server process ends. TVM's Java
    server (TVM's Android app, ``jvm/core/.../rpc/ConnectTrackerServerProcessor.java``) parses
    it with ``Integer.parseInt``. A timeout of 0 sends no option at all (the client skips a
    falsy timeout): ``tvm_rpc`` then sets no bound (a session whose client is lost holds the
    device until the server restarts), the Java server its ``HARD_TIMEOUT_DEFAULT`` of 300 s;
    0 is refused here, so that every session has a bound the caller stated. At the bound
    ``tvm_rpc`` ends the session's process with SIGTERM (docs/android.md, "Sessions and their
    bound").
    Raises ValueError naming ``what`` for a value that is not a finite number > 0."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {seconds!r}: expected a number of seconds > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} {seconds!r}: expected a finite number of seconds > 0 (a "
                         "server may replace 0, 'no bound', with a hard timeout of its own)")
    return int(math.ceil(value))


def request_session(tracker: tuple[str, int], key: str,
                    session_timeout_s=DEFAULT_SESSION_TIMEOUT_S, priority: int = 1,
                    max_retry: int = 5):
    """A ``tvm.rpc`` session on a server of ``key`` handed out by ``tracker``, asked to last at
    most ``session_timeout_s`` seconds (sent in whole seconds, :func:`whole_seconds`): the
    server ends the session (and everything it holds on the device) at that age.
    Raises ValueError for a bad timeout, RuntimeError (TVM's) when no server can be had."""
    timeout = whole_seconds(session_timeout_s)
    return rpc.connect_tracker(*tracker).request(key, priority=priority,
                                                 session_timeout=timeout, max_retry=max_retry)


def parse_address(text: str, default_port: int = 9190) -> tuple[str, int]:
    """``HOST:PORT`` (or ``HOST``) -> (host, port); ValueError for anything else."""
    host, _, port = text.rpartition(":") if ":" in text else (text, "", str(default_port))
    try:
        return host or "127.0.0.1", int(port)
    except ValueError as err:
        raise ValueError(f"tracker address {text!r}: expected HOST:PORT, "
                         "e.g. 127.0.0.1:9190") from err


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) only ever means this machine."""
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, what: str) -> str | None:
    """The warning for binding ``what`` (e.g. "device server") to ``host``; None on loopback."""
    if is_loopback(host):
        return None
    where = "every network interface" if host in ("", "0.0.0.0", "::") else host
    return (f"warning: the {what} listens on {where}. TVM RPC has no authentication: anyone who "
            "can reach this port can run code on the device. Use it only on a network you "
            "trust, or keep --host 127.0.0.1 and tunnel the port (ssh -L)")


def _warn_exposed(host: str, what: str) -> None:
    msg = exposure_warning(host, what)
    if msg:
        print(msg, file=sys.stderr, flush=True)


def start_tracker(host: str = "127.0.0.1", port: int = 9190, port_end: int | None = None):
    """Start TVM's tracker in a child process on the first free port in [port, port_end)
    (default: the next 100); returns it (``.host``, ``.port``, ``.terminate()``). Warns on
    stderr when ``host`` is not a loopback address."""
    _warn_exposed(host, "RPC tracker")
    return rpc_tracker.Tracker(host, port=port, port_end=port_end or port + 100, silent=True)


def quiet(tracker) -> None:
    """Make ``tracker`` (:func:`start_tracker`'s) log errors only, in its own process (Python's
    ``logging.disable`` of warnings there: the process runs the tracker alone): for a tracker
    whose servers this process starts and stops (:func:`loopback`), whose connections dropped
    at their stop TVM's tracker would report as warnings."""
    import logging
    tracker.proc.send(logging.disable, [logging.WARNING])
    tracker.proc.recv()


def keep_serving_after_crashes() -> None:
    """Make this process's TVM RPC server survive a session process that crashes.

    TVM's server runs each session in a child process and raises when that child exits
    abnormally (a kernel that segfaults or aborts), which ends its listening loop: the server is
    gone for good. Wrapped here, such a session costs only itself (its client sees the
    connection drop) and the server goes back to listening."""
    from tvm.rpc import server as tvm_server

    if getattr(tvm_server._serving, "_thomas_tune", False):
        return
    original = tvm_server._serving

    def serving(sock, addr, opts, load_library):
        cwd = os.getcwd()
        try:
            original(sock, addr, opts, load_library)
        except RuntimeError as err:
            print(f"device server: a session ended abnormally ({err}); still serving",
                  file=sys.stderr, flush=True)
            os.chdir(cwd)
            with contextlib.suppress(OSError):
                sock.close()

    serving._thomas_tune = True
    tvm_server._serving = serving
    tvm_server._serve_loop = _ending_with_client(tvm_server._serve_loop)


def _ending_with_client(serve_loop):
    """Wrap TVM's session loop (it runs in the session's own process) so that the process
    ends as soon as its client is gone.

    A tuner cuts a trial that does not return by closing its connection; without this the
    session process would run the hung kernel (and hold the device lock that servers of one
    device share) until the session timeout, minutes later, keeping the server from taking
    the next trial."""

    def loop(sock, load_library, work_path):
        import select

        if not hasattr(select, "POLLRDHUP"):  # not Linux: the session timeout ends it
            return serve_loop(sock, load_library, work_path)

        def watch():
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            while True:
                for _, event in poller.poll(500):
                    if event & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                        os._exit(0)  # the client closed the session: nothing left to serve

        threading.Thread(target=watch, daemon=True).start()
        serve_loop(sock, load_library, work_path)

    return loop


DEVICE_INFO_FUNC = "thomas_tune.opencl.device_info"


def opencl_device_info(name: str) -> dict:
    """What the OpenCL driver says of the device called ``name`` (``CL_DEVICE_NAME``, as TVM's
    ``dev.device_name`` gives it), queried with pyopencl: platform, vendor, versions,
    ``max_work_group_size``, ``local_mem_size`` (bytes) and ``local_mem_type`` (``local``:
    on-chip; ``global``: emulated in main memory), ``compute_units``, ``clock_mhz``,
    ``preferred_work_group_size_multiple`` (the driver's hint for one trivial kernel: the
    SIMD / wave width on GPUs), ``max_num_sub_groups`` and ``sub_group_sizes`` where the driver
    reports them (OpenCL 2.1 / ``cl_intel_required_subgroup_size``), the sub-group
    extensions it lists, ``extensions`` (the whole list, space-separated), ``profile``,
    ``opencl_c_version``, ``global_mem_size`` and ``max_mem_alloc_size`` (bytes). Fields the
    driver does not answer are absent. Raises LookupError when no OpenCL device has that name,
    ImportError without pyopencl."""
    import pyopencl as cl

    found = [(p, d) for p in cl.get_platforms() for d in p.get_devices() if d.name == name]
    if not found:
        raise LookupError(f"no OpenCL device named {name!r}")
    platform, dev = found[0]
    info = {"platform": platform.name, "name": dev.name, "vendor": dev.vendor,
            "version": dev.version, "driver_version": dev.driver_version}
    fields = {"max_work_group_size": "max_work_group_size", "local_mem_size": "local_mem_size",
              "compute_units": "max_compute_units", "clock_mhz": "max_clock_frequency",
              "max_work_item_sizes": "max_work_item_sizes",
              "max_num_sub_groups": "max_num_sub_groups",
              "sub_group_sizes": "sub_group_sizes_intel", "global_mem_size": "global_mem_size",
              "max_mem_alloc_size": "max_mem_alloc_size"}
    for key, attr in fields.items():
        with contextlib.suppress(Exception):  # not every driver answers every query
            value = getattr(dev, attr)
            info[key] = [int(v) for v in value] if isinstance(value, (list, tuple)) else int(value)
    with contextlib.suppress(Exception):
        info["local_mem_type"] = {cl.device_local_mem_type.LOCAL: "local",
                                  cl.device_local_mem_type.GLOBAL: "global"}.get(
                                      dev.local_mem_type, str(dev.local_mem_type))
    for key in ("extensions", "profile", "opencl_c_version"):
        with contextlib.suppress(Exception):
            info[key] = " ".join(str(getattr(dev, key)).split())
    info["sub_group_extensions"] = sorted(e for e in dev.extensions.split()
                                          if "subgroup" in e or "sub_group" in e)
    with contextlib.suppress(Exception):
        ctx = cl.Context([dev])
        kernel = cl.Program(ctx, "__kernel void k(__global float* a) "
                                 "{ a[get_global_id(0)] += 1.0f; }").build().k
        info["preferred_work_group_size_multiple"] = int(kernel.get_work_group_info(
            cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, dev))
    return info


def register_device_info() -> None:
    """Register :data:`DEVICE_INFO_FUNC` in this process: (device name) -> JSON of
    :func:`opencl_device_info`, or ``{"error": ...}`` when it cannot answer (no pyopencl, no
    such device). A client reaches it over RPC (``sess.get_function``); servers without it
    (TVM's own ``tvm_rpc``) still give TVM's device attributes."""
    import tvm

    def device_info(name: str) -> str:
        try:
            return json.dumps(opencl_device_info(str(name)))
        except Exception as err:  # pyopencl missing, or a driver that refuses a query
            return json.dumps({"error": f"{type(err).__name__}: {err}"})

    tvm.register_global_func(DEVICE_INFO_FUNC, device_info, override=True)


def _init_device_server():
    # Runs inside the server process: importing thomas_tune registers its runtime extensions;
    # the device lock lets servers sharing a device take turns for timed runs.
    import thomas_tune  # noqa: F401
    from thomas_tune.measure.priority import register_device_lock, register_low_priority_build
    register_device_lock()
    register_low_priority_build()
    register_device_info()
    keep_serving_after_crashes()


def start_server(tracker: tuple[str, int], key: str, host: str = "127.0.0.1",
                 port: int = 9090, port_end: int | None = None):
    """Start one TVM RPC device server registered with ``tracker`` under ``key`` (in a child
    process: ``.port``, ``.terminate()``). Warns on stderr when ``host`` is not loopback."""
    _warn_exposed(host, "device server")
    return rpc.Server(host, port=port, port_end=port_end or port + 100, tracker_addr=tracker,
                      key=key,
                      silent=True, server_init_callback=_init_device_server)


def server_alive(server) -> bool:
    """True while the process of a server made by :func:`start_server` is running."""
    proc = getattr(server, "proc", None)
    return proc is not None and proc.is_alive()


def serve(tracker: tuple[str, int], key: str, host: str = "127.0.0.1", port: int = 9090,
          duration: float = 0.0, restart_delay_s: float = 1.0, log=sys.stderr) -> int:
    """Run a device server of ``key`` until ``duration`` seconds pass (0: until interrupted),
    starting a new one whenever its process dies (a device process killed by a bad kernel or
    by the system). Returns the number of restarts. Prints one line per start to ``log``."""
    server = start_server(tracker, key, host=host, port=port)
    print(f"device server {key!r} on {host}:{server.port}, registered with "
          f"{tracker[0]}:{tracker[1]}", file=log, flush=True)
    deadline = time.monotonic() + duration if duration else None
    restarts = 0
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
            if server_alive(server):
                continue
            code = server.proc._proc.returncode if server.proc and server.proc._proc else None
            server.terminate()  # its session processes go with it
            time.sleep(restart_delay_s)
            server = start_server(tracker, key, host=host, port=port)
            restarts += 1
            print(f"device server {key!r}: its process ended (exit status {code}); started a "
                  f"new one on {host}:{server.port} (restart {restarts})", file=log, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        server.terminate()
    return restarts


def probe_tracker(tracker: tuple[str, int], timeout: float = 3.0) -> None:
    """Raise ConnectionError naming ``tracker`` and the fix when nothing accepts connections
    there (TVM's own client would retry for a minute)."""
    try:
        with socket.create_connection(tracker, timeout=timeout):
            pass
    except OSError as err:
        raise ConnectionError(
            f"cannot reach the tracker at {tracker[0]}:{tracker[1]} ({err.strerror or err}); "
            f"start one with 'thomas-tune rpc tracker --port {tracker[1]}' or fix --tracker"
        ) from None


def tracker_summary(tracker: tuple[str, int]) -> dict:
    """The tracker's view: ``{"queue_info": {key: {"free": n, "pending": m}}, ...}``.
    Raises ConnectionError when the tracker cannot be reached (:func:`probe_tracker`)."""
    probe_tracker(tracker)
    return rpc.connect_tracker(*tracker).summary()


def wait_for_key(tracker: tuple[str, int], key: str, timeout: float = 30.0) -> int:
    """Block until at least one server of ``key`` is free on ``tracker``; returns how many are.

    Raises TimeoutError naming the key and the keys that are registered, or naming the tracker
    when it could not be reached at all.
    """
    deadline = time.monotonic() + timeout
    seen = {}
    unreachable = None
    while time.monotonic() < deadline:
        try:
            seen = tracker_summary(tracker).get("queue_info", {})
            unreachable = None
        except ConnectionError as err:
            seen, unreachable = {}, err
        except (OSError, RuntimeError, socket.error):
            seen = {}
        free = seen.get(key, {}).get("free", 0)
        if free > 0:
            return free
        time.sleep(0.2)
    if unreachable is not None:
        raise TimeoutError(f"{unreachable} (tried for {timeout:.0f} s)")
    raise TimeoutError(f"no free device server with key {key!r} on tracker "
                       f"{tracker[0]}:{tracker[1]} after {timeout:.0f} s (registered: "
                       f"{sorted(seen) or 'none'}); start one with "
                       f"'thomas-tune rpc server --tracker {tracker[0]}:{tracker[1]} --key {key}'")


@contextlib.contextmanager
def loopback(key: str = "local", servers: int = 1, lifetime: float = 3600.0, log=sys.stderr):
    """A tracker and ``servers`` device servers on 127.0.0.1, stopped on exit or after
    ``lifetime`` seconds, whichever comes first. Yields the tracker's (host, port).

    A server whose process dies (a kernel that kills the device process) is replaced within
    about a second, with one line to ``log``, as ``thomas-tune rpc server`` does."""
    tracker = start_tracker()
    quiet(tracker)
    procs: list = []
    stop = threading.Event()
    threads = []
    try:
        addr = ("127.0.0.1", tracker.port)
        procs = [start_server(addr, key) for _ in range(servers)]
        wait_for_key(addr, key)

        def _supervise():
            while not stop.wait(1.0):
                for i, p in enumerate(procs):
                    if stop.is_set() or server_alive(p):
                        continue
                    p.terminate()
                    procs[i] = start_server(addr, key)
                    if log is not None:
                        print(f"[loopback] device server {i} of key {key!r} ended; started a "
                              "new one", file=log, flush=True)

        def _expire():
            stop.set()
            for p in procs:
                p.terminate()
            tracker.terminate()

        threads = [threading.Thread(target=_supervise, daemon=True),
                   threading.Timer(lifetime, _expire)]
        threads[1].daemon = True
        for t in threads:
            t.start()
        yield addr
    finally:
        stop.set()
        if threads:
            threads[1].cancel()
            threads[0].join(timeout=30)
        for p in procs:
            p.terminate()
        tracker.terminate()
