"""The phone path on an emulated aarch64 device: TVM's aarch64 runtime under qemu-user
(``rpc/aarch64_device.sh``), registered with a tracker on 127.0.0.1 under its own key;
``aarch64-linux-gnu-g++`` stands in for the Android NDK's compiler through ``TVM_NDK_CC``.

Tuning measures trials there, a cross-compiled export trains there (matching the x86-64 llvm
build), code of the wrong architecture fails with a clear error, and train / infer reach the
device with ``--tracker``/``--key``. Times under emulation are not speed and are not checked.
The device's root is built once (``rpc/aarch64_device.sh setup``, cached); the tests skip when
qemu-user, mmdebstrap or the cross compiler is missing, unless THOMAS_TUNE_REQUIRE_AARCH64=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from thomas_tune import rpc
from thomas_tune.cli import main
from thomas_tune.compiler.export import export
from thomas_tune.manifest import Manifest
from thomas_tune.models import build, init_params, load_checkpoint
from thomas_tune.remote import check_device, connect
from thomas_tune.runtime import Session
from thomas_tune.target import cross_compiler, host_triple, parse_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "rpc", "aarch64_device.sh")
KEY = "emu-aarch64"
CROSS_CC = "aarch64-linux-gnu-g++"
MODEL = dict(num_classes=5, resolution=67, width=0.1)  # a small AlexNet: quick to compile
BATCH = 4


def _missing() -> list[str]:
    return [t for t in ("qemu-aarch64", "mmdebstrap", CROSS_CC) if shutil.which(t) is None]


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """(tracker address, server process): a tracker here and the emulated device server,
    stopped after the module (the server also stops by itself after 20 minutes)."""
    missing = _missing()
    if missing:
        msg = (f"{', '.join(missing)} missing: apt-get install qemu-user mmdebstrap "
               "g++-aarch64-linux-gnu")
        if os.environ.get("THOMAS_TUNE_REQUIRE_AARCH64") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    t0 = time.perf_counter()
    setup = subprocess.run(["bash", SCRIPT, "setup"], capture_output=True, text=True,
                           timeout=1800)
    assert setup.returncode == 0, setup.stderr[-3000:]
    print(f"emulated device root ready in {time.perf_counter() - t0:.1f} s "
          f"({setup.stdout.strip().splitlines()[-1]})")
    tracker = rpc.start_tracker("127.0.0.1", 9500, 9700)
    addr = ("127.0.0.1", tracker.port)
    log = open(tmp_path_factory.mktemp("emu") / "server.log", "w+")
    server = subprocess.Popen(["bash", SCRIPT, "server", "--tracker", f"127.0.0.1:{tracker.port}",
                               "--key", KEY, "--port", "9700", "--duration", "1200"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        rpc.wait_for_key(addr, KEY, timeout=180)
        print(f"emulated device server up {time.perf_counter() - t0:.1f} s after the start")
        yield addr, server
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        tracker.terminate()
        log.seek(0)
        print("device server log:\n" + log.read()[-2000:])
        log.close()


@pytest.fixture(scope="module")
def cross_env():
    """TVM_NDK_CC naming the aarch64 cross compiler for the module, as a user sets it."""
    old = os.environ.get("TVM_NDK_CC")
    os.environ["TVM_NDK_CC"] = CROSS_CC
    yield CROSS_CC
    if old is None:
        os.environ.pop("TVM_NDK_CC", None)
    else:
        os.environ["TVM_NDK_CC"] = old


@pytest.fixture(scope="module")
def exports(tmp_path_factory, cross_env, device):
    """The same AlexNet exported for the emulated device (aarch64) and for this machine."""
    out = tmp_path_factory.mktemp("exports")
    model = build("alexnet", **MODEL)
    tensors = init_params(model, seed=7)
    classes = [f"class{i}" for i in range(MODEL["num_classes"])]
    quiet = dict(batch=BATCH, trainable="all", classes=classes, progress=lambda *_: None)
    export(str(out / "arm"), model, tensors, parse_target("llvm", "linux-aarch64"), **quiet)
    export(str(out / "x86"), model, tensors, parse_target("llvm"), **quiet)
    return str(out / "arm"), str(out / "x86")


def _elf_machine(path: str) -> int:
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(head[18:20], "little")  # e_machine: 183 aarch64, 62 x86-64


# ---- no device needed ----------------------------------------------------------------------
def test_host_option_and_cross_compiler_errors(monkeypatch, tmp_path):
    target = parse_target("llvm", "android-aarch64")
    assert host_triple(target) == "aarch64-linux-android"
    gpu = parse_target('{"kind": "opencl", "device": "adreno", "host": "android-aarch64"}')
    assert gpu.kind.name == "opencl" and host_triple(gpu) == "aarch64-linux-android"
    assert host_triple(parse_target("qcom/adreno-opencl", "linux-aarch64")) == "aarch64-linux-gnu"
    with pytest.raises(ValueError, match="host 'phone'.*android-aarch64"):
        parse_target("llvm", "phone")
    monkeypatch.delenv("TVM_NDK_CC", raising=False)
    with pytest.raises(ValueError, match="TVM_NDK_CC"):
        cross_compiler(target)
    monkeypatch.setenv("TVM_NDK_CC", "/nonexistent/clang++")
    with pytest.raises(ValueError, match="no such compiler"):
        cross_compiler(target)
    monkeypatch.setenv("TVM_NDK_CC", "g++")  # this machine's compiler: the wrong architecture
    with pytest.raises(ValueError, match="compiles for x86_64.*aarch64-linux-android"):
        cross_compiler(target)
    # export fails before compiling anything
    model = build("alexnet", **MODEL)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="TVM_NDK_CC='g\\+\\+' compiles for"):
        export(str(tmp_path / "e"), model, init_params(model), target, batch=BATCH)
    assert time.perf_counter() - t0 < 5 and not os.path.exists(tmp_path / "e" / "train.so")
    rc = main(["export", "--model", "alexnet", "--width", "0.1", "--resolution", "67",
               "--classes", "5", "--host", "android-aarch64", "--out", str(tmp_path / "f")])
    assert rc == 2


# ---- on the emulated device ----------------------------------------------------------------
def test_tune_measures_trials_on_the_emulated_device(device, cross_env, tmp_path, capsys):
    addr, _ = device
    log = tmp_path / "log"
    args = ["tune", "--model", "alexnet", "--width", "0.1", "--resolution", "67", "--classes",
            "5", "--batch", str(BATCH), "--trainable", "last:1", "--target", "llvm",
            "--host", "linux-aarch64",
            "--tracker", f"{addr[0]}:{addr[1]}", "--key", KEY, "--top", "1", "--trials", "4",
            "--trials-per-iter", "2", "--population", "8", "--build-workers", "2",
            "--trial-timeout", "120", "--log", str(log)]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    print(out)
    records = [json.loads(line) for line in open(log / "database_tuning_record.json")
               if line.strip()]
    measured = [r for r in records if all(np.isfinite(r[1][1])) and min(r[1][1]) < 1e9]
    assert len(records) == 4 and len(measured) >= 2, records
    for r in records:  # the records name the device's architecture
        assert r[1][2]["mtriple"] == "aarch64-linux-gnu"


def test_cross_export_trains_on_the_emulated_device(device, exports):
    addr, _ = device
    arm, x86 = exports
    assert Manifest.read(arm).host_triple == "aarch64-linux-gnu"
    for name in ("train.so", "inference.so"):
        assert _elf_machine(os.path.join(arm, name)) == 183
        assert _elf_machine(os.path.join(x86, name)) == 62
    if shutil.which("file"):
        print(subprocess.run(["file", os.path.join(arm, "train.so")], capture_output=True,
                             text=True).stdout)
    remote = Session(arm, rpc_session=connect(addr, KEY))
    local = Session(x86)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 3, 67, 67)).astype("float32")
    y = rng.integers(0, MODEL["num_classes"], BATCH)
    r_loss = [remote.train_step(x, y) for _ in range(6)]
    l_loss = [local.train_step(x, y) for _ in range(6)]
    print(f"loss on the emulated device: {r_loss[0]:.4f} -> {r_loss[-1]:.4f}; "
          f"x86-64: {l_loss[0]:.4f} -> {l_loss[-1]:.4f}")
    assert r_loss[-1] < 0.95 * r_loss[0]
    np.testing.assert_allclose(r_loss, l_loss, rtol=1e-4, atol=1e-5)
    rt, lt = remote.tensors(), local.tensors()
    for k in lt:
        scale = float(np.abs(lt[k]).max()) or 1.0
        assert float(np.abs(rt[k] - lt[k]).max()) <= 1e-4 * scale, k
    np.testing.assert_allclose(remote.predict(x[:2]), local.predict(x[:2]), rtol=1e-4,
                               atol=1e-5)


def test_wrong_architecture_is_a_clear_error(device, exports):
    addr, _ = device
    arm, x86 = exports
    with pytest.raises(ValueError, match="linked for aarch64-linux-gnu.*this machine is x86_64"):
        Session(arm)
    with pytest.raises(ValueError, match="could not load inference.so.*linked for x86_64"):
        Session(x86, rpc_session=connect(addr, KEY))
    # a candidate linked for this machine cannot run there: the tuner says so before tuning
    with pytest.raises(ValueError, match=f"{KEY!r} cannot run code linked for x86_64.*--host"):
        check_device(addr, KEY, parse_target("llvm"))
    assert check_device(addr, KEY, parse_target("llvm", "linux-aarch64")) == "aarch64-linux-gnu"


def test_train_and_infer_on_the_device_keep_class_names(device, exports, tmp_path, capsys):
    from PIL import Image
    addr, _ = device
    arm, x86 = exports
    rng = np.random.default_rng(1)
    for name, level in (("cat", 40), ("dog", 200)):  # dark and bright images
        os.makedirs(tmp_path / "data" / name)
        for i in range(6):
            px = np.clip(rng.normal(level, 20, (67, 67, 3)), 0, 255).astype("uint8")
            Image.fromarray(px).save(tmp_path / "data" / name / f"{i}.png")
    remote = ["--tracker", f"{addr[0]}:{addr[1]}", "--key", KEY]
    ft = str(tmp_path / "ft.npz")
    assert main(["train", "--export", arm, *remote, "--data", str(tmp_path / "data"),
                 "--steps", "8", "--test-fraction", "0.34", "--quiet", "--save", ft]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and "saved checkpoint" in out, out
    _, _, classes = load_checkpoint(ft)
    assert classes[:2] == ["cat", "dog"]
    photos = [str(tmp_path / "data" / "cat" / "0.png"), str(tmp_path / "data" / "dog" / "0.png")]
    # the fine-tuned weights reach infer without a recompile, on the device and here
    for where in (["--export", arm, *remote], ["--export", x86]):
        assert main(["infer", *where, "--checkpoint", ft, *photos]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines()
                 if ln.startswith(tuple(photos))]
        assert len(lines) == 2 and all(ln.split(": ")[1].split()[0] in ("cat", "dog")
                                       for ln in lines), lines
    # bench on the device: the step is checked there against float64 through the library
    # the timed session loaded, then timed (times under emulation are not speed: not checked)
    assert main(["bench", "--export", arm, *remote, "--checkpoint", ft, "--steps", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["device_key"] == KEY and row["batch"] == BATCH
    assert row["checked"]["ok"] and row["checked"]["line"].startswith("right"), row["checked"]
    assert main(["infer", "--export", x86, "--tracker", f"{addr[0]}:{addr[1]}", *photos]) == 2
    assert "--tracker and --key go together" in capsys.readouterr().err
