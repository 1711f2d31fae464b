"""Write the kernel digests of tuning logs' records under the thomas_tune this Python imports.

The digests of a log's old code-generation version are made with the old code: a git worktree
at a commit of that version, installed in its own virtual environment, which need not have
``thomas_tune/logs/carry.py``. This script loads that module from its own tree into the
installed ``thomas_tune`` package (its relative imports resolve there: the old builder, the old
schedules, the old OpenCL source rewrite), so the old code's kernels are digested by the same
digest code as the new one's. ``thomas-tune log carry LOG --from-digests FILE`` then compares.

    OLD_VENV/bin/python tools/kernel_digests.py LOG... --out-dir DIR

writes ``DIR/<device>-<log>.digests.json`` per log and prints which thomas_tune made them and
its code-generation id.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def _carry_module():
    """``thomas_tune.logs.carry`` of the installed package, or this tree's loaded into it."""
    import thomas_tune.logs
    try:
        from thomas_tune.logs import carry
        return carry
    except ImportError:
        pass
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "thomas_tune", "logs",
                        "carry.py")
    spec = importlib.util.spec_from_file_location("thomas_tune.logs.carry", here)
    module = importlib.util.module_from_spec(spec)
    sys.modules["thomas_tune.logs.carry"] = module
    spec.loader.exec_module(module)
    thomas_tune.logs.carry = module
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="tuning-log folders")
    p.add_argument("--out-dir", required=True, help="folder of the digests files")
    args = p.parse_args()
    import thomas_tune
    carry = _carry_module()
    os.makedirs(args.out_dir, exist_ok=True)
    version = carry.current()
    print(f"thomas_tune of {os.path.dirname(thomas_tune.__file__)}: code generation "
          f"{version['id']} {version['components']}", flush=True)
    for log in args.logs:
        t0 = time.time()

        def progress(done, total, log=log):
            if done % 100 == 0 or done == total:
                print(f"  {log}: {done}/{total} records, {time.time() - t0:.0f} s", flush=True)

        digests = carry.compute_digests(log, progress)
        path = os.path.join(args.out_dir, carry.digests_name(log))
        carry.write_digests(digests, path)
        errors = sum(1 for d in digests.records.values() if d.startswith("error:"))
        print(f"{log}: {len(digests.records)} distinct records ({errors} whose build fails) in "
              f"{digests.seconds:.0f} s -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
