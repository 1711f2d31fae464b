"""``rpc probe``: a device server's OpenCL device read and measured, beside the target's values."""

from __future__ import annotations

import json
import os

from .options import add_target_arg

#: what the profile calls a property -> the target attribute that holds the same limit
_TARGET_ATTRS = {"max_work_group_size": "max_threads_per_block",
                 "local_memory_bytes": "max_shared_memory_per_block"}


def _fmt(name: str, value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"{value} ({value / (1 << 20):.0f} MiB)"
    return str(value)


def report_lines(profile: dict, target=None) -> list[str]:
    """The profile as lines: each property (with the target's value where it has one, and the
    source where it is not the driver's own answer), then each measured figure."""
    props, sources = profile["properties"], profile["sources"]
    attrs = dict(target.attrs) if target is not None else {}
    lines = [f"device {props.get('device_name', '?')!r} of key {profile['key']!r} "
             f"({profile['server']} server), probed {profile['measured_at']}"]
    for name, value in props.items():
        if name == "extensions":
            value = f"{len(str(value).split())} listed"
        line = f"  {name:22s} {_fmt(name, value)}"
        if name in _TARGET_ATTRS and _TARGET_ATTRS[name] in attrs:
            line += f"   target: {int(attrs[_TARGET_ATTRS[name]])}"
        src = sources.get(name, "")
        if src and not src.startswith(("TVM device API", "OpenCL driver")):
            line += f"   [{src}]"
        lines.append(line)
    m = profile["measured"]
    lines += [f"  {'launch overhead':22s} {m['launch_us']:.4g} us per kernel",
              f"  {'bandwidth (copy)':22s} {m['copy_gb_s']:.4g} GB/s "
              f"({m['copy_bytes'] / (1 << 20):.0f} MiB read and written)",
              f"  {'float32 (FMA)':22s} {m['fma_gflop_s']:.4g} GFLOP/s",
              f"  {'compile per program':22s} {m['compile_s']:.3g} s median, "
              f"{m['compile_s_max']:.3g} s max of {m['programs']}"]
    return lines


def cmd_probe(args) -> int:
    from ..models.layers import require_compiler
    from ..rpc import parse_address
    from ..rpc.probe import probe
    from ..target import parse_target
    require_compiler("rpc probe (it compiles its kernels)")
    target = parse_target(args.target, args.host)
    profile = probe(parse_address(args.tracker), args.key, target, programs=args.programs,
                    copy_mib=args.copy_mib, wait_s=args.wait)
    shown = target if args.target != "opencl" else None  # a bare target has no device values
    for line in report_lines(profile, shown):
        print(line)
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(folder, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"wrote the device profile {args.out}")
    return 0


def add_probe(rsub) -> None:
    t = rsub.add_parser("probe", help="read a device server's OpenCL device and measure it "
                        "(launch overhead, bandwidth, float32 throughput, compile time)")
    t.add_argument("--tracker", default="127.0.0.1:9190", help="tracker HOST:PORT")
    t.add_argument("--key", required=True, help="device key of the server to probe")
    t.add_argument("--out", help="write the device profile (JSON) here, e.g. beside a tuning "
                   "log's device.json as device_profile.json")
    t.add_argument("--programs", type=int, default=3,
                   help="fresh programs whose first launch is timed (default 3)")
    t.add_argument("--copy-mib", type=float, default=64.0,
                   help="MiB the bandwidth kernel copies (default 64; at most half the "
                        "largest allocation)")
    t.add_argument("--wait", type=float, default=60, help="seconds to wait for a free server")
    add_target_arg(t, default="opencl")
