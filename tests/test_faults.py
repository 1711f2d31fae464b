"""Faults injected on purpose, with real processes on 127.0.0.1 (llvm CPU target):

* a device farm (two ``thomas-tune rpc server`` processes of one key) loses a server in the
  middle of a batch: only the trial in flight on it fails, with the reason; the other server
  measures the rest; ``rpc server`` starts a new device process and its lane comes back;
* a kernel that never returns and one that segfaults the device process: each costs its own
  trial (timed out / server lost), the server is back in service, the next trials measure;
* the tuner stopped by SIGINT, SIGTERM and SIGKILL and started again on its log: one line says
  how many records are safe where, no record is lost, no schedule is measured twice, a second
  tuner on the log is refused with the holder's pid, SIGKILL leaves no stale lock;
* tuning logs: a torn last line and a corrupt record are reported with file and line and set
  aside; ``thomas-tune log show|check|merge``;
* bad input: a clear error naming the thing and the fix, and no partial output;
* network exposure: a warning for any bind address that is not loopback.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.schedule import Schedule
from tvm.script import tirx as T

from thomas_tune import cli, rpc
from thomas_tune.measure.builder import build_candidate, export_candidate
from thomas_tune.measure.runner import FarmRunner
from thomas_tune.schedules import plain_json
from thomas_tune.target import parse_target
from thomas_tune.logs import (LogInUse, TrialErrors, TuningLog, mean_seconds, read_errors,
                                    read_log)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED_LOG = os.path.join(ROOT, "tuning_logs", "local-cpu", "mobilenet_v2-w0.35-r64-c10-b8")
TINY = ["--model", "alexnet", "--width", "0.1", "--resolution", "63", "--classes", "5",
        "--batch", "1", "--trainable", "last:1"]


# ---- kernels that misbehave on the device -----------------------------------------------------
@T.prim_func
def hanging_kernel(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "main", "tir.noalias": True})
    while T.int32(1) == T.int32(1):  # never returns
        B[0] = B[0] + A[1]


@T.prim_func
def crashing_kernel(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32")):
    T.func_attr({"global_symbol": "main", "tir.noalias": True})
    C = T.decl_buffer((1,), "float32", data=B.data)
    for i in range(64):  # writes 4 TiB past its buffer: SIGSEGV in the device process
        C[(T.int64(1) << T.int64(42)) + T.int64(i)] = A[i]


_BUILT: list[str] = []  # candidate folders made by this module, removed at its end


@pytest.fixture(scope="module", autouse=True)
def _remove_candidates():
    yield
    for path in _BUILT:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _candidate(func) -> ms.runner.RunnerInput:
    """Build ``func`` as the tuner's Builder does (a shared library) -> a runner input."""
    target = parse_target("llvm")
    path = export_candidate(build_candidate(tvm.IRModule({"main": func}), target), target)
    _BUILT.append(path)
    return ms.runner.RunnerInput(path, "cpu", ArgInfo.from_prim_func(func))


def _matmul(rng) -> ms.runner.RunnerInput:
    n = int(rng.integers(48, 97))
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return _candidate(te.create_prim_func([a, b, c]))


def _results(futures, timeout: float):
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "the runner did not finish its batch in time"
        time.sleep(0.1)
    return [f.result() for f in futures]


# ---- processes --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracker():
    t = rpc.start_tracker()
    yield ("127.0.0.1", t.port)
    t.terminate()


def _wait(cond, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _queue(tracker, key) -> dict:
    return rpc.tracker_summary(tracker)["queue_info"].get(key, {})


class CliServer:
    """``thomas-tune rpc server`` as a child process (stopped by ``stop`` or after 300 s)."""

    def __init__(self, tracker, key, out_path, port: int):
        self.out_path = out_path
        self.out = open(out_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "thomas_tune.cli", "rpc", "server", "--tracker",
             f"{tracker[0]}:{tracker[1]}", "--key", key, "--port", str(port),
             "--duration", "300"], stdout=self.out, stderr=subprocess.STDOUT,
            start_new_session=True)

    def text(self) -> str:
        with open(self.out_path) as f:
            return f.read()

    def device_process(self) -> psutil.Process:
        """The device server's own process (the child that ``rpc server`` restarts)."""
        kids = psutil.Process(self.proc.pid).children()
        assert kids, "rpc server has no device process"
        return kids[0]

    def kill_device_process(self) -> int:
        """SIGKILL the device process and its session processes, as a dying device would."""
        top = self.device_process()
        for p in [*top.children(recursive=True), top]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return top.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.out.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key(rng, name):
    return f"{name}-{int(rng.integers(1 << 30))}"


# ---- device farm: a server dies in the middle of a batch --------------------------------------
def test_farm_goes_on_when_a_device_server_dies(tracker, rng, tmp_path):
    key = _key(rng, "farm")
    servers = [CliServer(tracker, key, str(tmp_path / f"server{i}.out"), 9300 + 20 * i)
               for i in range(2)]
    runner = None
    try:
        _wait(lambda: _queue(tracker, key).get("free", 0) == 2, 90, "two free servers")
        log = _Lines()
        runner = FarmRunner(tracker, key, lanes=2, trial_timeout_s=30, repeat=2,
                            min_repeat_ms=100, wait_s=60, log=log)
        # Both lanes open their sessions on a first batch: a lane still opening its first
        # session (its worker process starts and imports TVM) loses no trial when its server
        # dies, and on a loaded machine the other lane could measure the whole batch meanwhile.
        _results(runner.run([_matmul(rng) for _ in range(2)]), 120)
        _wait(lambda: runner.live_lanes() == 2, 60, "both lanes in session")
        futures = runner.run([_matmul(rng) for _ in range(12)])
        _wait(lambda: sum(f.done() for f in futures) >= 2, 120, "the first trials")
        killed = servers[1].kill_device_process()
        results = _results(futures, 180)
        errors = [r.error_msg for r in results if r.error_msg is not None]
        # exactly the trial in flight on the dead server is lost, with the reason
        assert len(errors) == 1, errors
        assert "device server lost during the trial" in errors[0]
        assert all(r.run_secs and min(float(s) for s in r.run_secs) > 0
                   for r in results if r.error_msg is None)
        assert "device server lost during a trial" in log.text()
        # rpc server starts a new device process; the lane that lost its server comes back
        _wait(lambda: "started a new one" in servers[1].text(), 60, "the restart")
        assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == "zombie"
        # (no wait for a free server in the tracker: both lanes keep their sessions open between
        # batches, the lane that lost its server on the restarted one, until idle_close_s)
        again = _results(runner.run([_matmul(rng) for _ in range(4)]), 180)
        assert all(r.error_msg is None for r in again), [r.error_msg for r in again]
        _wait(lambda: "back in service" in log.text(), 30, "the lane back in service")
        print(f"farm: 1 device process killed, {len(errors)} trial lost of "
              f"{len(results) + len(again)} (after 2 to open the sessions)")
    finally:
        if runner is not None:
            runner.shutdown()
        for s in servers:
            s.stop()


def test_no_server_at_all_fails_queued_trials_after_the_wait(tracker, rng):
    key = _key(rng, "nobody")
    log = _Lines()
    runner = FarmRunner(tracker, key, lanes=1, trial_timeout_s=5, wait_s=2, log=log)
    try:
        t0 = time.monotonic()
        res = _results(runner.run([_matmul(rng) for _ in range(2)]), 60)
        assert time.monotonic() - t0 < 30
        for r in res:
            assert f"no device server of key {key!r}" in r.error_msg and "for 2 s" in r.error_msg
        assert "waiting up to 2 s" in log.text() and "2 queued trial(s) recorded as errors" \
            in log.text()
    finally:
        runner.shutdown()


class _Lines:
    """A text stream the runner reports to (written from its lane threads)."""

    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass

    def text(self) -> str:
        return "".join(self.parts)


def test_loopback_replaces_a_dead_device_server(rng):
    # the demo's tracker and server: a device process that dies is replaced
    key = _key(rng, "loop")
    log = _Lines()
    with rpc.loopback(key=key, servers=1, lifetime=120, log=log) as addr:
        workers = [c for c in psutil.Process().children()
                   if "popen_worker" in " ".join(c.cmdline())]
        server = [w for w in workers if any(c.laddr.ip == "127.0.0.1" and c.status == "LISTEN"
                                            and 9090 <= c.laddr.port < 9190
                                            for c in w.net_connections("tcp"))]
        assert len(server) == 1
        server[0].kill()
        _wait(lambda: "started a new one" in log.text(), 30, "the replacement")
        assert rpc.wait_for_key(addr, key, timeout=60) == 1


# ---- kernels that hang or crash the device process --------------------------------------------
def test_hanging_and_crashing_kernels_cost_only_themselves(tracker, rng, tmp_path):
    key = _key(rng, "bad-kernels")
    server = CliServer(tracker, key, str(tmp_path / "server.out"), 9360)
    runner = None
    try:
        _wait(lambda: _queue(tracker, key).get("free", 0) == 1, 90, "a free server")
        device_pid = server.device_process().pid
        log = _Lines()
        # a session timeout far beyond the test: the hung session must end with its client
        runner = FarmRunner(tracker, key, lanes=1, trial_timeout_s=2, session_timeout_s=600,
                            repeat=1, min_repeat_ms=20, wait_s=120, log=log)
        good = [_matmul(rng) for _ in range(3)]
        order = [good[0], _candidate(hanging_kernel), good[1], _candidate(crashing_kernel),
                 good[2]]
        t0 = time.monotonic()
        res = _results(runner.run(order), 120)
        took = time.monotonic() - t0
        assert res[1].error_msg and "the timed runs took over 2 s" in res[1].error_msg
        assert res[3].error_msg and "device server lost during the trial" in res[3].error_msg
        for i in (0, 2, 4):
            assert res[i].error_msg is None and res[i].run_secs, res[i].error_msg
        # the segfault killed a session process only: the same device server still serves
        assert server.device_process().pid == device_pid
        assert "ended abnormally" in server.text() and "still serving" in server.text()
        # the hung session ended when the runner cut the trial, not at the session timeout,
        # and without a restart of the server
        assert "started a new one" not in server.text()
        assert took < 60
    finally:
        if runner is not None:
            runner.shutdown()
        server.stop()


# ---- the tuner stopped and started again ------------------------------------------------------
def _tuner(argv, out_path):
    # a child of the fork server: the CLI's own main(), its own signal handlers, output to a file
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    # the fork server's import (tests/tuner_preload.py) is this process's too
    print(f"tensor intrinsics preloaded: {'tvm.s_tir.tensor_intrin' in sys.modules}", flush=True)
    try:
        rc = cli.main(argv)
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _complete_lines(path) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [ln for ln in f if ln.endswith("\n")]


def test_tuner_killed_and_restarted(tracker, rng, tmp_path, monkeypatch):

    key = _key(rng, "resume")
    server = rpc.start_server(tracker, key, port=9400)
    log = TuningLog(str(tmp_path / "log"))
    argv = ["tune", *TINY, "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", key,
            "--trials", "400", "--top", "2", "--trials-per-iter", "4", "--population", "16",
            "--log", log.path, "--build-workers", "1", "--seed", str(int(rng.integers(1000)))]
    # Tuners start from a fork server: a single-threaded process that imported the CLI and
    # MetaSchedule's tensor intrinsics once (tests/tuner_preload.py), so each run skips that
    # import. A plain fork of this test process would copy the locks its other threads hold
    # (tracker, servers, TVM's pools) and a child could hang on one, signals and all. The fork
    # server finds that module through PYTHONPATH: Python 3.11's fork server leaves out the
    # sys.path it is given, and skips a preload module it cannot import without a word.
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tuner_preload"])
    kept: list[str] = []  # the log's records after each run: never lost afterwards
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        for n, sig in enumerate((signal.SIGINT, signal.SIGTERM, signal.SIGKILL)):
            out = str(tmp_path / f"run{n}.out")
            stats = tmp_path / f"run{n}.stats.json"
            child = ctx.Process(target=_tuner, args=(argv + ["--stats", str(stats)], out))
            child.start()
            before = len(kept)
            _wait(lambda: len(_complete_lines(log.record_path)) >= before + 3, 240,
                  f"records of run {n}", step=0.1)
            if n == 0:  # a second tuner on the same log is refused, naming the holder
                with pytest.raises(LogInUse, match=f"pid {child.pid} on .*another --log"):
                    log.lock()
            os.kill(child.pid, sig)
            child.join(60)
            text = open(out).read()
            assert text.startswith("tensor intrinsics preloaded: True"), text[:200]
            lines = _complete_lines(log.record_path)
            assert lines[:before] == kept, "records of earlier runs changed"
            if sig == signal.SIGKILL:
                assert child.exitcode == -signal.SIGKILL
            else:
                assert child.exitcode == 128 + sig, text[-2000:]
                last = text.strip().splitlines()[-1]
                m = re.fullmatch(rf"tuning stopped by {sig.name}: (\d+) records are safe in "
                                 r"(\S+) \(batches in flight at the signal were measured and "
                                 r"logged\); run the same command again to resume", last)
                assert m, text[-2000:]
                assert int(m.group(1)) == len(lines) and m.group(2) == log.record_path
                assert "Traceback" not in text
                # the statistics are written at the stop too (a run this short has had no
                # periodic write), saying what stopped it
                report = json.loads(stats.read_text())
                assert report["ended"] == f"stopped by {sig.name}", report["ended"]
                assert report["elapsed_s"] > 0 and len(report["tasks"]) == 2, report
                if n == 1:  # run 0 kept no schedule hashes (its log was empty at its start)
                    assert report["replayed_records"] >= report["resumed_records"], report
            kept = lines
        # SIGKILL leaves no stale lock; a torn line, if the kill made one, is set aside
        log.lock("checking").release()
        report = log.check(report_to=None)
        assert report.records == len(kept)
    finally:
        server.terminate()
    # no schedule with a run time was measured twice over the four runs
    database = log.database(check=False)
    seen: dict[int, set] = {}
    valid = 0
    for rec in database.get_all_tuning_records():
        if not rec.run_secs or max(float(s) for s in rec.run_secs) >= 1e9:
            continue
        sch = Schedule(rec.workload.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        h = tvm_ffi.structural_hash(sch.mod)
        wl = tvm_ffi.structural_hash(rec.workload.mod)
        assert h not in seen.setdefault(wl, set()), "a schedule was measured twice"
        seen[wl].add(h)
        valid += 1
    assert valid >= 6
    # with no --time-share, the two tuned tasks' default schedules were timed (and cached), so
    # export can keep a default that a record does not beat
    with open(os.path.join(log.path, "default_latency.json")) as f:
        seconds = json.load(f)["seconds"]
    assert len(seconds) == 2 and all(0 < v < 10 for v in seconds.values()), seconds
    print(f"tuner: 3 stops (SIGINT, SIGTERM, SIGKILL), {len(kept)} records kept, 0 lost")


# ---- tuning logs: damage, show, check, merge --------------------------------------------------
def _same_records(a, b) -> None:
    assert [float(s) for s in a.run_secs] == [float(s) for s in b.run_secs]
    assert json.dumps(plain_json(a.trace.as_json())) == json.dumps(plain_json(b.trace.as_json()))


# the tuning log's append, resume and corrupt record: in the subset for edits (pytest -m quick)
@pytest.mark.quick
def test_log_database_hands_out_what_jsondatabase_does(tmp_path, rng):
    log = _copy_log(tmp_path / "log")
    lazy = log.database(check=False)
    full = ms.database.JSONDatabase(log.workload_path, log.record_path, allow_missing=False)
    assert len(lazy) == len(full) and len(lazy.workloads) > 10
    for w in lazy.workloads:
        a, b = full.get_top_k(full.commit_workload(w.mod), 1 << 30), lazy.get_top_k(w, 1 << 30)
        assert len(a) == len(b) and len(a) > 0
        for x, y in zip(a, b):
            _same_records(x, y)
        q = lazy.query_tuning_record(w.mod, None, "main")
        _same_records(q, a[0])
        assert tvm_ffi.structural_equal(lazy.query_ir_module(w.mod, None, "main"),
                                        full.query_ir_module(w.mod, parse_target("llvm"), "main"))
    # a committed record is appended (one line) and sorted in; both databases read it back
    w = lazy.workloads[int(rng.integers(len(lazy.workloads)))]
    best = lazy.get_top_k(w, 1)[0]
    secs = [float(s) * float(rng.uniform(0.5, 0.9)) for s in best.run_secs]
    faster = ms.database.TuningRecord(best.trace, w, secs, best.target, best.args_info)
    n_lines = len(open(log.record_path).readlines())
    lazy.commit_tuning_record(faster)
    assert len(open(log.record_path).readlines()) == n_lines + 1
    for db in (lazy, log.database(check=False),
               ms.database.JSONDatabase(log.workload_path, log.record_path)):
        top = db.get_top_k(db.commit_workload(w.mod), 1)[0]
        assert [float(s) for s in top.run_secs] == pytest.approx(secs)
    # a new workload is appended to the workload file
    n_workloads = len(lazy.workloads)
    new = tvm.IRModule({"main": hanging_kernel})
    lazy.commit_workload(new)
    assert len(log.database(check=False).workloads) == n_workloads + 1
    assert ms.database.JSONDatabase(log.workload_path, log.record_path).has_workload(new)


@pytest.mark.quick
def test_schedule_hashes_are_kept_and_match_a_full_replay(tmp_path):
    log = _copy_log(tmp_path / "log")
    lazy = log.database(check=False)
    full = ms.database.JSONDatabase(log.workload_path, log.record_path)
    first = {}
    for w in lazy.workloads:  # as a resumed run starts: every record replayed once
        first[w] = log.measured(lazy, w.mod)
        old = {tvm_ffi.structural_hash(_replayed(r)) for r in
               full.get_top_k(full.commit_workload(w.mod), 1 << 30)}
        assert first[w] == old and first[w]
    replayed = log.save_hashes()
    assert replayed == sum(len(lazy.bodies(w)) for w in lazy.workloads)
    again = TuningLog(log.path)  # the next start: the kept hashes, nothing replayed
    db = again.database(check=False)
    assert all(again.measured(db, w.mod) == first[w] for w in lazy.workloads)
    assert again._replayed == 0
    # hashes written under another TVM version, or a torn file, are not used: replayed again
    data = json.loads(open(log.hash_path).read())
    for text in (json.dumps({**data, "stamp": "schedule-hashes-v1 tvm 0.0"}), "{\"stamp\": "):
        with open(log.hash_path, "w") as f:
            f.write(text)
        third = TuningLog(log.path)
        assert all(third.measured(db, w.mod) == first[w] for w in lazy.workloads)
        assert third._replayed == replayed


def _replayed(rec):
    sch = Schedule(rec.workload.mod)
    rec.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod


def _copy_log(dst) -> TuningLog:
    shutil.copytree(COMMITTED_LOG, dst)
    return TuningLog(str(dst))


@pytest.mark.quick
def test_damaged_log_is_reported_and_set_aside(tmp_path, rng, capsys):
    log = _copy_log(tmp_path / "log")
    lines = open(log.record_path).readlines()
    bad_at = int(rng.integers(1, len(lines) - 1))
    lines[bad_at] = lines[bad_at][: len(lines[bad_at]) // 2] + "\n"  # a corrupt record
    with open(log.record_path, "w") as f:
        f.writelines(lines)
        f.write(lines[0][:37])  # a torn last line (power cut mid-write)
    assert cli.main(["log", "show", log.path]) == 0
    out = capsys.readouterr().out
    assert f"{log.record_path}:{bad_at + 1}: bad record" in out
    assert f"{log.record_path}:{len(lines) + 1}: bad record" in out
    assert os.path.getsize(log.record_path) > 0 and not os.path.exists(
        log.record_path + ".rejected"), "show must change nothing"
    report = log.check(report_to=None)
    assert sorted(r[1] for r in report.rejected) == [bad_at + 1, len(lines) + 1]
    assert report.records == len(lines) - 1
    rejected = [json.loads(x) for x in open(log.record_path + ".rejected")]
    assert [r["line"] for r in rejected] == [bad_at + 1, len(lines) + 1]
    assert rejected[0]["text"] == lines[bad_at].rstrip("\n")  # set aside, not dropped
    assert len(log.database(check=False).get_all_tuning_records()) == len(lines) - 1

    # failed trials keep their reasons next to the records, and show counts them by reason
    errors = TrialErrors(log, ["fused_conv2d", "fused_matmul"])
    ok = ms.builder.BuilderResult("/nowhere/candidate.so", None)
    errors.apply(ms.task_scheduler.TaskScheduler.create("round-robin"), 1, [],
                 [ok, ms.builder.BuilderResult(None, "build failed: out of registers"), ok],
                 [ms.runner.RunnerResult(None, "run timed out after 2 s on a server of key 'k'"),
                  ms.runner.RunnerResult(None, None), ms.runner.RunnerResult([1e-3], None)])
    assert errors.count == 2
    assert [(e["task"], e["stage"]) for e in read_errors(log)] == [
        ("fused_matmul", "run"), ("fused_matmul", "build")]
    assert cli.main(["log", "show", log.path]) == 0
    out = capsys.readouterr().out
    assert "failed trials with their reasons (2 in" in out
    assert "1 x run timed out after 2 s" in out and "1 x build failed: out of registers" in out


def test_log_show_check_merge(tmp_path, capsys):
    whole = read_log(COMMITTED_LOG)
    rows = whole.records
    # two "devices": halves of the committed log, with some records in both
    a, b = tmp_path / "a", tmp_path / "b"
    for dst in (a, b):
        shutil.copytree(COMMITTED_LOG, dst)
    recs = open(os.path.join(COMMITTED_LOG, "database_tuning_record.json")).readlines()
    half = len(recs) // 2
    open(a / "database_tuning_record.json", "w").writelines(recs[: half + 5])
    open(b / "database_tuning_record.json", "w").writelines(recs[half:])
    out_dir = str(tmp_path / "merged")
    assert cli.main(["log", "merge", str(a), str(b), "--out", out_dir]) == 0
    out = capsys.readouterr().out
    assert f"{len(rows)} distinct records (5 duplicate(s) kept once)" in out
    merged = read_log(out_dir)
    key = lambda c: sorted((c.workloads[w][1], json.dumps(body, sort_keys=True))  # noqa: E731
                           for w, body in c.records)
    assert key(merged) == key(whole)
    # idempotent, and MetaSchedule reads the result
    assert cli.main(["log", "merge", str(a), "--out", out_dir]) == 0
    assert f"{len(rows)} distinct records ({half + 5} duplicate(s)" in capsys.readouterr().out
    assert len(read_log(out_dir).records) == len(rows)
    db = TuningLog(out_dir).database(check=False)
    assert len(db.get_all_tuning_records()) == len(rows)

    assert cli.main(["log", "show", out_dir]) == 0
    out = capsys.readouterr().out
    assert f"{len(whole.workloads)} workloads, {len(rows)} records" in out
    best = min(mean_seconds(body) for _, body in rows) * 1e3
    assert f"{best:.4f}" in out

    assert cli.main(["log", "check", out_dir, "--model", "mobilenet_v2", "--width", "0.35",
                     "--resolution", "64", "--classes", "10", "--batch", "8",
                     "--untuned", "3"]) == 0
    out = capsys.readouterr().out
    found = re.search(r": (\d+)/(\d+) tasks tuned, \d+\.\d% of FLOPs", out)
    tuned, total = map(int, found.groups())
    # with no default times cached, the untuned tasks are those without a record, 3 listed
    assert f"untuned: {total - tuned} of {total} tasks have no record faster" in out
    table = out[out.index("best record ms"):].splitlines()[1:]
    assert len(table) == 4 and table[3].strip() == f"({total - tuned - 3} more)"
    # another model's log: nothing of it is tuned, and the check says so
    assert cli.main(["log", "check", out_dir, *TINY]) == 1
    out = capsys.readouterr().out
    assert "0/" in out and "belong to no task of this model" in out and "tune it first" in out


# ---- bad input --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export") / "alexnet")
    assert cli.main(["export", *TINY, "--out", out]) == 0
    return out


def _fails(capsys, argv, *needles):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    for n in needles:
        assert n in err, (n, err)
    assert "Traceback" not in err
    return err


def test_bad_input_is_named_with_its_fix_and_leaves_nothing(tmp_path, capsys, export_dir,
                                                            tracker, rng):
    from thomas_tune.models import build, init_params, save_checkpoint
    from thomas_tune.runtime import Session

    _fails(capsys, ["tasks", "--model", "resnet50"], "unknown model 'resnet50'",
           "mobilenet_v2")
    _fails(capsys, ["tasks", "--target", '{"kind": "opencl"'], "invalid JSON")
    log = tmp_path / "log"
    closed = _free_port()
    _fails(capsys, ["tune", *TINY, "--tracker", f"127.0.0.1:{closed}", "--key", "k",
                    "--wait", "1", "--log", str(log)],
           f"cannot reach the tracker at 127.0.0.1:{closed}", "thomas-tune rpc tracker")
    wrong = _key(rng, "no-such-device")
    _fails(capsys, ["tune", *TINY, "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", wrong,
                    "--wait", "1", "--log", str(log)],
           f"no free device server with key {wrong!r}", "thomas-tune rpc server")
    assert not log.exists()

    junk = tmp_path / "net.onnx"
    junk.write_bytes(rng.bytes(2048))
    out = tmp_path / "net.npz"
    _fails(capsys, ["import-onnx", str(junk), "--model", "alexnet", "--out", str(out)],
           "is not a readable ONNX model")
    assert not out.exists()

    image = tmp_path / "photo.png"
    image.write_bytes(rng.bytes(512))
    _fails(capsys, ["infer", "--export", export_dir, str(image)],
           f"image {str(image)!r} cannot be read", "give image files")
    data = tmp_path / "data"
    for c in ("a", "b"):
        (data / c).mkdir(parents=True)
        (data / c / "x.jpg").write_bytes(rng.bytes(300))
    saved = tmp_path / "tuned.npz"
    _fails(capsys, ["train", "--export", export_dir, "--data", str(data), "--steps", "1",
                    "--save", str(saved)], "cannot be read", "remove or replace it")
    assert not saved.exists()

    session = Session(export_dir)
    shape = session.model.input_shape(1)
    with pytest.raises(ValueError, match=r"expected float32 \(1, 3, 63, 63\)"):
        session.predict(rng.standard_normal((1, 3, 64, 64)).astype("float32"))
    before = session.tensors()

    other = build("mobilenet_v1", num_classes=5, resolution=64, width=0.25)
    ckpt = tmp_path / "mnv1.npz"
    save_checkpoint(str(ckpt), other, init_params(other))
    _fails(capsys, ["train", "--export", export_dir, "--checkpoint", str(ckpt), "--data",
                    "digits", "--steps", "1", "--save", str(saved)],
           "holds mobilenet_v1", f"export again with --checkpoint {ckpt}")
    assert not saved.exists()
    after = Session(export_dir).tensors()
    assert all(np.array_equal(before[k], after[k]) for k in before) and shape[1] == 3

    old = tmp_path / "old-export"
    shutil.copytree(export_dir, old)
    manifest = json.load(open(old / "manifest.json"))
    manifest["format"] = "thomas_tune.export/0"
    json.dump(manifest, open(old / "manifest.json", "w"))
    _fails(capsys, ["bench", "--export", str(old), "--steps", "1"],
           "export format version 0", "export the model again")


def test_tune_match_names_what_is_wrong(tmp_path, capsys, rng):
    """'tune --match' with a pattern that is not a regular expression, or that matches no task
    name or workload key, fails with the pattern and the command that lists task names; no log
    is made."""
    log = tmp_path / "log"
    _fails(capsys, ["tune", *TINY, "--tracker", "127.0.0.1:9", "--key", "k", "--match", "(",
                    "--log", str(log)], "--match '(' is not a regular expression")
    key = _key(rng, "match")
    with rpc.loopback(key=key, servers=1, lifetime=120) as addr:
        _fails(capsys, ["tune", *TINY, "--tracker", f"{addr[0]}:{addr[1]}", "--key", key,
                        "--match", "no_such_kernel", "--log", str(log)],
               "no task name or workload key matches --match 'no_such_kernel'",
               "'thomas-tune tasks'")
    assert not log.exists()


def test_tune_whose_trials_all_fail_exits_non_zero(tmp_path, capsys, rng):
    """A tuning run in which every trial fails (here every timed run is over a trial timeout of
    1 us) ends with status 3 and says so on stderr: how many of how many trials failed and the
    first error; the failed trials are in the tuning log. The same with one trial of two
    failing and ``--max-failed-share`` above a half is no failure (checked on the report)."""
    from thomas_tune.tuning.report import TaskProgress, TuneReport
    key = _key(rng, "allfail")
    log = tmp_path / "log"
    with rpc.loopback(key=key, servers=1, lifetime=400) as addr:
        rc = cli.main(["tune", *TINY, "--tracker", f"{addr[0]}:{addr[1]}", "--key", key,
                       "--top", "1", "--trials", "2", "--trials-per-iter", "2", "--population",
                       "8", "--genetic-iters", "1", "--trial-timeout", "0.000001",
                       "--build-workers", "1", "--log", str(log)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "error: tuning failed: 2 of 2 trials failed (100%, more than 50%)" in err, err
    assert "first errors: " in err and "the timed runs took over 1e-06 s" in err, err
    records = [json.loads(ln) for ln in open(log / "database_tuning_record.json") if ln.strip()]
    assert len(records) == 2 and all(min(r[1][1]) >= 1e9 for r in records), records
    half = TuneReport(tasks=[TaskProgress("t", 1.0, trials=2, errors=1, first_error="e")])
    assert half.failure(0.5) is None and half.failure(0.4).startswith("1 of 2 trials failed")


def test_tune_unroll_options_name_what_is_wrong(tmp_path, capsys):
    """'tune --max-unroll' below 16 (one unroll limit or none left to choose among), a
    negative '--refine-top' and '--genetic-iters 0' fail before the tracker is contacted,
    naming the option and the fix; no log is made."""
    log = tmp_path / "log"
    base = ["tune", *TINY, "--tracker", "127.0.0.1:9", "--key", "k", "--log", str(log)]
    _fails(capsys, [*base, "--max-unroll", "8"], "--max-unroll 8 leaves the search fewer",
           "give 16 or more")
    _fails(capsys, [*base, "--max-unroll", "64", "--refine-top", "-1"],
           "--refine-top -1 is negative")
    _fails(capsys, [*base, "--genetic-iters", "0"], "--genetic-iters 0 leaves the search no "
           "mutation", "give 1 or more")
    assert not log.exists()


# ---- network exposure -------------------------------------------------------------------------
def test_rpc_binds_loopback_and_warns_otherwise(capsys):
    assert rpc.exposure_warning("127.0.0.1", "device server") is None
    assert rpc.exposure_warning("localhost", "RPC tracker") is None
    assert rpc.exposure_warning("::1", "RPC tracker") is None
    for host in ("0.0.0.0", "192.168.1.20", "::"):
        msg = rpc.exposure_warning(host, "device server")
        assert msg and "no authentication" in msg and "run code on the device" in msg
    t = rpc.start_tracker("0.0.0.0", port=_free_port())
    try:
        err = capsys.readouterr().err
        assert "RPC tracker listens on every network interface" in err
    finally:
        t.terminate()
    t = rpc.start_tracker()
    try:
        assert "warning" not in capsys.readouterr().err
        conns = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN"
                 and c.laddr.port == t.port]
        assert conns and all(c.laddr.ip == "127.0.0.1" for c in conns)
    finally:
        t.terminate()
