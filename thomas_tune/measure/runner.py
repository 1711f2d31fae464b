"""The runner of the tuner: candidates measured on a farm of device servers, one lane per server.

MetaSchedule's RPCRunner opens one RPC session per candidate (a fork on the server and a new
OpenCL context); on a GPU that measures a kernel in microseconds, that cost is the tuning time.
Here:

* :class:`FarmRunner` keeps one *lane* per device server of the key: a worker process holding one
  RPC session (:mod:`.lane`), reused for every trial until the session nears its timeout or the
  lane goes idle.
  Lanes take trials from one queue, so several servers measure in parallel. A trial is three
  calls, each with its own limit: the driver's program build (``compile_timeout_s``), the wait
  for the device lock, and the timed runs (``trial_timeout_s``); one that runs over is cut and
  recorded as an error that names the step (a single limit over all three cut good candidates
  whose build waited for CPU cores or whose lock wait was long: on the H100, 85 of 333 AlexNet
  trials of one run were cut at 20 s). A server that dies
  costs the trial in flight on it; its lane asks the tracker for a server again and the batch
  goes on with the others, and fails what is left only when no server of the key could be had
  for ``wait_s`` seconds.
* Repeats are sized to the kernel: one warm-up run measures it, then ``number`` runs per repeat
  are chosen so that each repeat lasts about ``min_repeat_ms``.
* Each candidate's outputs are compared with its task's reference (the default schedule's) on
  the device before it is timed (:meth:`FarmRunner.expect`, :mod:`thomas_tune.kernel_check`).
* Device servers started by thomas_tune take turns for timed runs and compile at low priority
  (:mod:`.priority`); servers without that (TVM's Android app) are timed as they are.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.support.popen_pool import PopenWorker

from .kept import keep_lane_worker, take_lane_worker
from .lane import lane_close, lane_lock, lane_open, lane_ping, lane_prepare, lane_time
from .phases import Phases


#: the ``log`` of a :class:`FarmRunner` that writes to ``sys.stderr`` as it is at each line (a
#: stream bound when the runner is made would outlive a replaced ``sys.stderr``)
STDERR = object()


# ---- runner ---------------------------------------------------------------------------------
@derived_object
class _Future(ms.runner.PyRunnerFuture):
    def __init__(self, batch: "_Batch"):
        super().__init__()
        self._event = threading.Event()
        self._result = None
        self._batch = batch

    def set(self, costs, error):
        self._result = (costs, error)
        self._event.set()
        self._batch.one_done()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self):
        self._event.wait()
        costs, error = self._result
        return ms.runner.RunnerResult(costs, error)


class _Batch:
    """Wall time of one run() call: from submission to its last result."""

    def __init__(self, phases: Phases, n: int):
        self.phases, self.left, self.t0 = phases, n, time.perf_counter()
        self.lock = threading.Lock()

    def one_done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.phases.add("run", time.perf_counter() - self.t0, wall=True)


class _Lane(threading.Thread):
    """One device server's worth of measurement: a worker process with one RPC session."""

    def __init__(self, farm: "FarmRunner", index: int):
        super().__init__(daemon=True, name=f"thomas-tune-lane-{index}")
        self.farm = farm
        self.index = index
        self.worker: PopenWorker | None = None
        self.worker_key: tuple | None = None  # the environment it started in (.kept)
        self.has_session = False
        self.opened_at = 0.0
        self.waiting_since: float | None = None
        self.lost: str | None = None

    def _call(self, fn, args, timeout):
        if self.worker is None:  # a process kept from an earlier run, or a new one
            self.worker, self.worker_key = take_lane_worker()
        worker = self.worker
        worker.send(fn, args, timeout=timeout)
        # The worker enforces ``timeout`` itself; should it not answer (a call that never lets
        # its timer run), killing it from here makes recv() fail instead of waiting forever.
        watchdog = threading.Timer(timeout + 10.0, worker.kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            return worker.recv()
        finally:
            watchdog.cancel()

    def _alive(self) -> bool:
        try:
            return bool(self._call(lane_ping, (), timeout=10.0))
        except Exception:
            return False

    def _drop(self) -> None:
        """Kill the worker: its session (and any call stuck in it) goes with it."""
        if self.worker is not None:
            self.worker.kill()
            self.worker = None
        self.has_session = False

    def _close(self) -> bool:
        """Close the session in the worker, which stays for the next one (a session is
        renewed, or closed when idle, between calls: none is in flight). A worker that does
        not answer is killed (:meth:`_drop`). Returns whether the worker is still there."""
        if self.worker is not None and self.has_session:
            try:
                self._call(lane_close, (), timeout=10.0)
            except Exception:
                self._drop()
        self.has_session = False
        return self.worker is not None

    def _release(self) -> None:
        """At the lane's end: close the session and hand the worker to the next run of this
        process (:mod:`.kept`)."""
        worker, key = self.worker, self.worker_key
        if worker is not None and self._close():
            self.worker = None
            keep_lane_worker(worker, key)

    def _open(self) -> bool:
        f = self.farm
        t0, started = time.perf_counter(), time.monotonic()  # the server's timer starts here
        try:
            self._call(lane_open, (f.tracker[0], f.tracker[1], f.key, f.session_timeout_s,
                                    f.priority), timeout=f.open_slice_s)
        except Exception as err:  # tracker busy or down, no free server yet: try again later
            self._drop()
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()
                f.say(f"lane {self.index}: no device server of key {f.key!r} yet "
                      f"({error_line(err)}); waiting up to {f.wait_s:g} s while "
                      f"{f.live_lanes()} other lane(s) measure")
            return False
        f.phases.add("run.session_open", time.perf_counter() - t0)
        if self.lost is not None:
            f.say(f"lane {self.index}: back in service after losing its server ({self.lost})")
            self.lost = None
        self.has_session, self.opened_at, self.waiting_since = True, started, None
        return True

    def run(self) -> None:
        f = self.farm
        while not f.stopped:
            item = None
            with f.cond:
                t_idle = time.perf_counter()
                while not f.queue and not f.stopped:
                    if not f.cond.wait(timeout=f.idle_close_s) and self.has_session:
                        self._close()  # idle: free the server for others
                if f.stopped:
                    break
                idle = time.perf_counter() - t_idle
                if idle > 1e-3:  # no trial was waiting for this lane
                    f.phases.add("run.idle", idle)
            # keep a session young enough that a trial cannot run into its timeout
            if self.has_session and (time.monotonic() - self.opened_at
                                     > f.session_timeout_s - f.trial_limit_s):
                self._close()
            if not self.has_session and not self._open():
                f.check_starved()
                time.sleep(0.2)
                continue
            with f.cond:
                if f.queue:
                    item = f.queue.popleft()
            if item is None:
                continue
            inp, fut, ref = item
            wire = ref.wire() if ref is not None else None
            t0 = time.perf_counter()
            # Three calls, each under its own limit: the driver's program build
            # (compile_timeout_s), the wait for the device lock (other lanes' timed runs, each
            # bounded by its own limit), and the timed runs (trial_timeout_s).
            step = "compile"
            try:
                phases = self._call(lane_prepare, (str(inp.artifact_path), str(inp.device_type),
                                                    tuple(a.as_json() for a in inp.args_info),
                                                    wire),
                                    timeout=f.compile_timeout_s)
                step = "lock"
                phases["run.lock_wait"] = self._call(lane_lock, (), timeout=f.lock_timeout_s)
                step = "time"
                out = self._call(lane_time, (f.repeat, f.min_repeat_ms, f.max_number, wire),
                                 timeout=f.trial_timeout_s)
                phases.update(out["phases"])
                for k, v in phases.items():
                    f.phases.add(k, v)
                f.phases.add("run.trial", time.perf_counter() - t0)
                if out.get("wrong") is not None:
                    f.phases.add("run.wrong", 1.0)
                    fut.set(None, out["wrong"])
                else:
                    fut.set(out["costs"], None)
            except TimeoutError:
                f.phases.add("run.trial", time.perf_counter() - t0)
                self._drop()
                what, limit = {"compile": ("the OpenCL program build", f.compile_timeout_s),
                               "lock": ("the wait for the device lock", f.lock_timeout_s),
                               "time": ("the timed runs", f.trial_timeout_s)}[step]
                self.lost = f"{what} took over {limit:g} s"
                f.phases.add(f"run.timeout_{step}", 1.0)
                fut.set(None, f"run timed out: {what} took over {limit:g} s on a server of key "
                              f"{f.key!r}; the session was closed and a server requested again")
            except Exception as err:
                f.phases.add("run.trial", time.perf_counter() - t0)
                msg = error_line(err)
                if isinstance(err, ChildProcessError) or not self._alive():
                    self._drop()
                    self.lost = msg
                    f.say(f"lane {self.index}: device server lost during a trial ({msg}); "
                          f"the trial is recorded as an error, {f.live_lanes()} other lane(s) "
                          "go on")
                    fut.set(None, f"device server lost during the trial: {msg}")
                else:
                    # A kernel that failed may leave its OpenCL context unusable (an
                    # out-of-bounds write turns every later call into CL_OUT_OF_RESOURCES):
                    # the next trial gets a fresh session, so one bad candidate costs itself.
                    self._drop()
                    fut.set(None, f"run failed: {msg}")
        self._release()


def error_line(err: BaseException | str, limit: int = 400) -> str:
    """The line of an error (exception or message text) that says what went wrong: the last
    non-empty line that is not a caret underline, cut to ``limit`` characters."""
    text = str(err).strip()
    # TVM's errors may end in a source excerpt underlined with carets: skip those lines
    lines = [ln for ln in text.splitlines() if ln.strip().strip("^~ ")]
    # TVM errors end with the message; tracebacks start with "Traceback"
    msg = lines[-1] if lines else type(err).__name__ if isinstance(err, BaseException) else ""
    return msg[:limit]


@derived_object
class FarmRunner(ms.runner.PyRunner):
    """Measures candidates on the device servers of ``key`` registered with ``tracker``.

    ``lanes``: servers used at once (default: the free servers of the key at the first batch).
    ``trial_timeout_s``: a trial whose timed runs (warm-up included) take longer is cut and
    recorded as an error; ``compile_timeout_s``: the same for the driver's build of the
    candidate's OpenCL programs; the wait for the device lock is cut after ``lanes x
    trial_timeout_s + 10`` s.
    ``repeat``: timed repeats per trial; ``min_repeat_ms``: length of each repeat (the number of
    runs per repeat is sized from a warm-up run, at most ``max_number``).
    ``wait_s``: how long queued trials wait when no server of the key can be had at all.
    ``session_timeout_s``: the session lifetime asked of the server (it kills the session after
    that, which also frees a server stuck in a hung kernel). A lane opens a new session before
    its session comes within one trial's limits (:attr:`trial_limit_s`) of that age. Opening
    one costs seconds (9.6 s each, on average, over 100 opens on the H100 with 12 servers):
    with 180 s sessions, most of the opens of a run were these renewals, and a few sessions
    were cut by the server mid-trial.
    ``idle_close_s``: a lane with nothing to measure for that long closes its session, which
    frees the server for other tuning runs of the same key.
    """

    def __init__(self, tracker: tuple[str, int], key: str, lanes: int | None = None,
                 trial_timeout_s: float = 20.0, compile_timeout_s: float = 30.0,
                 repeat: int = 3, min_repeat_ms: float = 2.0,
                 max_number: int = 1000, wait_s: float = 60.0, session_timeout_s: float = 900.0,
                 idle_close_s: float = 60.0, priority: int = 1, phases: Phases | None = None,
                 log=STDERR):
        super().__init__()
        self.tracker, self.key = tuple(tracker), key
        self.lanes_wanted = lanes
        self.trial_timeout_s, self.repeat, self.min_repeat_ms = trial_timeout_s, repeat, \
            min_repeat_ms
        self.max_number, self.wait_s, self.priority = max_number, wait_s, priority
        self.compile_timeout_s = compile_timeout_s
        self.lanes: list[_Lane] = []
        from ..rpc import whole_seconds  # sent as -timeout=N: tvm_rpc rejects "900.0"
        self.session_timeout_s = whole_seconds(max(session_timeout_s, 2 * self.trial_limit_s))
        self.idle_close_s = idle_close_s
        self.open_slice_s = min(10.0, wait_s)
        self.phases = phases or Phases()
        self.log = log
        self.queue: collections.deque = collections.deque()
        self._expected = None  # the reference of the next run() call (expect())
        self.cond = threading.Condition()
        self.stopped = False

    def expect(self, reference) -> None:
        """The candidates of the next :meth:`run` call are kernels of the task of
        ``reference`` (a :class:`thomas_tune.kernel_reference.Reference`): each is run once on
        the reference's inputs and compared with its outputs before it is timed, and a wrong
        one is a failed trial ("wrong result: ..."). None: the next call's candidates are
        timed unchecked (the default schedules themselves, the references)."""
        self._expected = reference

    def say(self, text: str) -> None:
        """Write ``[runner] text`` to ``log`` (a text stream; :data:`STDERR`: the process's
        standard error as it is when the line is written; None: nothing)."""
        if self.log is not None:
            print(f"[runner] {text}", file=sys.stderr if self.log is STDERR else self.log,
                  flush=True)

    @property
    def lock_timeout_s(self) -> float:
        """How long a lane waits for the device lock: every other lane may hold it for up to
        one trial's timed runs (lanes asked for, or 8, until the lanes start)."""
        lanes = len(self.lanes) if self.lanes else (self.lanes_wanted or 8)
        return lanes * self.trial_timeout_s + 10.0

    @property
    def trial_limit_s(self) -> float:
        """The longest one trial may hold a lane: program build, lock wait and timed runs."""
        return self.compile_timeout_s + self.lock_timeout_s + self.trial_timeout_s

    def live_lanes(self) -> int:
        return sum(1 for lane in self.lanes if lane.has_session)

    def check_starved(self) -> None:
        """Fail the queued trials when every lane has waited ``wait_s`` for a server."""
        now = time.monotonic()
        if not self.lanes or any(lane.waiting_since is None or now - lane.waiting_since
                                 < self.wait_s for lane in self.lanes):
            return
        with self.cond:
            dropped = list(self.queue)
            self.queue.clear()
        for _, fut, _ in dropped:
            fut.set(None, f"no device server of key {self.key!r} on tracker "
                          f"{self.tracker[0]}:{self.tracker[1]} for {self.wait_s:g} s")
        if dropped:
            self.say(f"no device server of key {self.key!r} for {self.wait_s:g} s: "
                     f"{len(dropped)} queued trial(s) recorded as errors; still waiting")
            for lane in self.lanes:
                lane.waiting_since = time.monotonic()

    def _start_lanes(self) -> None:
        n = self.lanes_wanted
        if n is None:
            from tvm import rpc
            try:
                info = rpc.connect_tracker(*self.tracker).summary()["queue_info"]
                n = max(1, int(info.get(self.key, {}).get("free", 1)))
            except Exception:
                n = 1
        self.lanes = [_Lane(self, i) for i in range(n)]
        self.phases.lanes = n
        for lane in self.lanes:
            lane.start()
        self.say(f"measuring on {n} device server(s) of key {self.key!r}")

    def run(self, runner_inputs):
        if self.stopped:
            raise RuntimeError("this runner was shut down (tune() shuts its runner down when "
                               "it ends); make a new one, e.g. with thomas_tune.tuning.rpc_runner")
        if not self.lanes:
            self._start_lanes()
        futures = []
        batch = _Batch(self.phases, len(runner_inputs))
        ref, self._expected = self._expected, None
        with self.cond:
            for inp in runner_inputs:
                fut = _Future(batch)
                self.queue.append((inp, fut, ref))
                futures.append(fut)
            self.cond.notify_all()
        return futures

    def shutdown(self) -> None:
        """Stop the lanes and close their sessions (queued trials fail as cancelled)."""
        self.stopped = True
        with self.cond:
            left = list(self.queue)
            self.queue.clear()
            self.cond.notify_all()
        for _, fut, _ in left:
            fut.set(None, "cancelled: the runner was shut down")
        for lane in self.lanes:
            lane.join(timeout=5)
            lane._drop()
