"""Run an exported module: predict and training steps on a local device or over RPC.

Parameters, states and optimizer state live on the device between steps; only the images, the
labels, the dropout masks and the loss cross the host-device boundary in a training step.
"""

from __future__ import annotations

import os
import time

import numpy as np
import tvm
from tvm import relax

from .export import read_manifest
from .graph import ADJOINT, OPTIMIZER, PREDICT
from .models import load_checkpoint, save_checkpoint


def device_for(target_kind: str, session=None, index: int = 0):
    """The device of an exported target (``llvm`` -> cpu), local or on an RPC ``session``."""
    dev_type = "cpu" if target_kind == "llvm" else target_kind
    return (session or tvm).device(dev_type, index)


class Session:
    """An exported model loaded on a device.

    ``predict(x)``: x float32 (N, C, H, W) with N a multiple of nothing in particular -> logits
    float32 (N, classes), run in chunks of the compiled batch size (the last chunk padded).
    ``train_step(x, y)``: x float32 (batch, C, H, W), y int64 (batch,) -> loss (float), updating
    the trainable parameters, BatchNorm running statistics and optimizer state in place.
    Raises ValueError for inputs of the wrong shape or dtype.
    """

    def __init__(self, export_dir: str, device=None, rpc_session=None, seed: int = 0):
        self.dir = export_dir
        self.manifest = m = read_manifest(export_dir)
        self.model, tensors, self.classes = load_checkpoint(os.path.join(export_dir, "params.npz"))
        kind = m["target"]["kind"]
        self.device = device or device_for(kind, rpc_session)
        load = rpc_session.load_module if rpc_session is not None else tvm.runtime.load_module
        if rpc_session is not None:
            for name in ("inference.so", "train.so"):
                rpc_session.upload(os.path.join(export_dir, name))
            self._train_vm = relax.VirtualMachine(load("train.so"), self.device)
            self._infer_vm = relax.VirtualMachine(load("inference.so"), self.device)
        else:
            self._train_vm = relax.VirtualMachine(load(os.path.join(export_dir, "train.so")),
                                                  self.device)
            self._infer_vm = relax.VirtualMachine(load(os.path.join(export_dir, "inference.so")),
                                                  self.device)
        self.batch, self.infer_batch = m["batch"], m["infer_batch"]
        self._t = {k: tvm.runtime.tensor(v, self.device) for k, v in tensors.items()}
        self._opt = self._initial_optimizer_state()
        self._rng = np.random.default_rng(seed)
        self.steps = 0

    # ---- helpers -----------------------------------------------------------------------------
    def _check_x(self, x: np.ndarray, batch: int) -> np.ndarray:
        want = (batch, *self.model.input_shape(1)[1:])
        x = np.asarray(x)
        if x.dtype != np.float32 or x.shape != want:
            raise ValueError(f"input images: expected float32 {want}, got {x.dtype} {x.shape}")
        return x

    def _ordered(self, names):
        return [self._t[n] for n in names]

    def _initial_optimizer_state(self) -> list:
        """The optimizer state the export starts from (``optim_state.npz``), on the device."""
        opt = np.load(os.path.join(self.dir, "optim_state.npz"))
        return [tvm.runtime.tensor(opt[f"s{i}"], self.device) for i in range(len(opt.files))]

    def dropout_mask(self, shape, p: float) -> np.ndarray:
        """A fresh inverted-dropout mask, float32 of ``shape``: 0 with probability ``p``, else
        1 / (1 - p), as ``torch.nn.functional.dropout`` scales (Srivastava et al., JMLR 2014,
        with the scaling moved to training). Drawn from the session's seeded generator."""
        keep = self._rng.random(shape) >= p
        return (keep / (1.0 - p)).astype("float32")

    def sync(self) -> None:
        """Wait for the device to finish queued work (for timing)."""
        self.device.sync()

    # ---- API -------------------------------------------------------------------------------
    def load_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Replace every parameter and state (float32, shapes of the exported model) and reset
        the optimizer state, as if the export had been made with ``tensors``: one compiled
        module serves several starting points (pretrained, fresh). Raises ValueError for a
        missing or mis-shaped tensor."""
        for name, old in self._t.items():
            if name not in tensors or tuple(np.shape(tensors[name])) != tuple(old.shape):
                raise ValueError(f"load_tensors: {name!r} missing or not of shape "
                                 f"{tuple(old.shape)}")
        self._t = {k: tvm.runtime.tensor(np.asarray(tensors[k], dtype="float32"), self.device)
                   for k in self._t}
        self._opt = self._initial_optimizer_state()
        self.steps = 0

    def tensors(self) -> dict[str, np.ndarray]:
        """Current parameters and states as float32 numpy arrays."""
        return {k: v.numpy() for k, v in self._t.items()}

    def _predict_chunks(self, vm, batch, x):
        x = np.asarray(x, dtype="float32")
        out = []
        params = self._ordered(self.manifest["params"]) + self._ordered(self.manifest["states"])
        for i in range(0, len(x), batch):
            chunk = x[i:i + batch]
            n = len(chunk)
            if n < batch:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
            self._check_x(chunk, batch)
            logits = vm[PREDICT](tvm.runtime.tensor(chunk, self.device), *params)
            out.append(logits.numpy()[:n])
        return np.concatenate(out) if out else np.zeros((0, self.model.num_classes), "float32")

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits with the inference module (its compiled batch, usually 1)."""
        return self._predict_chunks(self._infer_vm, self.infer_batch, x)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """Top-1 accuracy in [0, 1] on (x, y), with the training module's predict (same batch)."""
        if len(x) == 0:
            raise ValueError("evaluate: empty data set")
        logits = self._predict_chunks(self._train_vm, self.batch, x)
        return float(np.mean(np.argmax(logits, axis=1) == np.asarray(y)))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        m = self.manifest
        x = self._check_x(x, self.batch)
        y = np.asarray(y)
        if y.shape != (self.batch,) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"labels: expected integer ({self.batch},), got {y.dtype} {y.shape}")
        if y.min() < 0 or y.max() >= self.model.num_classes:
            raise ValueError(f"labels must be in 0..{self.model.num_classes - 1}")
        masks = [tvm.runtime.tensor(self.dropout_mask(spec["shape"], spec["p"]), self.device)
                 for spec in m["masks"].values()]
        args = ([tvm.runtime.tensor(x, self.device), *masks, *self._ordered(m["frozen"]),
                 *self._ordered(m["trainable"]), *self._ordered(m["states"]),
                 tvm.runtime.tensor(y.astype("int64"), self.device)])
        ret, grads = self._train_vm[ADJOINT](*args)
        loss = ret[0] if m["states"] else ret
        if m["states"]:
            for name, value in zip(m["states"], list(ret)[1:]):
                self._t[name] = value
        new_params, self._opt = self._train_vm[OPTIMIZER](self._ordered(m["trainable"]), grads,
                                                          self._opt)
        for name, value in zip(m["trainable"], new_params):
            self._t[name] = value
        self.steps += 1
        return float(loss.numpy())

    def save(self, path: str) -> None:
        """Write the current parameters and states as a checkpoint (atomically)."""
        save_checkpoint(path, self.model, self.tensors(), self.classes)


def time_steps(session: Session, x: np.ndarray, y: np.ndarray, steps: int) -> float:
    """Median wall time of one training step in ms over ``steps`` steps on (x, y)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        session.train_step(x, y)
        session.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))
