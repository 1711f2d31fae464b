"""Tuning over a real tvm.rpc tracker and device server on 127.0.0.1: records are written,
a resumed run measures no candidate twice, a corrupt record is reported and set aside."""

import json
import os
import time

import pytest

from thomas_tune.training_graph import graph as G
from thomas_tune import rpc
from thomas_tune.models import build
from thomas_tune.target import parse_target
from thomas_tune.tasks import extract, key, matching
from thomas_tune.tuning import rpc_runner, tune
from thomas_tune.logs import TuningLog


#: one build process per tuning run or measurement of default schedules: they build 1 to 6
#: kernels a batch, and each build process starts by importing TVM (about 1.4 s of CPU)
ONE = dict(builder_workers=1)
#: the runs that count trials and records: an evolutionary search of 16 per round (as the
#: pipelined run's), not the default 128, whose scoring and mutation they do not need
SMALL_SEARCH = dict(ONE, population=16)


@pytest.fixture(scope="module")
def cpu_server():
    """One loopback tracker and device server of key ``test-cpu`` for the runs of this file,
    each with its own log and runner (a runner holds the one server until it is shut down:
    every test shuts its runners down, tune() its own): started once instead of once per test
    (about 3 s of CPU and 4 s of wall time each). Yields the tracker's (host, port)."""
    with rpc.loopback(key="test-cpu", servers=1, lifetime=1800) as addr:
        yield addr


@pytest.fixture(scope="module")
def small_tasks():
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tasks = extract({"infer": G.inference_module(model, 1)}, parse_target("llvm"))
    # two cheap kernels with small search spaces: duplicates are likely, runs are quick (not a
    # BatchNorm's fold: its space holds fewer schedules than the test's 8 trials)
    cheap = sorted((t for t in tasks if t.flops > 0 and not t.name.startswith("bn_fold")),
                   key=lambda t: t.flops)
    return cheap[:2]


def _records(log):
    with open(log.record_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_tune_resume_and_corrupt_record(tmp_path, small_tasks, cpu_server):
    target = parse_target("llvm")
    log = TuningLog(str(tmp_path / "log"))
    r1 = tune(small_tasks, target, log, rpc_runner(cpu_server, "test-cpu"), trials=8,
              trials_per_iter=4, show_progress=False, **SMALL_SEARCH)
    first = _records(log)
    assert r1.trials == 8 and len(first) == 8
    assert r1.resumed_records == 0

    # a killed run leaves a torn last line: it is reported, set aside, never silently lost
    with open(log.record_path, "a") as f:
        f.write('[0, [[["GetSBlock", [], ["pad_te')
    report = log.check(report_to=None)
    assert len(report.rejected) == 1 and report.records == 8
    assert os.path.exists(log.record_path + ".rejected")

    r2 = tune(small_tasks, target, log, rpc_runner(cpu_server, "test-cpu"), trials=8,
              trials_per_iter=4, seed=1, show_progress=False, **SMALL_SEARCH)
    assert r2.resumed_records == 8
    database = log.database()
    for task in small_tasks:
        n = len([r for r in database.get_all_tuning_records()
                 if r.workload.mod.script() == database.commit_workload(task.mod).mod.script()])
        # every record of a workload is a different schedule: nothing was measured twice
        assert len(log.measured(database, task.mod)) == n
    assert len(_records(log)) == 8 + r2.trials


def test_wait_for_key_names_the_missing_key(cpu_server):
    with pytest.raises(TimeoutError, match="absent"):
        rpc.wait_for_key(cpu_server, "absent", timeout=1.0)


def test_bad_tracker_address():
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpc.parse_address("localhost:abc")


def test_default_times_are_cached_per_schedule_rules(tmp_path, small_tasks, capsys, cpu_server):
    """``tune --time-share`` ranks tasks by their default-schedule times, cached in the log
    folder: a second call measures nothing; a kernel the rules now make differently is
    measured again, and no time of a cache of another TVM or target is used."""
    from thomas_tune.tuning import (DEFAULT_LATENCY, defaults_stamp, measure_defaults,
                                    read_default_times)
    from thomas_tune.tasks import key as workload_key
    target = parse_target("llvm")
    log = TuningLog(str(tmp_path / "log"))
    # one runner for both measurements: a second one would wait for the one server, which
    # the first keeps until it is shut down
    runner = rpc_runner(cpu_server, "test-cpu")
    first = measure_defaults(small_tasks, target, runner, log, **ONE)
    assert set(first) == {workload_key(t) for t in small_tasks}
    assert all(0 < v < 1 for v in first.values()), first
    path = os.path.join(log.path, DEFAULT_LATENCY)
    with open(path) as f:
        cached = json.load(f)
    assert cached["stamp"] == defaults_stamp(target)
    # all cached: no runner is needed
    assert measure_defaults(small_tasks, target, None, log) == first
    # a kernel that the rules now make differently is measured again, the other is kept
    one, other = (workload_key(t) for t in small_tasks)
    assert set(cached["schedules"]) == {one, other}
    cached["schedules"][one] = "a kernel of other rules"
    cached["seconds"] = {one: 123.0, other: 456.0}
    with open(path, "w") as f:
        json.dump(cached, f)
    again = measure_defaults(small_tasks, target, runner, log, **ONE)
    runner.shutdown()
    assert "1 kernel(s)" in capsys.readouterr().err
    assert 0 < again[one] < 1 and again[other] == 456.0
    with open(path) as f:
        cached = json.load(f)
    assert cached["stamp"] == defaults_stamp(target)
    assert cached["seconds"][other] == 456.0 and cached["seconds"][one] == again[one]
    # another TVM or target: no time of the cache is used
    wanted = {workload_key(t): t.mod for t in small_tasks}
    assert read_default_times(log.path, target, wanted) == again
    cached["stamp"] = "another TVM"
    with open(path, "w") as f:
        json.dump(cached, f)
    assert read_default_times(log.path, target, wanted) is None


def test_records_slower_than_the_default_schedule_are_not_compiled(tmp_path, small_tasks,
                                                                   cpu_server):
    """``export`` and ``replay`` compile with :func:`tuned_database`: a workload whose best
    record lost to its default schedule on the device keeps the default."""
    from thomas_tune.compiler.compile import tuned_database
    from thomas_tune.tuning import DEFAULT_LATENCY, default_schedule_key, defaults_stamp
    from thomas_tune.tasks import key as workload_key
    target = parse_target("llvm")
    log = TuningLog(str(tmp_path / "log"))
    tune(small_tasks, target, log, rpc_runner(cpu_server, "test-cpu"), trials=4,
         trials_per_iter=2, show_progress=False, **SMALL_SEARCH)
    fast, slow = small_tasks
    # without default times every record is used
    db, slower = tuned_database(log, target)
    assert slower == 0 and db.has_workload(fast.mod) and db.has_workload(slow.mod)
    # default times as `tune --time-share` caches them: the first task's default beats any
    # record (0 s), the second's never does (it failed to run)
    with open(os.path.join(log.path, DEFAULT_LATENCY), "w") as f:
        json.dump({"stamp": defaults_stamp(target),
                   "seconds": {workload_key(fast): 0.0, workload_key(slow): None},
                   "schedules": {workload_key(t): default_schedule_key(t.mod, target)
                                 for t in (fast, slow)}}, f)
    db, slower = tuned_database(log, target)
    assert slower == 1
    assert not db.has_workload(fast.mod)
    # `tune --untuned` picks the same task: the one whose record lost to its default schedule;
    # with no default time, a task with a record is left out; in an empty log every task counts
    from thomas_tune.tuning.defaults import untuned
    times = {workload_key(fast): 0.0, workload_key(slow): float("inf")}
    assert untuned(small_tasks, times, log) == [fast]
    assert untuned(small_tasks, {}, log) == []
    assert untuned(small_tasks, times, TuningLog(str(tmp_path / "empty"))) == small_tasks
    assert db.has_workload(slow.mod)
    top = db.get_top_k(db.commit_workload(slow.mod), 1)
    assert len(top) == 1 and all(s < 1 for s in top[0].run_secs)
    # the kept record compiles into the graph and computes what the default schedule does
    import numpy as np
    import tvm
    from tvm import relax

    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.models import init_params, spec
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    mod = G.inference_module(model, 1)
    params = init_params(model, seed=3)
    s = spec(model)
    names = [p.name for p in s.params] + [p.name for p in s.states]
    x = np.random.default_rng().standard_normal(model.input_shape(1)).astype("float32")
    outs = []
    for database in (db, None):
        vm = relax.VirtualMachine(compile_graph(mod, target, database), tvm.cpu())
        args = [tvm.runtime.tensor(x)] + [tvm.runtime.tensor(params[n]) for n in names]
        outs.append(vm[G.PREDICT](*args).numpy())
    assert np.abs(outs[1]).max() > 0
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    # times of other rules or another target are not trusted: every record is used again
    db, slower = tuned_database(log, parse_target("opencl"))
    assert slower == 0 and db.has_workload(fast.mod)


def test_index_arguments_are_measured_in_range(cpu_server):
    """Integer arguments of a measured kernel (labels, gather indices) get values in range: a
    gather from a 2-element table, timed on a device server, measures instead of crashing it."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    from thomas_tune.measure.kept import keep_builder, take_builder
    table = te.placeholder((2,), name="table")
    idx = te.placeholder((4096,), dtype="int64", name="idx")
    out = te.compute((4096,), lambda i: table[idx[i]] * 2.0, name="out")
    mod = tvm.IRModule({"main": te.create_prim_func([table, idx, out])})
    target = parse_target("llvm")
    builder = take_builder(1, 60.0)  # as a tuning run's
    try:
        (built,) = builder.build([ms.builder.BuilderInput(mod, target)])
    finally:
        keep_builder(builder)
    assert built.error_msg is None, built.error_msg
    runner = rpc_runner(cpu_server, "test-cpu", trial_timeout_s=30)
    try:
        (fut,) = runner.run([RunnerInput(built.artifact_path, "cpu",
                                         ArgInfo.from_prim_func(mod["main"]))])
        res = fut.result()
    finally:
        runner.shutdown()
    assert res.error_msg is None, res.error_msg
    assert all(0 < float(s) < 1 for s in res.run_secs)


def test_pipelined_scheduler_searches_while_the_device_measures(tmp_path, small_tasks, cpu_server):
    """With ``max_in_flight`` 3, batches are sent to the runner while earlier ones are still
    being measured (the host searches and builds meanwhile); with 1, never. Both runs spend
    the budget exactly, and every trial ends up in the log."""
    import fcntl
    import threading

    from thomas_tune.measure.priority import device_lock_path
    from thomas_tune.measure.runner import FarmRunner

    class Watched(FarmRunner._cls):
        """The product's runner, noting at each batch how many earlier trials are unfinished;
        ``busy``: the device stays busy until the second batch is sent."""

        def __init__(self, *a, busy=None, **k):
            super().__init__(*a, **k)
            self.futures, self.pending_at_submit, self.busy = [], [], busy

        def run(self, runner_inputs):
            self.pending_at_submit.append(sum(1 for f in self.futures if not f.done()))
            if self.busy is not None and len(self.pending_at_submit) == 2:
                self.busy.set()
            out = super().run(runner_inputs)
            self.futures += out
            return out

    def keep_device_busy(until: threading.Event) -> None:
        """Hold the device lock that a device server takes for its timed runs (as another
        tuner's timed runs on the same device hold it) until ``until`` is set, 120 s at most:
        the first batch cannot finish before the second is sent, however fast its trials."""
        fd = os.open(device_lock_path(), os.O_CREAT | os.O_RDWR, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def release():
            until.wait(120)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        threading.Thread(target=release, daemon=True).start()

    from tvm.ir.utils import derived_object
    Watched = derived_object(Watched)
    target = parse_target("llvm")
    seen = {}
    for in_flight in (1, 3):
        log = TuningLog(str(tmp_path / f"log{in_flight}"))
        busy = threading.Event() if in_flight > 1 else None
        runner = Watched(cpu_server, "test-cpu", busy=busy)
        if busy is not None:
            keep_device_busy(busy)
        try:
            report = tune(small_tasks, target, log, runner, trials=12, trials_per_iter=6,
                          show_progress=False, **ONE, max_in_flight=in_flight, seed=in_flight,
                          population=16)
        finally:
            if busy is not None:
                busy.set()
        assert report.trials == 12 and len(_records(log)) == 12
        assert all(float(r[1][1][0]) < 1e9 for r in _records(log)), "a trial failed"
        seen[in_flight] = runner.pending_at_submit
        split = report.time_split()
        assert split["search"] > 0 and split["build"] > 0 and 0 < split["lanes_busy"] <= 1
        assert 0 <= split["lanes_idle"] < 1 and 0 < report.cpu_busy <= 1
        # the tuner's own time after each batch is measured, not left in the rest
        assert split["cost_model"] > 0
        parts = sum(split[k] for k in ("search", "build", "wait_device", "refine",
                                       "cost_model", "references", "other"))
        assert abs(parts - split["total"]) < 1e-6 * split["total"] + 1e-3, split
    assert max(seen[1]) == 0, seen
    assert max(seen[3]) > 0, seen


def test_gradient_starts_from_the_default_schedule_time():
    """The task with the most default-schedule time x calls is tuned first after the first
    round; a task whose record beats its default less than another's gains ranks lower."""
    from thomas_tune.tuning.task_scheduler import PipelinedGradient
    s = PipelinedGradient([2.0, 0.5, None], window=2)
    s._init(3)
    assert s.history == [[2.0], [0.5], []]
    g = [s._gradient(i, w) for i, w in enumerate((1.0, 10.0, 5.0))]
    assert g[1] > g[0] > g[2] == 0.0  # 0.5 ms x 10 calls > 2 ms x 1 call; unknown: no gradient
    s.history = [[2.0, 1.0, 0.2], [2.0, 2.0, 2.0]]
    # the first task improved fast (backward term) yet its time is small; the second is stuck
    g0, g1 = s._gradient(0, 1.0), s._gradient(1, 1.0)
    assert g1 > g0 > 0  # a stuck task holding 10x the time ranks above a small fast one
    assert s._gradient(1, 3.0) == pytest.approx(3 * g1)  # three calls per step: 3x the gain
    s.history = [[2.0, 1.0, 0.2], [2.0, 1.0, 0.6]]  # same start, the second improved less
    assert s._gradient(0, 1.0) < s._gradient(1, 1.0)  # ... and has more time left to win
    with pytest.raises(ValueError, match="max_in_flight"):
        PipelinedGradient(max_in_flight=0)


def test_the_host_joins_the_first_batch_to_finish_not_the_oldest():
    """With the bound of batches in flight reached, the scheduler waits for whichever batch
    finishes first: a slow trial in the oldest batch (a long OpenCL build) does not hold the
    host while later batches are done and the device servers run out of trials. The wait is
    counted as ``wait_device``."""
    import threading
    import types

    from thomas_tune.measure.phases import Phases
    from thomas_tune.tuning.task_scheduler import PipelinedGradient, finished

    class Future:
        def __init__(self, done: bool):
            self.is_done = done

        def done(self) -> bool:
            return self.is_done

    slow = Future(False)  # the oldest batch's last trial: still out for the whole test
    late = Future(False)  # the second batch's last trial: comes back after 0.1 s
    tasks = [types.SimpleNamespace(runner_futures=[Future(True), slow]),
             types.SimpleNamespace(runner_futures=[Future(True), late]),
             types.SimpleNamespace(runner_futures=None)]  # a task whose search ended
    assert finished([0, 1], tasks) == [] and finished([0, 2], tasks) == [2]
    phases = Phases()
    s = PipelinedGradient(max_in_flight=2, phases=phases)
    inst = s._inst
    joined = []

    def join(task_id, _tasks):  # what MetaSchedule's join would record
        joined.append(task_id)
        inst.order.remove(task_id)

    inst._join = join
    inst.order = [0, 1]
    timer = threading.Timer(0.1, lambda: setattr(late, "is_done", True))
    timer.start()
    try:
        s._join_first(tasks)
    finally:
        timer.cancel()
    assert joined == [1] and inst.order == [0]
    assert phases.wall["wait_device"] >= 0.09 and phases.counts["wait_device"] == 1


def test_a_stop_ends_the_wait_for_a_batch_and_sends_no_new_one():
    """A signal sets ``stopping`` (thomas_tune.tuning): a host waiting for a batch of the device
    stops waiting at once, and the scheduler hands MetaSchedule -1 (no new batch), which then
    joins the batches in flight itself; no exception goes through MetaSchedule's C++ loop."""
    import threading
    import types

    from thomas_tune.tuning.task_scheduler import PipelinedGradient

    deadline = time.perf_counter() + 3.0

    class Future:
        def done(self) -> bool:  # back after 3 s: the stop, at 0.2 s, ends the wait first
            return time.perf_counter() > deadline

    tasks = [types.SimpleNamespace(runner_futures=[Future()], is_terminated=False,
                                   task_weight=1.0) for _ in range(2)]
    s = PipelinedGradient([1.0, 1.0], max_in_flight=2)
    inst = s._inst
    inst._outer = lambda: types.SimpleNamespace(tasks_=tasks)
    inst._init(2)
    inst.first_round, inst.order = [], [0, 1]  # both tasks have a batch out: the host waits
    timer = threading.Timer(0.2, lambda: setattr(inst, "stopping", True))
    timer.start()
    t0 = time.perf_counter()
    try:
        assert s.next_task_id() == -1
    finally:
        timer.cancel()
    assert 0.15 <= time.perf_counter() - t0 < 2.5 and inst.order == [0, 1]
    assert s.next_task_id() == -1  # and stays so


@pytest.mark.quick
def test_resumed_tasks_start_from_their_best_record_and_skip_the_first_round():
    """A task with records in the resumed tuning log starts from its best record (or its
    default, where that is faster) and is not owed a first-round batch; only tasks never
    measured get one, in task order."""
    from thomas_tune.tuning.task_scheduler import PipelinedGradient
    s = PipelinedGradient([2.0, 0.5, None, 1.0, None], tuned_ms=[None, 0.3, 0.8, 1.5, None])
    s._init(5)
    assert s.history == [[2.0], [0.5, 0.3], [0.8], [1.0, 1.0], []]
    assert s.first_round[::-1] == [0, 4]
    # after the first round, a resumed task competes by its gradient: 0.8 * 0.3 / 2 x 10 calls
    assert s._gradient(1, 10.0) == pytest.approx(0.8 * 0.3 / 2 * 10)


def test_builder_processes_run_at_raised_niceness():
    """Candidate builds leave the CPU to timed runs on a machine that does both."""
    from thomas_tune.measure.kept import keep_builder, take_builder
    from thomas_tune.measure.priority import COMPILE_NICE
    builder = take_builder(1, 60.0)  # as a tuning run's
    try:
        worker = builder._get_pool().submit(os.getpriority, os.PRIO_PROCESS, 0).result()
    finally:
        keep_builder(builder)
    assert worker == min(os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICE, 19)


def test_workers_are_kept_for_the_next_run_of_the_same_environment(monkeypatch):
    """A run hands its build and lane processes to the next run of the process, never to one
    whose environment differs (a build process's ``TVM_NDK_CC`` is fixed when it starts)."""
    from thomas_tune.measure import kept
    # settings of this test alone: a builder kept by an earlier test may be due to replace
    # its process (Builder.recycle_after), which would change the pid compared below
    builder = kept.take_builder(1, 999.0)
    first = builder._get_pool().submit(os.getpid).result()
    kept.keep_builder(builder)
    lane, key = kept.take_lane_worker()
    lane.send(os.getpid)
    lane_pid = lane.recv()
    kept.keep_lane_worker(lane, key)
    monkeypatch.setenv("TVM_NDK_CC", "/elsewhere/clang++")
    other = kept.take_builder(1, 999.0)
    assert other is not builder and kept.take_lane_worker()[0] is not lane
    other.shutdown()
    monkeypatch.undo()  # the first environment again: its processes, already started
    again = kept.take_builder(1, 999.0)
    assert again is builder and again._get_pool().submit(os.getpid).result() == first
    lane_again, _ = kept.take_lane_worker()
    lane_again.send(os.getpid)
    assert lane_again is lane and lane_again.recv() == lane_pid
    lane_again.kill()
    monkeypatch.setenv("TVM_NDK_CC", "/elsewhere/clang++")
    kept.keep_builder(again)  # made in another environment than this one: shut down
    assert again._pool is None
    monkeypatch.undo()
    # however many settings and environments a process goes through, few wait
    many = [kept.take_builder(1, 1000.0 + n) for n in range(kept.KEEP_BUILDERS + 1)]
    for b in many:
        kept.keep_builder(b)
    waiting = [b for _, b in kept._BUILDERS]
    assert len(waiting) == kept.KEEP_BUILDERS and not any(b is many[0] for b in waiting)


def test_remeasure_replaces_noisy_times_in_place(tmp_path, small_tasks, cpu_server):
    """A record timed under load (here: its times inflated 1000x in the file) is timed again
    through the device server and its new time replaces the old; every other line of the log
    stays as it was, and the log still parses."""
    from thomas_tune.tuning.remeasure import remeasure
    from thomas_tune.tuning import measure_defaults
    from thomas_tune.tasks import key as workload_key
    target = parse_target("llvm")
    log = TuningLog(str(tmp_path / "log"))
    runner = rpc_runner(cpu_server, "test-cpu")
    tune(small_tasks, target, log, runner, trials=6, trials_per_iter=3,
         show_progress=False, **SMALL_SEARCH)
    with open(log.record_path) as f:
        lines = [line for line in f if line.strip()]
    bodies = [json.loads(line) for line in lines]
    ok = [i for i, (_, b) in enumerate(bodies) if max(b[1]) < 1e9]
    assert len(ok) >= 2
    noisy = ok[0]
    true_s = sum(bodies[noisy][1][1]) / len(bodies[noisy][1][1])
    bodies[noisy][1][1] = [s * 1000 for s in bodies[noisy][1][1]]
    lines[noisy] = json.dumps(bodies[noisy]) + "\n"
    with open(log.record_path, "w") as f:
        f.writelines(lines)
    keys = {workload_key(t) for t in small_tasks}
    with pytest.raises(RuntimeError, match="shut down"):  # tune() shut it down
        runner.run([])
    runner = rpc_runner(cpu_server, "test-cpu")
    report = remeasure(log, target, runner, keys, top_k=10, batch=2, **ONE)
    # the default schedules measured again replace their cached times
    first = measure_defaults(small_tasks, target, runner, log, **ONE)
    again = measure_defaults(small_tasks, target, runner, log, refresh=True, **ONE)
    runner.shutdown()
    assert report.failed == 0 and report.measured == len(ok)
    assert set(report.best) <= keys
    after = [line for line in open(log.record_path) if line.strip()]
    assert len(after) == len(lines)
    for i, line in enumerate(after):
        if i not in ok:  # failed trials are not timed again: their lines are unchanged
            assert line == lines[i]
    new = json.loads(after[noisy])[1][1]
    new_s = sum(new) / len(new)
    assert new_s < true_s * 100  # back near what the kernel takes, not the inflated time
    assert log.check(report_to=None).rejected == []
    assert set(first) == set(again) and all(v > 0 for v in again.values())
    cache = json.load(open(os.path.join(log.path, "default_latency.json")))
    assert all(cache["seconds"][k] == again[k] for k in again)


def test_candidates_over_the_unroll_limit_are_lowered_to_it():
    """A candidate bred from a record tuned without ``--max-unroll`` (limit 1024 here) comes out
    of the search with the largest allowed limit, its traces in the form the search holds them
    (``Trace.as_json()``: TVM integers and floats), and the lowered schedule annotates 16."""
    from tvm import te
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.schedules import (plain_json, postprocessed, sampled_unroll,
                                       space_generator, with_unroll)
    import tvm_ffi

    from thomas_tune.tuning import ResumingSearch, UnrollLimitedView

    n = 64
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, c])})
    target = parse_target(os.path.join(os.path.dirname(__file__), "..", "targets",
                                       "h100_opencl.json"))
    strategy = ResumingSearch(max_unroll=16, population_size=16)
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_generator(target, 16),
                         search_strategy=strategy, task_name="matmul")
    clone = ctx.clone()  # as MetaSchedule searches: the clone shares the counts
    postprocs = list(ctx.space_generator.postprocs)
    def spaces(seed):  # design spaces sampling an unroll limit, their tiles drawn by ``seed``
        return [s for s in ms.TuneContext(
            mod=mod, target=target, space_generator=space_generator(target), task_name="m",
            search_strategy=ms.search_strategy.ReplayTrace(),
            rand_state=seed).generate_design_space()
            if sampled_unroll(s.trace.as_json()) is not None]

    big = None  # a schedule with limit 1024 that the postprocessors accept (tiles vary by seed)
    for seed in range(32):
        for space in spaces(seed):
            raw = space.trace.as_json()
            assert json.dumps(plain_json(raw))  # TVM's IntImm/FloatImm made plain
            big = postprocessed(mod, with_unroll(raw, 1024), postprocs)
            if big is not None:
                break
        if big is not None:
            break
    assert big is not None and sampled_unroll(big.trace.as_json())[1] == 1024
    cand = ms.MeasureCandidate(big, ms.arg_info.ArgInfo.from_prim_func(big.mod["main"]))
    low = strategy._clamp(cand)
    assert strategy.clamped == 1 and clone.search_strategy is not None
    assert sampled_unroll(low.sch.trace.as_json())[1] == 16
    assert '"pragma_auto_unroll_max_step": 16' in low.sch.mod.script()
    assert strategy._clamp(low) is low and strategy.clamped == 1  # within the limit: kept

    # the search of a run with the limit reads the log's records lowered and narrowed to the
    # allowed limits before it breeds from them; a record that samples no limit (here a layout
    # transform, whose IndexMap MetaSchedule's TuningRecord.as_json cannot write) is unchanged
    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(mod)
    db.commit_tuning_record(ms.database.TuningRecord(big.trace, workload, [1e-3], target,
                                                     cand.args_info))
    odd = tvm.s_tir.Schedule(mod)
    odd.transform_layout(odd.get_sblock("C"), ("write", 0), lambda i, j: (j, i))
    db.commit_tuning_record(ms.database.TuningRecord(odd.trace, workload, [2e-3], target,
                                                     cand.args_info))
    view = UnrollLimitedView(db, [0, 16])
    first, second = view.get_top_k(workload, 2)
    body = plain_json(first.trace.as_json())
    where, step = sampled_unroll(body)
    assert step == 16 and body[0][where][2][0] == [0, 16] and view.lowered == 1
    lowered = postprocessed(mod, body, postprocs)
    assert '"pragma_auto_unroll_max_step": 16' in lowered.mod.script()
    assert second.same_as(db.get_top_k(workload, 2)[1])
    again = postprocessed(mod, plain_json(second.trace.as_json()), [])
    assert tvm_ffi.structural_equal(again.mod, odd.mod)


def test_design_spaces_are_generated_once_per_task(small_tasks):
    """The spaces made to check a task before the run are the ones MetaSchedule's run gets:
    the generator runs once per module, its clones included."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.tuning import OnceSpaces

    calls = []

    def space(sch):
        calls.append(1)
        return sch

    task = small_tasks[0]
    gen = OnceSpaces(ms.space_generator.ScheduleFn(space, sch_rules=[], postprocs=[],
                                                   mutator_probs={}))
    ctx = ms.TuneContext(mod=task.mod, target=parse_target("llvm"), space_generator=gen,
                         task_name=task.name, num_threads=1)
    first = ctx.generate_design_space()
    second = ctx.clone().generate_design_space()
    assert len(calls) == 1 and len(first) == len(second) == 1
    assert first[0].same_as(second[0])
    assert tvm_ffi.structural_equal(first[0].mod, task.mod)


def test_cost_model_trains_on_a_quarter_of_the_cores():
    """XGBoost trains on the threads it is given (MetaSchedule's default is every core), and
    a real training and prediction go through the timed update's model."""
    import numpy as np

    from thomas_tune.measure.phases import Phases
    from thomas_tune.tuning import cost_model

    rng = np.random.default_rng()
    model = cost_model(Phases(), threads=1)
    inst = model._inst
    assert inst.config.nthread == 1
    assert cost_model(Phases())._inst.config.nthread == max(1, (os.cpu_count() or 4) // 4)
    # feature rows per candidate (one row per store) and the cost ratios MetaSchedule trains on
    xs = [rng.random((int(rng.integers(1, 4)), 164)).astype("float32") for _ in range(256)]
    ys = np.array([float(x[:, 0].sum()) for x in xs], dtype="float32")
    ys /= ys.max()
    inst._train(xs=xs, ys=ys)
    pred = inst._predict(xs=xs[:32])
    assert pred.shape == (32,) and np.all(np.isfinite(pred))
    assert np.corrcoef(pred, ys[:32])[0, 1] > 0.5


def test_match_takes_task_names_and_workload_keys(small_tasks):
    """``tune --match`` picks tasks by a regular expression over their names, or by their
    workload keys matched whole: the keys a bench's kernel table gives (its kernel names come
    from another fusion of the graph, and differ)."""
    import re

    a, b = small_tasks
    assert matching(small_tasks, re.compile(f"^{re.escape(a.name)}$")) == [a]
    assert matching(small_tasks, re.compile(key(b))) == [b]
    assert matching(small_tasks, re.compile(f"^({key(a)}|{re.escape(b.name)})$")) == [a, b]
    assert matching(small_tasks, re.compile(key(a)[:6])) == []  # part of a key: no match
    assert key(a) != key(b) and key(a).isdigit()


def test_shallow_stack_gives_the_frames_tvmscript_reads():
    """The stack TVM's tensor intrinsics are parsed with (schedules.load_tensor_intrinsics)
    holds the same frames as inspect.stack, and the source line of the one frame the parser
    reads (the third); a function parsed under it in an ir_module class is still found to be in
    the class."""
    import inspect

    import tvm
    from tvm.script import ir as I
    from tvm.script import tirx as T

    from thomas_tune.schedules.intrinsics import _shallow_stack

    def inner():
        return inspect.stack(), _shallow_stack()

    def outer():
        return inner()

    full, shallow = outer()
    assert len(full) == len(shallow) > 3
    for a, b in zip(full[1:], shallow[1:]):  # (the first is the frame that called each)
        assert (a.frame, a.filename, a.lineno, a.function) == (b.frame, b.filename, b.lineno,
                                                               b.function)
    assert full[2].code_context == shallow[2].code_context is not None
    real = inspect.stack
    inspect.stack = _shallow_stack
    try:
        @I.ir_module
        class Module:
            @T.prim_func
            def main(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
                for i in range(4):
                    b[i] = a[i] * T.float32(2)
    finally:
        inspect.stack = real
    assert inspect.stack is real and isinstance(Module, tvm.IRModule)
    assert isinstance(Module["main"], tvm.tirx.PrimFunc)


def _search_ready(task, measured: set[int]):
    """:func:`search_context`'s context and strategy for ``task`` on llvm (population 16), ready
    to propose batches of 4 from an empty database. The caller keeps the context: the
    evolutionary search reads it and does not keep it alive."""
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.tuning import search_context
    ctx, strategy = search_context(task, parse_target("llvm"), measured, population=16,
                                   genetic_iters=1, max_unroll=None, seed=0)
    strategy.pre_tuning(64, 4, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                        ms.cost_model.RandomModel())
    return ctx, strategy


def test_a_search_that_ends_before_proposing_draws_fresh_ones(small_tasks):
    """When MetaSchedule's search ends a task on its first round (it could not sample enough of
    a first population), ResumingSearch draws a batch at random from the design spaces; once it
    has proposed candidates, the search's end ends the task."""
    _ctx, strategy = _search_ready(small_tasks[0], set())

    class Ended:
        """MetaSchedule's search after 'Cannot sample enough initial population'."""
        def generate_measure_candidates(self):
            return None

    strategy.inner = Ended()
    got = strategy.generate_measure_candidates()
    assert got and len(got) == 4 and strategy.drawn == 4
    assert strategy.generate_measure_candidates() is None
    assert strategy.drawn == 4


def test_a_search_proposing_only_measured_schedules_draws_fresh_ones(small_tasks):
    """When the evolutionary search's rounds bring only schedules measured before (a task
    resumed from a long log), ResumingSearch draws a batch at random from the task's design
    spaces instead of ending the task: new schedules, postprocessed, none measured before."""
    import tvm_ffi

    from thomas_tune.schedules import plain_json

    measured: set[int] = set()
    _ctx, strategy = _search_ready(small_tasks[0], measured)
    old = strategy.inner.generate_measure_candidates()
    assert old
    for c in old:  # the search's first round, as if the log held it already
        measured.add(tvm_ffi.structural_hash(c.sch.mod))
    before = set(measured)

    class Stale:
        """A search that proposes the same measured schedules round after round."""
        def generate_measure_candidates(self):
            return old

    strategy.inner = Stale()
    got = strategy.generate_measure_candidates()
    assert got and len(got) == 4 and strategy.drawn == 4
    hashes = {tvm_ffi.structural_hash(c.sch.mod) for c in got}
    assert len(hashes) == 4 and not hashes & before and hashes <= measured
    assert strategy.skipped >= strategy.max_empty_rounds * len(old)
    for c in got:  # postprocessed as the search's own candidates are
        insts, _ = plain_json(c.sch.trace.as_json())
        assert "EnterPostproc" in [ins[0] for ins in insts]
