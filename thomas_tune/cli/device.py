"""The ``rpc`` verb: a TVM RPC tracker, a device server of thomas_tune, or a device probed."""

from __future__ import annotations

import sys

from .options import add_target_arg


def cmd_rpc(args) -> int:
    from .. import rpc
    if args.rpc_verb == "probe":
        from .probe import cmd_probe
        return cmd_probe(args)
    if args.rpc_verb == "tracker":
        tracker = rpc.start_tracker(args.host, args.port)
        print(f"tracker listening on {args.host}:{tracker.port}", flush=True)
        procs = [tracker]
    else:
        addr = rpc.parse_address(args.tracker)
        if args.target != "llvm":
            import thomas_tune  # noqa: F401  (loads runtime extensions before serving)
        # restarted whenever its process dies (a kernel that kills the device process)
        rpc.serve(addr, args.key, host=args.host, port=args.port, duration=args.duration,
                  log=sys.stdout)
        return 0
    from ..rpc.device_server import wait_for
    try:
        wait_for(args.duration)
    finally:
        for p in procs:
            p.terminate()
    return 0


def add_rpc(sub) -> None:
    s = sub.add_parser("rpc", help="start a TVM RPC tracker or device server, or probe a device")
    rsub = s.add_subparsers(dest="rpc_verb", required=True)
    t = rsub.add_parser("tracker")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=9190)
    t.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    t = rsub.add_parser("server")
    t.add_argument("--tracker", default="127.0.0.1:9190", help="tracker HOST:PORT")
    t.add_argument("--key", required=True, help="device key to register under")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=9090)
    t.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    add_target_arg(t)
    from .probe import add_probe
    add_probe(rsub)
    s.set_defaults(fn=cmd_rpc)
