"""Stopping by signal: SIGINT and SIGTERM end a run cleanly, or after a grace time."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading


STOP: dict = {}  # the signal that stopped this process, if any; the tuning log it reports


#: after SIGINT/SIGTERM, the clean stop's time before the process exits anyway (while tuning, the
#: clean stop waits for the batches in flight: on the H100, up to 3 batches of 64 trials)
STOP_GRACE_S = 60.0


def terminate(signum, frame):
    # SIGTERM ends the run as SIGINT does: TVM's C++ loops, which run Python's signal handlers
    # from inside long calls, unwind on KeyboardInterrupt (the tuner's own loop stops from its
    # task scheduler instead: thomas_tune.tuning); main() then exits with 128 + signal.
    # Should the clean stop not finish (a build or session stuck in native code), the process
    # exits after STOP_GRACE_S all the same: tuning records are on disk as they arrive.
    if "signal" not in STOP:
        STOP["signal"] = signum
        timer = threading.Timer(STOP_GRACE_S, force_exit, args=(signum,))
        timer.daemon = True
        timer.start()
    raise KeyboardInterrupt


def force_exit(signum: int) -> None:
    name = signal.Signals(signum).name
    log = STOP.get("log")
    if log is not None:
        print(f"tuning stopped by {name}: {safe_records(log)} records are safe in "
              f"{log.record_path} (trials in flight are lost); run the same command again to "
              "resume", file=sys.stderr, flush=True)
    else:
        print(f"stopped by {name} (the clean stop took over {STOP_GRACE_S:g} s)",
              file=sys.stderr, flush=True)
    os._exit(128 + signum)


def safe_records(log) -> int:
    """Complete records (lines that parse) in a tuning log's record file."""
    n = 0
    if os.path.exists(log.record_path):
        with open(log.record_path) as f:
            for line in f:
                try:
                    json.loads(line)
                    n += line.endswith("\n")
                except ValueError:
                    pass
    return n
