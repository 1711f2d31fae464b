"""The export format (``thomas_tune.manifest.Manifest``): written and read back whole, and a
manifest of another format version or a JSON file of another kind refused with the fix."""

import dataclasses
import json
import os

import pytest

from thomas_tune.manifest import FORMAT, FORMAT_VERSION, MANIFEST, Manifest


def _sample() -> Manifest:
    """A manifest with a value of its own in every field (nothing is compiled)."""
    return Manifest(
        arch="mobilenet_v2", config={"width": 0.5, "num_classes": 10, "resolution": 64},
        input_shape=[1, 3, 64, 64], batch=8, infer_batch=1,
        target={"kind": "opencl", "max_threads_per_block": 256}, target_name="opencl (PoCL)",
        host_triple="aarch64-linux-android", params=["a.weight", "b.weight", "b.bias"],
        states=["bn.running_mean", "bn.running_var"], trainable=["b.weight", "b.bias"],
        frozen=["a.weight"], frozen_slots=[""], frozen_lift_inputs=["a.weight", "bn.running_mean"],
        train_step_slots=["", "a.weight"], predict_slots=["", "b.weight", "b.bias", "", ""],
        features_slots=None, batchnorm="frozen-part", frozen_bn=["bn"],
        masks={"drop0": {"shape": [8, 16], "p": 0.5}},
        features={"shape": [16, 1, 1], "frozen_states": [], "head_states": []},
        optimizer={"kind": "sgd", "lr": 0.01, "momentum": 0.9},
        tuning_log="logs/pocl", tuning_log_sha256="ab" * 32,
        tuning_log_codegen={"status": "current", "id": "c0ffee"}, default_rules="thomas_tune",
        record_check={"checked": 3, "wrong": {"123": "wrong numbers"}, "unchecked": None},
        winograd={"inference": [], "training": [{"name": "conv1"}]}, classes=["cat", "dog"],
        device={"max_threads_per_block": 256}, precision="mixed16",
        buffers={"tensors": [{"name": "lv1", "op": "conv", "shape": [8, 16], "bytes": 512}],
                 "peak_bytes": 4096},
        memory_budget={"budget_bytes": 10_000_000, "level": "none", "recomputed": []},
        loss_scale={"kind": "dynamic", "init_scale": 65536.0, "growth_interval": 2000})


def test_a_manifest_reads_back_as_written(tmp_path):
    m = _sample()
    path = m.write(str(tmp_path))
    assert path == os.path.join(str(tmp_path), MANIFEST)
    back = Manifest.read(str(tmp_path))
    assert back == m
    # every field differs from the field of another name: a field read into another's place
    # (or left out) would not compare equal above
    values = [json.dumps(v, sort_keys=True) for v in dataclasses.asdict(m).values()]
    assert len(set(values)) == len(values)
    on_disk = json.load(open(path))  # readable JSON: the fields under their own names
    assert on_disk["format"] == FORMAT and on_disk["frozen_bn"] == ["bn"]
    assert set(on_disk) == {"format", *(f.name for f in dataclasses.fields(Manifest))}
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.batch = 4


def _rewrite(folder, change) -> str:
    path = os.path.join(folder, MANIFEST)
    data = json.load(open(path))
    change(data)
    json.dump(data, open(path, "w"))
    return path


def test_an_old_format_manifest_is_refused_saying_to_export_again(tmp_path):
    folder = str(tmp_path)
    _sample().write(folder)
    # a manifest of format 2 (the step's slots under "train_step")
    path = _rewrite(folder, lambda d: d.update(
        format="thomas_tune.export/2",
        train_step={"frozen_slots": d.pop("train_step_slots")}))
    with pytest.raises(ValueError) as err:
        Manifest.read(folder)
    msg = str(err.value)
    assert msg.startswith(path)
    assert "version 2" in msg and f"version {FORMAT_VERSION}" in msg
    assert "export the model again with 'thomas-tune export'" in msg
    # the current version with a field missing: another writer's, refused all the same
    _sample().write(folder)
    _rewrite(folder, lambda d: d.pop("buffers"))
    with pytest.raises(ValueError, match="without buffers.*export the model again"):
        Manifest.read(folder)


@pytest.mark.parametrize("data", [
    {"format": "thomas_tune.device_profile/1", "key": "pocl"},  # another file of the project
    {"arch": "alexnet", "batch": 8},  # no format at all
    [1, 2, 3],  # not an object
])
def test_a_foreign_json_file_is_refused(tmp_path, data):
    path = os.path.join(str(tmp_path), MANIFEST)
    json.dump(data, open(path, "w"))
    with pytest.raises(ValueError) as err:
        Manifest.read(str(tmp_path))
    msg = str(err.value)
    assert msg.startswith(path) and "not a thomas_tune export's manifest" in msg
    assert f"expected {FORMAT!r}" in msg and "thomas-tune export" in msg


def test_a_folder_without_a_manifest_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not a thomas_tune export.*'thomas-tune export' first"):
        Manifest.read(str(tmp_path))
