"""A device server that needs only TVM's runtime: what runs on a device without thomas_tune.

Runs TVM's RPC server loop in this process (no helper process is started, so it also runs
under ``qemu-user``, where a child could not exec a foreign binary), registered with a tracker
under a key, for at most ``--duration`` seconds. The runtime library must be the only one
loaded (``TVM_USE_RUNTIME_LIB=1``); ``libtvm_runtime_extra`` is loaded for the measuring
helpers the tuner calls (``tvm.contrib.random.random_fill_for_measure``).

    TVM_USE_RUNTIME_LIB=1 python3 rpc/device_server.py --tracker 127.0.0.1:9190 --key KEY
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def wait_for(duration: float | None) -> None:
    """Return after ``duration`` seconds (None or 0: never), or at Ctrl-C."""
    deadline = time.monotonic() + duration if duration else None
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


def main(argv=None) -> int:
    """Serve until ``--duration`` seconds have passed (0: until killed); returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    p.add_argument("--key", required=True, help="device key to register under")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    args = p.parse_args(argv)
    host, _, port = args.tracker.rpartition(":")
    if not host or not port.isdigit():
        p.error(f"--tracker {args.tracker!r}: expected HOST:PORT")
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import tvm
    from tvm.rpc import server

    lib_dir = os.path.dirname(tvm.base._LOADED_LIBS["tvm_runtime"]._name)
    extra = os.path.join(lib_dir, "libtvm_runtime_extra.so")
    if os.path.exists(extra):
        ctypes.CDLL(extra, ctypes.RTLD_GLOBAL)
    state = server.PopenRPCServerState(args.host, args.port, args.port + 100,
                                       tracker_addr=(host, int(port)), key=args.key,
                                       silent=True)
    print(f"device server {args.key!r} on {args.host}:{state.port} ({os.uname().machine}), "
          f"registered with {host}:{port}", flush=True)
    wait_for(args.duration)
    sys.stdout.flush()
    os._exit(0)  # the listening thread never returns by itself


if __name__ == "__main__":
    sys.exit(main())
