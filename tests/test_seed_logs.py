"""Seeding a session from another tuning log, and the code-generation stamp of a log, on PoCL
over a loopback tracker and device server: seeds are checked and measured on this device and
land in its log with its own times, the seed log is only read, a resumed run measures no seed
twice, a task whose kernel the seed log has only at another shape gets its records refitted; a
log stamped with another version is flagged by 'log check', refused by tune, export and
a partial re-measure, and 'remeasure --restamp' measures it again and stamps it."""

import hashlib
import json
import os

import pytest
import tvm
import tvm_ffi

from thomas_tune import rpc

from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL

MODEL = ["--model", "mobilenet_v2", "--width", "0.35", "--resolution", "32", "--classes", "5",
         "--batch", "1"]


def _folder_hashes(path: str) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return out


def _schedule_hash(mod, trace_json) -> int:
    sch = tvm.s_tir.Schedule(mod)
    tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace_json, sch)
    return int(tvm_ffi.structural_hash(sch.mod))


def test_seeds_are_measured_here_and_versions_are_flagged(tmp_path, target, rng, capsys):
    from thomas_tune import cli
    from thomas_tune.training_graph import graph as G
    from thomas_tune.logs import STALE, CodegenMismatch, TuningLog, mean_seconds, read_version
    from thomas_tune.logs.codegen import STAMP, current, version_id
    from thomas_tune.models import build
    from thomas_tune.tuning.remeasure import remeasure
    from thomas_tune.tasks import extract
    from thomas_tune.tasks import key as workload_key
    from thomas_tune.tuning import rpc_runner, tune

    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tasks = [t for t in extract({"infer": G.inference_module(model, 1)}, target) if t.flops > 0]
    # two small tasks, drawn afresh each run
    small = sorted(tasks, key=lambda t: t.flops)[:6]
    tasks = [small[i] for i in rng.choice(len(small), 2, replace=False)]
    seed_dir, own_dir = str(tmp_path / "seed"), str(tmp_path / "own")
    quick = dict(trials_per_iter=2, population=16, genetic_iters=1, refine_top=0,
                 show_progress=False, seed=int(rng.integers(1 << 20)), builder_workers=1)
    with rpc.loopback(key="pocl-seed", servers=1, lifetime=600) as addr:
        tune(tasks, target, TuningLog(seed_dir), rpc_runner(addr, "pocl-seed"), trials=8,
             **quick)
        assert read_version(seed_dir).status == "current"  # stamped when first tuned into
        before = _folder_hashes(seed_dir)
        seed_db = TuningLog(seed_dir).database(check=False)
        wanted = {}  # task -> {schedule hash: seed run times} of its 2 best seed records
        for t in tasks:
            bodies = seed_db.bodies(seed_db.find_workload(t.mod))[:2]
            wanted[workload_key(t)] = {_schedule_hash(t.mod, b[0]): b[1] for b in bodies}
        assert sum(map(len, wanted.values())) >= 2, wanted

        own = TuningLog(own_dir)
        report = tune(tasks, target, own, rpc_runner(addr, "pocl-seed"), trials=2,
                      seed_logs=(seed_dir,), seed_top=2, **quick)
        seeded = report.seeded
        assert seeded["measured"] == sum(map(len, wanted.values())), seeded
        # every seed (and every trial) was checked against its task's reference on the device
        assert report.phases["counts"].get("run.check", 0) >= seeded["measured"] - \
            seeded["failed"], report.phases["counts"]
        assert _folder_hashes(seed_dir) == before  # the seed log is only read

        # the seeds are in this log as its own records, with times measured here
        db = own.database(check=False)
        for t in tasks:
            workload = db.find_workload(t.mod)
            mine = {_schedule_hash(t.mod, b[0]): b[1] for b in db.bodies(workload)}
            for h, seed_secs in wanted[workload_key(t)].items():
                if h in mine:
                    assert mine[h] != seed_secs  # measured again, not copied
            got = set(wanted[workload_key(t)]) & set(mine)
            failed = len(wanted[workload_key(t)]) - len(got)
            assert failed <= seeded["failed"], (t.name, seeded)
        assert seeded["measured"] - seeded["failed"] >= 1

        # a resumed run measures no seed again
        again = tune(tasks, target, own, rpc_runner(addr, "pocl-seed"), trials=2,
                     seed_logs=(seed_dir,), seed_top=2, **quick)
        assert again.seeded["measured"] == 0, again.seeded
        assert _folder_hashes(seed_dir) == before

        # another code generation: flagged by log check, refused by tune and export
        stamp = json.load(open(os.path.join(own_dir, STAMP)))
        assert stamp["id"] == current()["id"]
        other = dict(stamp["components"], schedules="0" * 12)
        json.dump({"id": version_id(other), "components": other},
                  open(os.path.join(own_dir, STAMP), "w"))
        version = read_version(own_dir)
        assert version.status == "other" and version.differs == ["schedules"]
        capsys.readouterr()
        assert cli.main(["log", "check", own_dir, *MODEL, "--target", "opencl"]) == 1
        out = capsys.readouterr().out
        assert "FAIL: all" in out and "differs in: schedules" in out, out
        with pytest.raises(CodegenMismatch, match="remeasure --restamp"):
            tune(tasks, target, own, rpc_runner(addr, "pocl-seed"), trials=2, **quick)
        assert cli.main(["export", *MODEL, "--target", "opencl", "--log", own_dir, "--out",
                         str(tmp_path / "export")]) == 2
        assert "--any-codegen" in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "export" / "manifest.json")
        runner = rpc_runner(addr, "pocl-seed")
        keys = {workload_key(t) for t in tasks}
        with pytest.raises(CodegenMismatch, match="--seed-log"):
            remeasure(own, target, runner, keys, top_k=1)
        # restamped: the best record of each workload measured again, the others set aside
        lines_before = [json.loads(x) for x in open(own.record_path) if x.strip()]
        rep = remeasure(own, target, runner, keys, top_k=1, restamp=True)
        runner.shutdown()
    assert read_version(own_dir).status == "current"
    after = [json.loads(x) for x in open(own.record_path) if x.strip()]
    assert len(after) == rep.measured >= 1
    assert rep.stale == len(lines_before) - len(after)
    stale = [json.loads(x) for x in open(os.path.join(own_dir, STALE))]
    assert len(stale) == rep.stale and all("restamped" in s["reason"] for s in stale)
    old_times = [b[1] for _, b in lines_before]
    assert all(b[1] not in old_times and mean_seconds(b) < 1e9 for _, b in after)

    # no stamp at all: an unknown version, reported as such
    os.remove(os.path.join(own_dir, STAMP))
    assert read_version(own_dir).status == "unknown"
    cli.main(["log", "show", own_dir])
    assert "code generation unknown" in capsys.readouterr().out


def test_seeds_from_other_shapes_are_refitted_and_measured_here(tmp_path, target, rng):
    from thomas_tune.training_graph import graph as G
    from thomas_tune.logs import TuningLog, mean_seconds
    from thomas_tune.models import build
    from thomas_tune.tasks import extract
    from thomas_tune.tuning import rpc_runner, tune
    from thomas_tune.tuning.resized import family

    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    one = [t for t in extract({"infer": G.inference_module(model, 1)}, target) if t.flops > 0]
    two = [t for t in extract({"infer": G.inference_module(model, 2)}, target) if t.flops > 0]
    # tasks of batch 2 whose kernel at batch 1 (another shape, one family) is in the seed log
    kin = {family(t.mod): t for t in one}
    pairs = sorted(((kin[family(t.mod)], t) for t in two if family(t.mod) in kin),
                   key=lambda p: p[0].flops)[:6]
    pairs = [pairs[i] for i in rng.choice(len(pairs), 2, replace=False)]
    seed_dir, own_dir = str(tmp_path / "seed"), str(tmp_path / "own")
    quick = dict(trials_per_iter=2, population=16, genetic_iters=1, refine_top=0,
                 show_progress=False, seed=int(rng.integers(1 << 20)), builder_workers=1)
    with rpc.loopback(key="pocl-resize", servers=1, lifetime=600) as addr:
        tune([a for a, _ in pairs], target, TuningLog(seed_dir), rpc_runner(addr, "pocl-resize"),
             trials=8, **quick)
        before = _folder_hashes(seed_dir)
        own = TuningLog(own_dir)
        report = tune([b for _, b in pairs], target, own, rpc_runner(addr, "pocl-resize"),
                      trials=2, seed_logs=(seed_dir,), seed_top=2, **quick)
    seeded = report.seeded
    # no seed workload is one of these kernels: every seed was refitted from the other shape
    assert seeded["resized"] >= seeded["measured"] >= 2, seeded
    assert seeded["measured"] - seeded["failed"] >= 1, seeded
    assert report.phases["counts"].get("run.check", 0) >= seeded["measured"] - seeded["failed"]
    assert _folder_hashes(seed_dir) == before  # the seed log is only read
    db = own.database(check=False)
    timed = [mean_seconds(b) for _, t in pairs for b in db.bodies(db.find_workload(t.mod))]
    assert any(s < 1e9 for s in timed), timed  # measured here, on this log's own workloads


def test_a_fingerprint_follows_code_not_wording(tmp_path):
    """A component's fingerprint stays when only docstrings, comments and layout change, and
    changes with any change of code."""
    from thomas_tune.logs.codegen import _fingerprint
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    for d in (a, b, c):
        d.mkdir()
    (a / "m.py").write_text('"""One."""\n\ndef f(x):\n    """Two."""\n    return x + 1  # add\n')
    (b / "m.py").write_text('"""Another wording."""\ndef f(x):\n\n    return (x +\n        1)\n')
    (c / "m.py").write_text('"""One."""\n\ndef f(x):\n    """Two."""\n    return x + 2  # add\n')
    fps = [_fingerprint([str(d / "m.py")]) for d in (a, b, c)]
    assert fps[0] == fps[1] != fps[2]
