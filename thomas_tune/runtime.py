"""Run an exported module: predict and training steps on a local device or over RPC.

Parameters, states and optimizer state live on the device between steps; only the images, the
labels, the step's 8-byte dropout seed and the loss cross the host-device boundary in a training
step (the masks are drawn on the device, :mod:`thomas_tune.training_graph.dropout`); with cached
features (:meth:`Session.features`, kept by the caller), a batch's features take the images' place.
Over RPC (a device server of a tracker: a phone, a board, the emulated aarch64 device of the tests)
the libraries are uploaded and loaded there; tuples of tensors cannot cross RPC, so the
optimizer's tuples are made and kept on the device (``pack_trainable``, then the optimizer's
own outputs) and single tensors are read from them there.

A run longer than its RPC session's bound renews the session between steps
(:meth:`Session.renew`, :mod:`thomas_tune.remote`): the parameters, states and optimizer state
are read back from the device while the old session still lives, a new session is requested,
the libraries are uploaded and loaded again and the state is uploaded; the training goes on
from the same numbers (a server ends a session's process, and all it held, at the bound:
``tvm_rpc`` with SIGTERM, so nothing in the device's memory outlives it; the files the session
uploaded stay in the server's folder until a later session ends by itself).

Nothing here needs TVM's compiler: a process started with ``TVM_USE_RUNTIME_LIB=1`` (TVM loads
only ``libtvm_runtime.so``, no ``tvm.relax``) imports this module in about half the time and
runs :class:`Session` the same (the exported functions run in TVM's Relax VM,
``tvm.runtime.vm.VirtualMachine``).
"""

from __future__ import annotations

import os
import time

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from .manifest import (ADJOINT, ADJOINT_FROZEN, DRAW_MASKS, FEATURES, FEATURES_FROZEN,
                       HEAD_ADJOINT, OPTIMIZER, PACK_OPTIMIZER_STATE, PACK_TRAINABLE, PREDICT,
                       TRAIN_STEP, TRAIN_STEP_FROZEN,
                       PREDICT_FROZEN, Manifest, lifted_values, slot_arguments)
from .loss_scale import DynamicScaler, LossScale
from .models import load_checkpoint, save_checkpoint
from .programs import SessionPrograms
from .remote import RemoteDevice, SessionLifetime, first_line
from .target import host_arch, machine_arch


def device_for(target_kind: str, session=None, index: int = 0):
    """The device of an exported target (``llvm`` -> cpu), local or on an RPC ``session``."""
    dev_type = "cpu" if target_kind == "llvm" else target_kind
    return (session or tvm).device(dev_type, index)


class Session(SessionLifetime):
    """An exported model loaded on a device.

    ``predict(x)``: x float32 (N, C, H, W) with N a multiple of nothing in particular -> logits
    float32 (N, classes), run in chunks of the compiled batch size (the last chunk padded).
    ``train_step(x, y)``: x float32 (batch, C, H, W), y int64 (batch,) -> loss (float), updating
    the trainable parameters, BatchNorm running statistics and optimizer state in place.
    Raises ValueError for inputs of the wrong shape or dtype.

    ``remote``: a :class:`RemoteDevice`: the libraries are uploaded to and run on a device
    server of its key, in sessions of its stated lifetime; the session is renewed between
    calls before it could end during one (:meth:`renew`, with no state lost); a call cut by the
    bound all the same raises :class:`~thomas_tune.remote.SessionExpired` (a TimeoutError).
    ``rpc_session``: one ``tvm.rpc`` session to run on instead
    (``remote.connect(tracker, key)``), never renewed.
    Without either the export runs on this machine; an export linked for another
    architecture (``host_triple`` in the manifest) raises ValueError saying so, as does a
    device server that cannot load the libraries. ``classes``: class names (the
    checkpoint's), or None. ``renewals``: one dict per renewal (``step``, ``download_s``,
    ``reopen_s``: the new session, libraries and state, ``state_bytes``).
    """

    def __init__(self, export_dir: str, device=None, rpc_session=None, seed: int = 0,
                 remote: RemoteDevice | None = None):
        self.dir = export_dir
        self.manifest = m = Manifest.read(export_dir)
        self.model, tensors, self.classes = load_checkpoint(os.path.join(export_dir, "params.npz"))
        self.classes = self.classes or m.classes
        self._remote_device = remote
        self.programs = SessionPrograms(triple=m.host_triple)  # OpenCL binaries
        self.renewals: list[dict] = []
        self._longest_call_s = 0.0  # the longest call that was not its session's first
        self._first_call_s = 0.0  # the last session's first call (OpenCL programs built there)
        self._calls = 0  # calls made in the current session
        self._transfer_s = 0.0  # the last move of the state between sessions (or first load)
        t0 = time.perf_counter()
        if remote is not None:
            rpc_session = remote.open()
        triple = m.host_triple
        self.remote = rpc_session is not None
        if not self.remote and triple and host_arch(triple) != machine_arch():
            raise ValueError(f"{export_dir} was linked for {triple} (the export's host), and "
                             f"this machine is {machine_arch()}: run it on that device with "
                             "--tracker HOST:PORT --key KEY, or export it again for this "
                             "machine (without --host)")
        self._explicit_device = device
        self._tuples = {}
        self.train_library = None  # the loaded train.so on a device server (_load_remote)
        if rpc_session is not None:
            self._load_remote(rpc_session)
        else:
            self.device = device or device_for(m.target["kind"])
            self._train_vm = VirtualMachine(
                tvm.runtime.load_module(os.path.join(export_dir, "train.so")), self.device)
            self._infer_vm = VirtualMachine(
                tvm.runtime.load_module(os.path.join(export_dir, "inference.so")), self.device)
        self.batch, self.infer_batch = m.batch, m.infer_batch
        self._t = {k: tvm.runtime.tensor(v, self.device) for k, v in tensors.items()}
        self._opt = self._initial_optimizer_state()
        self._rng = np.random.default_rng(seed)  # one dropout seed per training step
        self.steps = 0
        #: True: :meth:`train_step` runs the step and the update in one call (``train_step``,
        #: ``graph.add_train_step``); False: ``train_adjoint`` then ``optimizer``, the two-call
        #: form the one-function step is checked against (the same numbers bit for bit)
        self.one_function_step = True
        #: dynamic loss scaling of a step with float16 activation gradients (the manifest's
        #: ``loss_scale``, :mod:`thomas_tune.loss_scale`): the scale each step is given and the
        #: steps skipped; None for every other export
        self.scaler = (DynamicScaler(LossScale.from_dict(m.loss_scale)) if m.loss_scale
                       else None)
        self._transfer_s = time.perf_counter() - t0
        if remote is not None:
            self._check_room()

    def _load_remote(self, rpc_session) -> None:
        """Upload the two libraries to ``rpc_session``'s server and load them there."""
        m, export_dir = self.manifest, self.dir
        triple = m.host_triple
        self._rpc = rpc_session
        self.device = self._explicit_device or device_for(m.target["kind"], rpc_session)
        vms = {}
        for name in ("inference.so", "train.so"):
            rpc_session.upload(os.path.join(export_dir, name))
            try:  # a library of another architecture loads as a module with no functions
                lib = self.programs.load(rpc_session, name, os.path.join(export_dir, name),
                                         self.device)
                vms[name] = VirtualMachine(lib, self.device)
                if name == "train.so":  # the step check on the device runs this one too
                    self.train_library = lib
            except Exception as err:  # TVM raises its own error types
                raise ValueError(f"the device server could not load {name} of {export_dir}"
                                 f" (linked for {triple or 'an unknown host'}): "
                                 f"{first_line(err)}; export it for the device's "
                                 "architecture (--host android-aarch64 for a phone, "
                                 "linux-aarch64 for an aarch64 board)") from err
        self._train_vm, self._infer_vm = vms["train.so"], vms["inference.so"]
        self._get_item = rpc_session.get_function("ffi.ArrayGetItem")
        try:
            self._train_vm[PACK_TRAINABLE]
        except AttributeError as err:
            raise ValueError(f"{export_dir} has no {PACK_TRAINABLE} function, which "
                             "training over RPC needs: export it again") from err

    # ---- session lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """End the session: the device's tensors are freed and a device server is released
        for other clients. Read :meth:`tensors` or :meth:`save` first; any later call raises.
        Also called on leaving a ``with Session(...) as s:`` block."""
        self._drop_handles()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    def draw_masks(self, seed=None) -> list:
        """One training step's dropout masks, drawn on the device by the export's
        ``draw_masks`` (:mod:`thomas_tune.training_graph.dropout`; float32, shapes and order of the
        manifest's ``masks``), as device tensors; [] for a model without dropout. ``seed``: uint32
        array of shape (2,); None draws it from the session's seeded generator, as
        :meth:`train_step` does each step."""
        if not self.manifest.masks:
            return []
        if seed is None:
            seed = self._rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
        seed = tvm.runtime.tensor(np.asarray(seed, dtype=np.uint32).reshape(2), self.device)
        out = self._train_vm[DRAW_MASKS](seed)
        if self.remote:
            return [self._get_item(out, i) for i in range(len(self.manifest.masks))]
        return list(out)

    def _step_args(self, fn: str, first, y, masks: list) -> list:
        """The arguments of the training module's step function ``fn`` in its order: the
        batch's images (``ADJOINT``) or features (``HEAD_ADJOINT``), the dropout masks, the
        frozen parameters (``ADJOINT`` only), trainable parameters, the states the step
        updates (:meth:`_step_states`), labels (device tensors)."""
        m = self.manifest
        frozen = self._frozen_slots(fn) if fn in (ADJOINT, TRAIN_STEP) else []
        return [first, *masks, *frozen, *self._ordered(m.trainable),
                *self._ordered(self._step_states(fn)), y, *self._scale_args()]

    def _scale_args(self) -> list:
        """The loss scale a loss-scaled step takes after the labels (:attr:`scaler`), as a 0-d
        float32 device tensor; [] for another export."""
        if self.scaler is None:
            return []
        return [tvm.runtime.tensor(np.asarray(self.scaler.scale, "float32"), self.device)]

    @property
    def skipped_steps(self) -> int:
        """Steps whose update a loss-scaled export skipped (non-finite gradients); 0 for
        another export."""
        return self.scaler.skipped if self.scaler is not None else 0

    def _frozen_slots(self, fn: str) -> list:
        """What ``fn`` (``ADJOINT`` or ``TRAIN_STEP``) takes in the frozen parameters' place:
        the frozen parameters, or, in an export whose step had their transforms lifted out (the
        manifest's ``frozen_slots``, :mod:`thomas_tune.training_graph.lift`), per slot the parameter
        itself or the next value of ``fn``'s ``*_frozen`` function, which runs once after each load
        of the parameters."""
        m = self.manifest
        slots = m.train_step_slots if fn == TRAIN_STEP else m.frozen_slots
        if not slots:
            return self._ordered(m.frozen)
        lifted = TRAIN_STEP_FROZEN if fn == TRAIN_STEP else ADJOINT_FROZEN
        return self._slot_args(self._train_vm, lifted, slots, m.frozen_lift_inputs, key=None)

    def _slot_args(self, vm, frozen_fn: str, slots: list[str], names: list[str], key) -> list:
        """Per slot, the tensor ``slots`` names or the next value of ``vm``'s ``frozen_fn`` on
        the tensors ``names``; its values are kept until ``key`` changes or the tensors are
        loaded again (:meth:`load_tensors`)."""
        cached = self._tuples.get(frozen_fn)
        if cached is None or cached[0] != key:
            out = self._timed(lambda: vm[frozen_fn](*self._ordered(names)))
            cached = (key, lifted_values(out, slots, self._get_item if self.remote else None))
            self._tuples[frozen_fn] = cached
        return slot_arguments(slots, self._t.__getitem__, cached[1])

    def _step_states(self, fn: str) -> list[str]:
        """The states (running statistics) the step function ``fn`` takes and returns: all
        of them (``ADJOINT``), or the trainable layers' (``HEAD_ADJOINT``)."""
        if fn in (ADJOINT, TRAIN_STEP):
            return self.manifest.states
        return self.feature_split()["head_states"]

    def sync(self) -> None:
        """Wait for the device to finish queued work (for timing)."""
        self.device.sync()

    # ---- API -------------------------------------------------------------------------------
    def load_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Replace every parameter and state (float32, shapes of the exported model) and reset
        the optimizer state (and a loss scale), as if the export had been made with
        ``tensors``: one compiled module serves several starting points (pretrained, fresh).
        Raises ValueError for a missing or mis-shaped tensor."""
        for name, old in self._t.items():
            if name not in tensors or tuple(np.shape(tensors[name])) != tuple(old.shape):
                raise ValueError(f"load_tensors: {name!r} missing or not of shape "
                                 f"{tuple(old.shape)}")
        self._t = {k: tvm.runtime.tensor(np.asarray(tensors[k], dtype="float32"), self.device)
                   for k in self._t}
        self._opt = self._initial_optimizer_state()
        self._tuples = {}
        self.steps = 0
        if self.scaler is not None:  # the loss scale starts again too
            self.scaler = DynamicScaler(self.scaler.config)

    def load_checkpoint(self, path: str) -> None:
        """Start from the weights of a checkpoint (e.g. ``train --save``): same architecture and
        shapes as the export, no recompile. Its class names replace the export's. Raises
        ValueError for a checkpoint of another model, naming both."""
        model, tensors, classes = load_checkpoint(path)
        if (model.arch, model.config()) != (self.model.arch, self.model.config()):
            raise ValueError(f"checkpoint {path} holds {model.arch} {model.config()}, the export "
                             f"{self.dir} {self.model.arch} {self.model.config()}; export "
                             f"again with --checkpoint {path}")
        self.load_tensors(tensors)
        self.classes = classes or self.classes

    def tensors(self) -> dict[str, np.ndarray]:
        """Current parameters and states as float32 numpy arrays."""
        return {k: v.numpy() for k, v in self._t.items()}

    def _predict_chunks(self, which: str, batch, x):
        """Logits of ``x`` by the ``predict`` of the VM attribute ``which`` (``_infer_vm`` or
        ``_train_vm``), chunk by chunk; a due session renewal happens between chunks."""
        x = np.asarray(x, dtype="float32")
        out = []
        for i in range(0, len(x), batch):
            chunk = x[i:i + batch]
            n = len(chunk)
            if n < batch:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
            self._check_x(chunk, batch)
            if self._renew_due():
                self.renew()
            m, vm = self.manifest, getattr(self, which)
            names = m.params + m.states
            if which == "_infer_vm" and m.predict_slots:  # lifted (thomas_tune.training_graph.lift)
                params = self._slot_args(vm, PREDICT_FROZEN, m.predict_slots, names,
                                         key=self.steps)
            else:
                params = self._ordered(names)
            logits = self._timed(lambda: vm[PREDICT](tvm.runtime.tensor(chunk, self.device),
                                                     *params).numpy())
            out.append(logits[:n])
        return np.concatenate(out) if out else np.zeros((0, self.model.num_classes), "float32")

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits with the inference module (its compiled batch, usually 1)."""
        return self._predict_chunks("_infer_vm", self.infer_batch, x)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """Top-1 accuracy in [0, 1] on (x, y), with the training module's predict (same batch)."""
        if len(x) == 0:
            raise ValueError("evaluate: empty data set")
        logits = self._predict_chunks("_train_vm", self.batch, x)
        return float(np.mean(np.argmax(logits, axis=1) == np.asarray(y)))

    def upload(self, x: np.ndarray, y: np.ndarray) -> tuple:
        """Check a training batch and copy it to the device: x float32 (batch, C, H, W), y
        integer (batch,) labels in 0..classes-1. Returns (x, y) as device tensors, which
        :meth:`train_step` takes as they are (a loop over data already on the device, or a
        timing that leaves the copy out, as PyTorch's is timed). Raises ValueError for inputs
        of the wrong shape or dtype and for labels out of range."""
        x = self._check_x(x, self.batch)
        return tvm.runtime.tensor(x, self.device), self._labels(y)

    def _labels(self, y) -> tvm.runtime.Tensor:
        """Labels checked (integer (batch,), in 0..classes-1) and copied to the device as
        int64; ValueError otherwise."""
        y = np.asarray(y)
        if y.shape != (self.batch,) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"labels: expected integer ({self.batch},), got {y.dtype} {y.shape}")
        if y.min() < 0 or y.max() >= self.model.num_classes:
            raise ValueError(f"labels must be in 0..{self.model.num_classes - 1}")
        return tvm.runtime.tensor(y.astype("int64"), self.device)

    def train_step(self, x, y) -> float:
        """One training step on x float32 (batch, C, H, W) and y integer (batch,) labels in
        0..classes-1, as numpy arrays or as the device tensors of :meth:`upload`: returns the
        mean cross-entropy loss (float) and updates the trainable parameters, BatchNorm running
        statistics and optimizer state on the device. Dropout masks are drawn on the device
        (:meth:`draw_masks`) from a seed of the session's seeded generator. Raises ValueError
        for inputs of the wrong shape or dtype and for labels out of range (numpy inputs;
        :meth:`upload` checks device tensors)."""
        if self._renew_due():  # between steps: the batch is read back if it is on the device
            if isinstance(x, tvm.runtime.Tensor):
                x, y = x.numpy(), y.numpy()
            self.renew()
        if not (isinstance(x, tvm.runtime.Tensor) and isinstance(y, tvm.runtime.Tensor)):
            x, y = self.upload(x, y)
        # the step and the update in one call (graph.add_train_step), or two
        return self._step(TRAIN_STEP if self.one_function_step else ADJOINT, x, y)

    def feature_split(self) -> dict:
        """The manifest's ``features`` (``shape`` of one image's features, ``frozen_states``,
        ``head_states``) of an export made with ``--cache-features``. Raises ValueError for
        another export, saying how to make one."""
        split = self.manifest.features
        if not split:
            raise ValueError(f"{self.dir} was exported without --cache-features (it has no "
                             "features function): export it again with --cache-features and "
                             "--trainable last:K")
        return split

    def features(self, x: np.ndarray) -> np.ndarray:
        """The frozen part's output for images ``x`` (float32 (N, C, H, W), any N): float32
        (N, *shape) with the manifest's ``features`` shape, computed by the export's
        ``features`` function in chunks of the training batch (the last one padded), from the
        current frozen parameters and running statistics. What :meth:`train_step_features`
        trains on. Raises ValueError for an export without it (:meth:`feature_split`) and for
        images of the wrong shape or dtype."""
        split = self.feature_split()
        x = np.asarray(x, dtype="float32")
        out = np.empty((len(x), *split["shape"]), "float32")
        for i in range(0, len(x), self.batch):
            chunk = x[i:i + self.batch]
            n = len(chunk)
            if n < self.batch:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], self.batch - n, axis=0)])
            self._check_x(chunk, self.batch)
            if self._renew_due():
                self.renew()
            vm, names = self._train_vm, self.manifest.frozen + split["frozen_states"]
            slots = self.manifest.features_slots
            args = (self._slot_args(vm, FEATURES_FROZEN, slots, names, key=None) if slots
                    else self._ordered(names))
            out[i:i + n] = self._timed(lambda: vm[FEATURES](
                tvm.runtime.tensor(chunk, self.device), *args).numpy())[:n]
        return out

    def train_step_features(self, f, y) -> float:
        """One training step of the trainable layers on features ``f`` (float32 (batch,
        *shape), :meth:`features` of the batch's images) and labels ``y`` (integer (batch,)):
        the step :meth:`train_step` takes on those images, without computing the frozen part
        (the export's ``train_head_adjoint``). Returns the mean cross-entropy loss and updates
        the trainable parameters, their layers' running statistics and the optimizer state on
        the device; dropout masks drawn as :meth:`train_step` draws them. Raises ValueError
        for an export without the split (:meth:`feature_split`), features of the wrong shape
        or dtype and labels out of range."""
        split = self.feature_split()
        if self._renew_due():
            if isinstance(f, tvm.runtime.Tensor):
                f, y = f.numpy(), y.numpy()
            self.renew()
        if not (isinstance(f, tvm.runtime.Tensor) and isinstance(y, tvm.runtime.Tensor)):
            want = (self.batch, *split["shape"])
            f = np.asarray(f)
            if f.dtype != np.float32 or f.shape != want:
                raise ValueError(f"features: expected float32 {want}, got {f.dtype} {f.shape}")
            f, y = tvm.runtime.tensor(f, self.device), self._labels(y)
        return self._step(HEAD_ADJOINT, f, y)

    def _step(self, fn: str, first, y) -> float:
        """One step of the step function ``fn`` (``ADJOINT`` or ``HEAD_ADJOINT``) on device
        tensors ``first`` (images or features) and ``y``, then the optimizer; or both in one
        call of ``fn`` = ``TRAIN_STEP``."""
        m, states = self.manifest, self._step_states(fn)
        if self.remote:
            masks = self.draw_masks()
            return self._timed(lambda: self._remote_step(fn, first, y, masks, states))
        args = self._step_args(fn, first, y, self.draw_masks())
        if fn == TRAIN_STEP:
            ret, new_params, self._opt, *skipped = self._train_vm[fn](*args, self._opt)
        else:
            ret, grads = self._train_vm[fn](*args)
            new_params, self._opt, *skipped = self._train_vm[OPTIMIZER](
                self._ordered(m.trainable), grads, self._opt, *self._scale_args())
        if self.scaler is not None:
            self.scaler.update(float(skipped[0].numpy()) > 0)  # non-finite count: 0 updated
        loss = ret[0] if states else ret
        if states:
            for name, value in zip(states, list(ret)[1:]):
                self._t[name] = value
        for name, value in zip(m.trainable, new_params):
            self._t[name] = value
        self.steps += 1
        return float(loss.numpy())

    def _remote_step(self, fn: str, first, y, masks: list, states: list[str]) -> float:
        # the results stay on the device: a handle to each tuple, single tensors read there
        m, get, vm = self.manifest, self._get_item, self._train_vm
        if "params" not in self._tuples:
            # the trainable parameters and the optimizer state as tuples the device's VM owns
            # (a tensor argument that arrived over RPC is only borrowed for the call); the
            # updates write into them in place
            self._tuples["params"] = vm[PACK_TRAINABLE](*self._ordered(m.trainable))
            self._tuples["opt"] = vm[PACK_OPTIMIZER_STATE](*self._opt)
            for i, name in enumerate(m.trainable):
                self._t[name] = get(self._tuples["params"], i)
        args = self._step_args(fn, first, y, masks)
        if fn == TRAIN_STEP:  # the update writes into the session's tuple of parameters
            out = vm[fn](*args, self._tuples["opt"])
            self._tuples["opt"] = get(out, 2)
            if self.scaler is not None:
                self.scaler.update(float(get(out, 3).numpy()) > 0)
        else:
            out = vm[fn](*args)
            res = vm[OPTIMIZER](self._tuples["params"], get(out, 1), self._tuples["opt"],
                                *self._scale_args())
            self._tuples.update(params=get(res, 0), opt=get(res, 1))
            if self.scaler is not None:
                self.scaler.update(float(get(res, 2).numpy()) > 0)
            for i, name in enumerate(m.trainable):
                self._t[name] = get(self._tuples["params"], i)
        if states:
            head = get(out, 0)
            loss = get(head, 0)
            for i, name in enumerate(states):
                self._t[name] = get(head, i + 1)
        else:
            loss = get(out, 0)
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
