"""Carrying a tuning log over to a new code-generation version (thomas_tune.logs.carry): only
when every record's kernel is byte-identical under it; a change of code generation that alters
one kernel is refused, naming that record, and the stamp stays as it was."""

import dataclasses
import json
import os
import shutil

import pytest
import tvm

from thomas_tune import cli
from thomas_tune.logs import RECORDS, WORKLOADS, TuningLog, codegen, pack
from thomas_tune.logs import carry as carrying

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(ROOT, "tuning_logs", "pocl-x86_64", "mobilenet_v2-w0.35-r64-c5-b8")


def _old_version() -> dict:
    """A code-generation version that differs from this installation's in its schedules."""
    components = dict(codegen.current()["components"], schedules="0" * 12)
    return {"id": codegen.version_id(components), "components": components}


def _small_log(tmp_path, records: int = 3) -> str:
    """A plain copy of the shipped PoCL log's workloads and first ``records`` records, stamped
    with :func:`_old_version`."""
    src = TuningLog(LOG)
    dest = tmp_path / "log"
    dest.mkdir(parents=True)
    with open(src.workload_path) as f:
        (dest / WORKLOADS).write_text(f.read())
    with open(src.record_path) as f:
        (dest / RECORDS).write_text("".join([line for line in f if line.strip()][:records]))
    codegen.write_stamp(str(dest), "tune", _old_version())
    return str(dest)


def _as_old(digests: carrying.Digests) -> carrying.Digests:
    """``digests`` said to be made under :func:`_old_version`: the old code of a change that
    moved code and left every kernel as it was makes these."""
    return dataclasses.replace(digests, codegen=_old_version())


def test_identical_kernels_carry_the_log(tmp_path, capsys):
    """With the same digests under the stamped version and this one, ``log carry`` restamps the
    log with this installation's version and says how; the log is then current."""
    log = _small_log(tmp_path)
    out = tmp_path / "digests"
    assert cli.main(["log", "digests", log, "--out-dir", str(out)]) == 0
    path = out / carrying.digests_name(log)
    body = json.loads(path.read_text())
    assert body["codegen"]["id"] == codegen.current()["id"]
    assert len(body["records"]) == 3 and len(body["defaults"]) >= 1
    assert not any(d.startswith("error:") for d in body["records"].values())
    old_path = tmp_path / "old.json"
    carrying.write_digests(_as_old(carrying.read_digests(str(path))), str(old_path))
    assert TuningLog(log).version().status == "other"
    assert cli.main(["log", "carry", log, "--from-digests", str(old_path),
                     "--digests", str(path)]) == 0
    assert "carried" in capsys.readouterr().out
    stamp = json.loads((tmp_path / "log" / codegen.STAMP).read_text())
    assert stamp["id"] == codegen.current()["id"]
    old_id = _old_version()["id"]
    assert stamp["how"] == f"carried: 3 records' kernels identical to version {old_id}"
    assert stamp["carried_from"]["id"] == old_id and stamp["carried_from"]["how"] == "tune"
    assert TuningLog(log).version().status == "current"


def _digests_with_one_kernel_changed(log: str, index: int) -> tuple[int, carrying.Digests]:
    """The digests of ``log`` under a mutant of code generation that changes the OpenCL source
    of its record ``index``'s kernel (one comment after the project's rewrite), and that
    record's line."""
    from thomas_tune.measure.builder import build_candidate
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    _, workload, body, _, line = carrying._log_records(log)[index]
    rec = ms.database.TuningRecord.from_json(body, workload)
    sch = Schedule(workload.mod)
    rec.trace.apply_to_schedule(sch, remove_postproc=False)
    victim = build_candidate(sch.mod, rec.target).imports[0].inspect_source()
    original = tvm.get_global_func("tvm_callback_opencl_postproc")

    def mutant(code, target=None):
        out = original(code, target)
        return out + "\n// mutant\n" if out in victim else out  # victim: with a header

    tvm.register_global_func("tvm_callback_opencl_postproc", mutant, override=True)
    try:
        return line, carrying.compute_digests(log)
    finally:
        tvm.register_global_func("tvm_callback_opencl_postproc", original, override=True)


def test_a_change_that_alters_one_kernel_is_refused(tmp_path):
    """A mutant of code generation (the OpenCL source of record line 2's kernel changed by one
    comment after the project's rewrite) makes other digests for that record only: the carry
    is refused, naming that line, and the old stamp stays."""
    log = _small_log(tmp_path)
    old = _as_old(carrying.compute_digests(log))
    stamp_before = (tmp_path / "log" / codegen.STAMP).read_text()
    line, new = _digests_with_one_kernel_changed(log, 1)
    differ = [k for k in old.records if old.records[k] != new.records[k]]
    assert len(differ) == 1 and new.defaults == old.defaults
    with pytest.raises(carrying.CarryRefused, match=rf"1 of 3 records .*record line {line}:"):
        carrying.carry(log, old, new)
    assert (tmp_path / "log" / codegen.STAMP).read_text() == stamp_before
    # the same digests under the stamped version and this one carry (the mutant undone)
    assert carrying.carry(log, old, carrying.compute_digests(log)).records == 3


def test_a_failed_trial_of_a_changed_kernel_is_set_aside_and_the_log_carried(tmp_path, capsys):
    """The same mutant with record line 2 a failed trial (MetaSchedule's 1e10 s): its failure
    was the old kernel's, so ``log carry`` moves it to the stale file with the reason and
    restamps the log with the other two; a packed log is refused, naming the fix."""
    from thomas_tune.logs import STALE
    log = _small_log(tmp_path)
    path = os.path.join(log, RECORDS)
    lines = open(path).read().splitlines(keepends=True)
    w, body = json.loads(lines[1])
    body[1] = [1e10]
    lines[1] = json.dumps([w, body]) + "\n"
    open(path, "w").write("".join(lines))
    old = _as_old(carrying.compute_digests(log))
    line, new = _digests_with_one_kernel_changed(log, 1)
    assert line == 2
    packed = tmp_path / "packed"
    shutil.copytree(log, packed)
    pack(str(packed))
    with pytest.raises(carrying.CarryRefused, match="is packed.*log unpack"):
        carrying.carry(str(packed), old, new)
    report = carrying.carry(log, old, new)
    assert (report.records, report.changed, report.set_aside) == (3, 1, 1)
    assert open(path).read() == lines[0] + lines[2]
    stale = [json.loads(x) for x in open(os.path.join(log, STALE))]
    assert [x["text"] + "\n" for x in stale] == [lines[1]]
    assert "no longer makes" in stale[0]["reason"]
    stamp = json.loads((tmp_path / "log" / codegen.STAMP).read_text())
    assert stamp["how"].endswith("; 1 failed trials of changed kernels set aside")
    assert TuningLog(log).version().status == "current"


def test_digests_of_another_version_or_other_records_are_refused(tmp_path):
    """Old digests not made under the stamped version, digests of other records, a log of
    unknown version: refused, each with its reason, nothing written."""
    log = _small_log(tmp_path)
    here = carrying.compute_digests(log)
    with pytest.raises(carrying.CarryRefused, match="made under code generation"):
        carrying.carry(log, here, here)  # labelled this installation's, not the stamp's
    fewer = _as_old(carrying.compute_digests(_small_log(tmp_path / "b", records=2)))
    with pytest.raises(carrying.CarryRefused, match="not of the records"):
        carrying.carry(log, fewer, here)
    os.remove(tmp_path / "log" / codegen.STAMP)
    with pytest.raises(carrying.CarryRefused, match="no version to carry from"):
        carrying.carry(log, _as_old(dataclasses.replace(here)), here)
    assert not (tmp_path / "log" / codegen.STAMP).exists()
