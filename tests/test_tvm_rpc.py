"""TVM's own C++ RPC server ``tvm_rpc``, built from TVM's source by ``rpc/build_tvm_rpc.sh``,
as a phone runs it: registered with a tracker on 127.0.0.1, PoCL as its OpenCL device.

With the x86-64 build: its session bounds as ``apps/cpp_rpc/rpc_server.cc`` sets them (SIGTERM
at the bound with the session's files left, no bound at 0, the whole server ended by a
timeout that is not digits), and the product through it: ``tune`` (a few trials), ``export``,
a training run renewed across sessions, ``infer``. With the aarch64 build under qemu-user
(``rpc/tvm_rpc_server.sh``, Debian's arm64 PoCL in an arm64 root): an export for the Adreno
target linked for ``linux-aarch64`` (its last three layers trainable) runs its training step
there, loss and gradients checked against PyTorch in float64, and trains as the same export
does on this machine.

The builds are found through ``THOMAS_TUNE_TVM_RPC`` (x86-64) and
``THOMAS_TUNE_TVM_RPC_AARCH64``: the ``--out`` folders of ``rpc/build_tvm_rpc.sh`` (``tvm_rpc``
and ``lib/``). ``tests/run.sh`` unpacks them from ``../shared/tvm_rpc/`` when the variables are
not set. Without them the tests skip, unless ``THOMAS_TUNE_REQUIRE_TVM_RPC=1`` (CI sets it: every
run goes through both servers). They are marked ``tvm_rpc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from tvm import rpc as tvm_rpc

from thomas_tune import rpc
from thomas_tune.cli import main
from thomas_tune.models import build, init_params, load_checkpoint
from thomas_tune.remote import RemoteDevice, connect
from thomas_tune.runtime import Session
from thomas_tune.manifest import Manifest
from thomas_tune.export_check import check_export
from thomas_tune.step_check import export_step, manifest_frozen_bn, reference_steps
from thomas_tune.target import parse_target

from build_cache import export  # the session's build of these inputs
from opencl_kernels import NEEDS_OPENCL, HalfEpilogueConv, vector_half_epilogues

pytestmark = [NEEDS_OPENCL, pytest.mark.tvm_rpc]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "rpc", "tvm_rpc_server.sh")
MODEL = dict(num_classes=5, resolution=67, width=0.1)  # the small AlexNet of test_aarch64
BATCH = 4
# The session bound of the product test's training run (s): it trains until the first renewal
# and 3 steps after, then takes every step again on this machine, so the test's length grows
# with it (docs/journal/suite.md). A session's first call builds the OpenCL programs (up to 40 s
# on a loaded 2-core machine) and the renewal asks room for that call again: a first call up to
# about 50 s fits in 60 s.
SESSION_S = 60
# Until the last PACE_UNTIL_S seconds of the first session, the run takes a step every PACE_S
# seconds or so instead of back to back: the renewal comes at the same time, after a few
# hundred steps instead of thousands, each taken again on this machine after. The last
# seconds before the renewal run back to back, as a training run does.
PACE_S, PACE_UNTIL_S = 0.25, 5.0


def _build(env: str, needs: tuple[str, ...] = ()) -> str:
    """The build folder named by ``env`` (with ``tvm_rpc``), or skip (fail when required)."""
    path = os.environ.get(env, "")
    missing = [t for t in needs if shutil.which(t) is None]
    if path and os.access(os.path.join(path, "tvm_rpc"), os.X_OK) and not missing:
        return path
    msg = (f"{', '.join(missing)} missing" if missing and path else
           f"no built tvm_rpc: set {env} to the --out folder of rpc/build_tvm_rpc.sh")
    if os.environ.get("THOMAS_TUNE_REQUIRE_TVM_RPC") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


class Server:
    """A tvm_rpc started by ``rpc/tvm_rpc_server.sh``, its output in ``log``; killed after
    ``lifetime`` seconds whatever happens."""

    def __init__(self, build_dir: str, addr: tuple[str, int], key: str, port: int,
                 folder, work_dir=None, lifetime: float = 1200):
        self.log_path = folder / f"{key}.log"
        self.log = open(self.log_path, "w")
        cmd = ["bash", LAUNCHER, "--build", build_dir, "--tracker", f"{addr[0]}:{addr[1]}",
               "--key", key, "--port", str(port)]
        if work_dir is not None:
            cmd += ["--work-dir", str(work_dir)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=str(folder))
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        self._timer.cancel()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def tracker():
    t = rpc.start_tracker("127.0.0.1", 9800, 9900)
    yield ("127.0.0.1", t.port)
    t.terminate()


# ---- x86-64 tvm_rpc: session bounds ---------------------------------------------------------
def test_session_bounds_are_those_of_tvm_rpc(tracker, tmp_path, rng):
    build_dir = _build("THOMAS_TUNE_TVM_RPC")
    key = "tvm-rpc-bounds"
    work = tmp_path / "work"
    server = Server(build_dir, tracker, key, 9910, tmp_path, work_dir=work, lifetime=300)
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        payload = rng.integers(0, 256, 4096).astype("uint8").tobytes()
        (tmp_path / "left.bin").write_bytes(payload)

        # a bound of 3 s: at 3 s the server ends the session's process with SIGTERM
        sess = rpc.request_session(tracker, key, 3)
        sess.upload(str(tmp_path / "left.bin"))
        sess.get_function("tvm.rpc.server.workpath")("left.bin")
        time.sleep(4.5)
        with pytest.raises(Exception):
            sess.get_function("tvm.rpc.server.workpath")("left.bin")
        del sess
        assert "killed (timeout = 3 sec), status = 15" in server.text()
        # the session's clean-up did not run: its file is still in the server's folder
        assert (work / ".cache" / "left.bin").read_bytes() == payload

        # no -timeout option (what a client asking for 0 sends): no bound at all
        rpc.wait_for_key(tracker, key, timeout=20)  # back after the session
        sess = tvm_rpc.connect_tracker(*tracker).request(key, session_timeout=0)
        time.sleep(4.5)
        assert sess.get_function("tvm.rpc.server.workpath")("x").endswith("/x")
        del sess  # a session that ends normally removes the whole folder, earlier files too
        deadline = time.monotonic() + 10
        while (work / ".cache").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not (work / ".cache").exists()
        assert "Finished serving" in server.text()  # the session process ended by itself

        # thomas_tune sends whole seconds only; a timeout that is not digits ends the server
        assert rpc.whole_seconds(1.5) == 2
        rpc.wait_for_key(tracker, key, timeout=20)  # back after the session
        try:
            bad = tvm_rpc.connect_tracker(*tracker).request(key, session_timeout=1.5,
                                                            max_retry=1)
            bad.get_function("tvm.rpc.server.workpath")("x")
        except Exception:  # the server is gone before or during the first call
            pass
        assert server.proc.wait(20) != 0
        assert "Timeout is not valid" in server.text()
    finally:
        server.stop()


@contextlib.contextmanager
def _loaded(lib, build_dir: str, key: str, port: int, tracker, tmp_path):
    """``lib`` (a built module) exported, uploaded to a tvm_rpc server of ``build_dir``
    registered as ``key`` and loaded there: yields its ``main`` and the server's OpenCL device;
    the session is dropped and the server stopped after."""
    name = f"{key}.so"
    lib.export_library(str(tmp_path / name))
    server = Server(build_dir, tracker, key, port, tmp_path, lifetime=300)
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        sess = rpc.request_session(tracker, key, 120)
        sess.upload(str(tmp_path / name))
        yield sess.load_module(name)["main"], sess.cl(0)
        del sess
    finally:
        server.stop()


# ---- x86-64 tvm_rpc: a half-storage kernel of the vector form --------------------------------
def test_a_vectorized_float16_epilogue_runs_on_tvm_rpc(tracker, tmp_path, rng):
    """A half-storage convolution whose float16 epilogue TVM vectorizes (a private ``halfN``,
    which OpenCL C without ``cl_khr_fp16`` cannot compile as TVM writes it), sampled from the
    H100 target's space: the library's OpenCL C holds no half type after the half-storage
    rewrite, and TVM's own OpenCL runtime in ``tvm_rpc`` (PoCL, no ``cl_khr_fp16``) builds and
    launches it, storing the float16 nearest each float64 output
    (:meth:`opencl_kernels.HalfEpilogueConv.check`)."""
    import re

    import tvm
    build_dir = _build("THOMAS_TUNE_TVM_RPC")
    conv = HalfEpilogueConv(rng)
    target = parse_target(os.path.join(ROOT, "targets", "h100_opencl.json"))
    found = vector_half_epilogues(conv.mod, target, rng, want=1)
    assert found, "no sampled schedule had a vectorized float16 epilogue"
    lib = tvm.compile(found[0][0].mod, target)
    assert not re.search(r"\bhalf\d* |convert_half", lib.mod.imports[0].inspect_source())
    with _loaded(lib, build_dir, "tvm-rpc-half", 9940, tracker, tmp_path) as (main, dev):
        args = [tvm.runtime.tensor(a, dev) for a in conv.inputs()]
        main(*args)
        conv.check(args[-1].numpy())


def test_a_vectorized_relu_mask_runs_right_on_tvm_rpc(tracker, tmp_path, rng):
    """A ReLU mask in Relax's form with its loop vectorized by 4 (``test_bool_casts.py``),
    built by the GPU pipeline with its vector-cast rewrite: TVM's own OpenCL runtime in
    ``tvm_rpc`` (PoCL) gives numpy's values on fresh inputs of both signs."""
    import numpy as np
    import tvm
    from test_bool_casts import N, _relu_mask

    from thomas_tune.schedules import tir_pipeline
    from thomas_tune.target import codegen_target
    build_dir = _build("THOMAS_TUNE_TVM_RPC")
    target = parse_target("opencl")
    lib = tvm.compile(_relu_mask(4), codegen_target(target), tir_pipeline=tir_pipeline(target))
    x = rng.standard_normal(N).astype("float32")
    dy = rng.standard_normal(N).astype("float32")
    with _loaded(lib, build_dir, "tvm-rpc-mask", 9941, tracker, tmp_path) as (main, dev):
        out = tvm.runtime.tensor(np.full(N, np.nan, "float32"), dev)
        main(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(dy, dev), out)
        np.testing.assert_array_equal(out.numpy(), np.where(x > 0, dy, 0.0))


# ---- x86-64 tvm_rpc: the product -----------------------------------------------------------
def test_tune_export_train_infer_through_tvm_rpc(tracker, tmp_path, rng, capsys):
    import tvm

    build_dir = _build("THOMAS_TUNE_TVM_RPC")
    key = "tvm-rpc-pocl"
    server = Server(build_dir, tracker, key, 9920, tmp_path, lifetime=1200)
    addr = f"{tracker[0]}:{tracker[1]}"
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        log, out = tmp_path / "log", tmp_path / "export"
        small = ["--model", "alexnet", "--width", "0.1", "--resolution", "67", "--classes",
                 "5", "--batch", str(BATCH), "--target", "opencl:remote",
                 # hundreds of steps on one batch (as many as a fast machine runs in a session
                 # of SESSION_S): at the default 0.01 this AlexNet, which has no BatchNorm, can
                 # diverge on it (seen: a loss of 7e6 after 125 steps, NaN after 500)
                 "--lr", "0.002"]
        assert main(["tune", *small, "--tracker", addr, "--key", key, "--top", "1",
                     "--trials", "4", "--trials-per-iter", "2", "--population", "8",
                     "--genetic-iters", "1", "--build-workers", "1", "--log", str(log)]) == 0
        device = json.loads((log / "device.json").read_text())
        assert device["device_name"] == tvm.opencl(0).device_name  # the server's PoCL
        assert "opencl" not in device  # tvm_rpc has no thomas_tune.opencl.device_info
        records = [json.loads(ln) for ln in open(log / "database_tuning_record.json")
                   if ln.strip()]
        # every candidate that built was checked against its default schedule and timed there:
        # the check's kernels take only arguments TVM's OpenCL runtime packs
        # (thomas_tune.kernel_signature); a failed trial is one the builder refused
        errors = [json.loads(ln) for ln in open(log / "trial_errors.jsonl") if ln.strip()] \
            if (log / "trial_errors.jsonl").exists() else []
        # (a timed run cut by its bound on a loaded machine is no fault of the kernel)
        assert not [e for e in errors if e["stage"] != "build"
                    and not e["reason"].startswith("run timed out")], errors
        measured = [r for r in records if min(r[1][1]) < 1e9]
        assert len(records) == 4 and len(measured) == 4 - len(errors) >= 1, (records, errors)
        # the export applies each workload's best record and checks it through tvm_rpc:
        # without the default schedules' times none is left out as slower than its default
        # (on a loaded machine a few trials can all be slower: nothing was checked)
        (log / "default_latency.json").unlink(missing_ok=True)
        assert main(["export", *small, "--log", str(log), "--out", str(out)]) == 0
        manifest = Manifest.read(str(out))
        assert manifest.record_check["checked"] >= 1 and not manifest.record_check["wrong"]
        capsys.readouterr()

        # a training run through tvm_rpc renewed across sessions of SESSION_S, against the
        # same steps on this machine's PoCL (thomas_tune's OpenCL runtime): the same numbers
        x = rng.standard_normal((BATCH, 3, 67, 67)).astype("float32")
        y = rng.integers(0, MODEL["num_classes"], BATCH)
        seed = int(rng.integers(1 << 30))
        lifetime = RemoteDevice(tracker, key, SESSION_S)
        with Session(str(out), remote=lifetime, seed=seed) as remote:
            losses = []
            while not remote.renewals or len(losses) < remote.renewals[0]["step"] + 3:
                losses.append(remote.train_step(x, y))
                if not remote.renewals and lifetime.remaining_s() > PACE_UNTIL_S:
                    time.sleep(PACE_S)
            print(f"{len(losses)} steps through tvm_rpc, renewals {remote.renewals}")
            tensors, logits = remote.tensors(), remote.predict(x[:2])
        local = Session(str(out), seed=seed)
        assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
        np.testing.assert_allclose(losses, [local.train_step(x, y) for _ in losses],
                                   rtol=1e-4, atol=1e-6)
        for name, value in local.tensors().items():
            scale = float(np.abs(value).max()) or 1.0
            assert float(np.abs(tensors[name] - value).max()) <= 1e-4 * scale, name
        np.testing.assert_allclose(logits, local.predict(x[:2]), rtol=1e-4, atol=1e-5)
        assert "killed" not in server.text()  # every renewal came before the bound

        # train and infer from the command line through it
        from PIL import Image
        for name, level in (("cat", 40), ("dog", 200)):
            os.makedirs(tmp_path / "data" / name)
            for i in range(6):
                px = np.clip(rng.normal(level, 20, (67, 67, 3)), 0, 255).astype("uint8")
                Image.fromarray(px).save(tmp_path / "data" / name / f"{i}.png")
        remote_args = ["--tracker", addr, "--key", key]
        ft = str(tmp_path / "ft.npz")
        assert main(["train", "--export", str(out), *remote_args, "--data",
                     str(tmp_path / "data"), "--steps", "6", "--test-fraction", "0.34",
                     "--quiet", "--save", ft, "--session-timeout", "300"]) == 0
        assert "saved checkpoint" in capsys.readouterr().out
        photos = [str(tmp_path / "data" / c / "0.png") for c in ("cat", "dog")]
        assert main(["infer", "--export", str(out), *remote_args, "--checkpoint", ft,
                     *photos]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(tuple(photos))]
        assert main(["infer", "--export", str(out), "--checkpoint", ft, *photos]) == 0
        here = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(tuple(photos))]
        assert len(lines) == 2 and lines == here, (lines, here)
        assert load_checkpoint(ft)[2][:2] == ["cat", "dog"]
    finally:
        server.stop()
        print("tvm_rpc log:\n" + server.text()[-2000:])


# ---- aarch64 tvm_rpc under qemu-user, Debian's arm64 PoCL ---------------------------------
def test_adreno_export_trains_on_the_aarch64_tvm_rpc(tracker, tmp_path, rng, monkeypatch):
    pytest.importorskip("torch")
    build_dir = _build("THOMAS_TUNE_TVM_RPC_AARCH64",
                       ("qemu-aarch64", "mmdebstrap", "aarch64-linux-gnu-g++"))
    monkeypatch.setenv("TVM_NDK_CC", "aarch64-linux-gnu-g++")
    key = "tvm-rpc-aarch64"
    setup = subprocess.run(["bash", os.path.join(ROOT, "rpc", "aarch64_device.sh"),
                            "opencl-root"], capture_output=True, text=True, timeout=1800)
    assert setup.returncode == 0, setup.stderr[-3000:]
    server = Server(build_dir, tracker, key, 9930, tmp_path, lifetime=1500)
    try:
        model = build("alexnet", **MODEL)
        tensors = init_params(model, seed=int(rng.integers(1 << 30)))
        # The last three layers train: the frozen convolutions run forward only. The kernels'
        # OpenCL C is the target's, whatever the host; what the aarch64 device adds is the
        # host code linked for linux-aarch64 and tvm_rpc's aarch64 build, which every kernel
        # goes through alike. Its PoCL compiles each kernel under emulation at its first
        # launch (on an empty cache most of this test's time: 443 s with every layer
        # trainable, 75 s with a warm cache), and the backward kernels of the convolutions
        # run on PoCL in tests/test_adreno.py.
        quiet = dict(batch=BATCH, trainable="last:3", progress=lambda *_: None)
        arm, x86 = str(tmp_path / "arm"), str(tmp_path / "x86")
        export(arm, model, tensors, parse_target("qcom/adreno-opencl", "linux-aarch64"), **quiet)
        export(x86, model, tensors, parse_target("qcom/adreno-opencl"), **quiet)
        rpc.wait_for_key(tracker, key, timeout=120)

        # the step's loss and every gradient on the device against PyTorch in float64, through
        # the library the training session below loaded there (as bench checks before timing:
        # the device loads train.so and builds its OpenCL programs once)
        seed = int(rng.integers(1 << 30))
        sess = connect(tracker, key, session_timeout_s=1200)
        remote = Session(arm, rpc_session=sess, seed=seed)
        m = Manifest.read(arm)
        ref = reference_steps(model, tensors, m.trainable, BATCH, seed, manifest_frozen_bn(m))
        checked = check_export(arm, seed=seed, rpc_session=sess, reference=ref,
                               train_lib=remote.train_library)
        print(checked.line())
        assert checked.ok, checked.line()
        # the first check batch (its dropout masks and the tensors it was checked from) here
        (cx, cy), mk = ref["batches"][0], ref["masks"][0]
        here = export_step(x86, cx, cy, masks=mk, tensors=ref["context"][1])[0]
        assert here == pytest.approx(checked.loss, rel=1e-4)
        # training steps on a plain batch (standard normal images, uniform labels)
        x = rng.standard_normal(model.input_shape(BATCH)).astype("float32")
        y = rng.integers(0, MODEL["num_classes"], BATCH).astype("int64")

        # training steps there follow the same steps on this machine
        local = Session(x86, seed=seed)
        r_loss = [remote.train_step(x, y) for _ in range(3)]
        l_loss = [local.train_step(x, y) for _ in range(3)]
        print(f"losses on the aarch64 tvm_rpc {r_loss}, here {l_loss}")
        # (three steps with fresh dropout masks need not lower the loss: the losses and the
        # parameters are checked against the same steps here instead)
        np.testing.assert_allclose(r_loss, l_loss, rtol=1e-4, atol=1e-6)
        rt = remote.tensors()
        for name, value in local.tensors().items():
            scale = float(np.abs(value).max()) or 1.0
            assert float(np.abs(rt[name] - value).max()) <= 1e-4 * scale, name
        remote.close()
        del sess
    finally:
        server.stop()
        print("tvm_rpc log:\n" + server.text()[-2000:])
