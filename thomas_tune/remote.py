"""Device servers of a tracker reached in sessions of a stated lifetime, and a session's life
within that bound.

Every RPC session is asked for a stated lifetime in whole seconds (:class:`RemoteDevice`,
:func:`connect`): TVM's C++ server ``tvm_rpc`` accepts only digits after ``-timeout=`` (anything
else ends the server), and sets no bound at all when asked for none. :class:`SessionLifetime`
is the part of :class:`thomas_tune.runtime.Session` that times its calls and renews its session
between them before the bound could cut one (:meth:`SessionLifetime.renew`); a call cut all
the same raises :class:`SessionExpired`. :func:`check_device` runs a probe kernel linked for
the target's host on a device server, before any tuning.
"""

from __future__ import annotations

import gc
import math
import os
import time

import numpy as np
import tvm

from .models.layers import require_compiler


def first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("File ", "Traceback"))]
    return (useful or lines or [type(err).__name__])[-1][:300]



class SessionExpired(TimeoutError):
    """A device server ended a session at its bound before a call (or the read-back of the
    state for a renewal) was done: what the session held on the device is lost."""


class RemoteDevice:
    """Device servers of one tracker key, reached in sessions of a stated lifetime.

    ``session_timeout_s``: the lifetime asked of each session (whole seconds, rounded up:
    :func:`thomas_tune.rpc.whole_seconds`; None: :data:`thomas_tune.rpc.DEFAULT_SESSION_TIMEOUT_S`);
    the server ends the session at that age.
    ``wait_s``: how long :meth:`open` waits for a free server of ``key`` (s).
    :meth:`remaining_s` counts from just before the request, so it never overstates what the
    server's own clock leaves. Raises ValueError for a bad timeout."""

    def __init__(self, tracker: tuple[str, int], key: str, session_timeout_s=None,
                 wait_s: float = 60.0):
        from .rpc import DEFAULT_SESSION_TIMEOUT_S, whole_seconds
        self.tracker, self.key, self.wait_s = tuple(tracker), key, wait_s
        self.session_timeout_s = whole_seconds(  # 0 is refused there, never made the default
            DEFAULT_SESSION_TIMEOUT_S if session_timeout_s is None else session_timeout_s)
        self.opened_at: float | None = None
        self.opens = 0

    def open(self):
        """A new ``tvm.rpc`` session on a free server of the key (waiting up to ``wait_s``).
        Raises TimeoutError naming the key when none is free."""
        from .rpc import request_session, wait_for_key
        wait_for_key(self.tracker, self.key, timeout=self.wait_s)
        started = time.monotonic()
        session = request_session(self.tracker, self.key, self.session_timeout_s)
        self.opened_at = started
        self.opens += 1
        return session

    def remaining_s(self) -> float:
        """Seconds left of the current session's lifetime (0 before the first :meth:`open`)."""
        if self.opened_at is None:
            return 0.0
        return self.session_timeout_s - (time.monotonic() - self.opened_at)



class SessionLifetime:
    """Call timing, the session's bound and its renewal, for :class:`thomas_tune.runtime.Session`.

    The session sets ``_remote_device`` (a :class:`RemoteDevice` or None), ``remote``,
    ``programs`` (:class:`~thomas_tune.programs.SessionPrograms`), ``renewals``,
    ``_longest_call_s``, ``_first_call_s``, ``_calls``, ``_transfer_s``, ``steps``, ``dir``,
    the device handles (``_t``, ``_opt``, ``_tuples``, ``_train_vm``, ``_infer_vm``,
    ``_get_item``, ``_rpc``, ``device``, ``train_library``), and offers
    ``_load_remote(rpc_session)``."""

    @property
    def rpc_session(self):
        """The ``tvm.rpc`` session the libraries are loaded in now (None on this machine); a
        renewal replaces it."""
        return getattr(self, "_rpc", None)

    def _margin_s(self) -> float:
        """Seconds a session must still have before a call is started in it: two of the
        longest calls seen so far (a session's first call, which builds the OpenCL programs,
        counted apart and only before a session's first call), plus the last move of the state
        between sessions (what reading it back takes, at most), plus 1 s."""
        first = self._first_call_s if self._calls == 0 else 0.0
        return first + 2.0 * self._longest_call_s + self._transfer_s + 1.0

    def _check_room(self) -> None:
        left, need = self._remote_device.remaining_s(), self._margin_s()
        if left < need:
            bound = self._remote_device.session_timeout_s
            raise ValueError(f"a session of {bound} s leaves {max(left, 0):.1f} s after "
                             f"loading {self.dir}, less than the next call needs "
                             f"({need:.1f} s: its first call {self._first_call_s:.1f} s, the "
                             f"longest {self._longest_call_s:.1f} s, moving the state "
                             f"{self._transfer_s:.1f} s): give --session-timeout "
                             f"{math.ceil(4 * (bound - left + need))} or more")

    def _renew_due(self) -> bool:
        return (self._remote_device is not None
                and self._remote_device.remaining_s() < self._margin_s())

    def _timed(self, fn, *args):
        """``fn(*args)``, its wall time kept as the longest call when it is; a remote call
        that fails once the session's bound is reached says so."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
            self._calls += 1
        except Exception as err:  # TVM raises its own error types
            self._raise_if_expired(err, f"a call of {time.perf_counter() - t0:.1f} s")
            raise
        took = time.perf_counter() - t0
        if self._calls == 1:
            self._first_call_s = took
            if self.remote:  # the programs built in this session's first call, kept
                rd = self._remote_device  # (a fetch leaves room for the next call or renewal)
                self.programs.after_first_call(
                    took, rd and (lambda: rd.remaining_s() - self._margin_s()))
        else:
            self._longest_call_s = max(self._longest_call_s, took)
        return out

    def _raise_if_expired(self, err: Exception, during: str) -> None:
        """Raise :class:`SessionExpired` for ``err`` when the session's bound has come."""
        if self._remote_device is not None and self._remote_device.remaining_s() <= 1.0:
            bound = self._remote_device.session_timeout_s
            first = (f"; a session's first call, which builds the OpenCL programs, took "
                     f"{self._first_call_s:.1f} s" if self._first_call_s else "")
            raise SessionExpired(
                f"the device server ended the session at its {bound} s bound during {during} "
                f"(step {self.steps}{first}); the state on the device is lost: give a longer "
                f"--session-timeout ({first_line(err)})") from err

    def _optimizer_state_numpy(self) -> list[np.ndarray]:
        if "opt" in self._tuples:
            return [self._get_item(self._tuples["opt"], i).numpy()
                    for i in range(len(self._opt))]
        return [a.numpy() for a in self._opt]

    def renew(self) -> dict:
        """Move to a new session of the same key: read the parameters, states and optimizer
        state back from the device, end the old session, request a new one, upload and load
        the libraries and upload the state. Training goes on from the same numbers (the
        dropout seeds come from this side). Returns the renewal's record (also appended to
        :attr:`renewals`). Raises ValueError without a :class:`RemoteDevice`, or when the new
        session leaves no room for a step; :class:`SessionExpired` when the old session ended
        before its state was read back."""
        if self._remote_device is None:
            raise ValueError("renew: this session was not opened from a RemoteDevice (pass "
                             "remote=RemoteDevice(tracker, key, session_timeout_s))")
        t0 = time.perf_counter()
        try:
            tensors = {k: v.numpy() for k, v in self._t.items()}
            opt = self._optimizer_state_numpy()
        except Exception as err:  # TVM raises its own error types
            self._raise_if_expired(err, "the read-back of the state for a renewal")
            raise
        t1 = time.perf_counter()
        self._drop_handles()  # so that the old session's server is free for the new one
        self._load_remote(self._remote_device.open())
        self._t = {k: tvm.runtime.tensor(v, self.device) for k, v in tensors.items()}
        self._opt = [tvm.runtime.tensor(a, self.device) for a in opt]
        t2 = time.perf_counter()
        self._calls, self._transfer_s = 0, t2 - t0
        record = {"step": self.steps, "download_s": t1 - t0, "reopen_s": t2 - t1,
                  "state_bytes": int(sum(a.nbytes for a in tensors.values())
                                     + sum(a.nbytes for a in opt))}
        self.renewals.append(record)
        self._check_room()
        return record

    def _drop_handles(self) -> None:
        """Let go of every handle into the device (tensors, VMs, the RPC session): over RPC,
        the server ends the session and is free for the next client once they are gone."""
        self._t, self._opt, self._tuples = {}, [], {}
        self.programs.release()
        # (a remote device keeps its session alive: client.py sets dev._rpc_sess)
        self._train_vm = self._infer_vm = self._get_item = self._rpc = self.device = None
        self.train_library = None  # the loaded train.so holds its session too
        gc.collect()


def connect(tracker: tuple[str, int], key: str, timeout: float = 60.0,
            session_timeout_s=None):
    """A session on a free device server of ``key`` (``tvm.rpc``), waiting up to ``timeout``
    seconds for one, asked to last at most ``session_timeout_s`` seconds (whole seconds;
    default :data:`thomas_tune.rpc.DEFAULT_SESSION_TIMEOUT_S`). For runs that may outlast it,
    give :class:`Session` a :class:`RemoteDevice` instead: it renews the session.
    Raises TimeoutError naming the key and the keys the tracker knows; ValueError for a bad
    ``session_timeout_s``."""
    from .rpc import DEFAULT_SESSION_TIMEOUT_S, request_session, wait_for_key
    wait_for_key(tracker, key, timeout=timeout)
    return request_session(tracker, key, DEFAULT_SESSION_TIMEOUT_S if session_timeout_s is None
                           else session_timeout_s)


def check_device(tracker: tuple[str, int], key: str, target: tvm.target.Target,
                 timeout: float = 60.0) -> str:
    """Link a one-line kernel for the target's host as tuning and export do, load it on a
    device server of ``key`` and run it there: a device of another architecture than the
    target's host fails here, before any tuning. Returns the host triple checked.

    Raises ValueError naming the triple, the key and the fix; TimeoutError when no server of
    the key is free within ``timeout`` seconds; RuntimeError in a process without TVM's
    compiler (``TVM_USE_RUNTIME_LIB=1``)."""
    import tempfile

    require_compiler("check_device (it links a probe kernel)")

    from tvm import te

    from .target import export_shared, host_triple
    triple = host_triple(target)
    host = target if target.kind.name == "llvm" else target.host
    a = te.placeholder((4,), "float32", name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    lib = tvm.compile(te.create_prim_func([a, b]).with_attr("global_symbol", "probe"),
                      target=host)
    with tempfile.TemporaryDirectory(prefix="thomas-tune-probe-") as folder:
        path = os.path.join(folder, "probe.so")
        export_shared(lib, path, target)
        sess = connect(tracker, key, timeout)
        try:
            sess.upload(path)
            dev = sess.cpu(0)
            x = tvm.runtime.tensor(np.arange(4, dtype="float32"), dev)
            y = tvm.runtime.tensor(np.zeros(4, "float32"), dev)
            sess.load_module("probe.so")["probe"](x, y)
            ok = np.array_equal(y.numpy(), np.arange(4, dtype="float32") + 1)
        except Exception as err:  # TVM raises its own error types
            raise ValueError(f"the device server of key {key!r} cannot run code linked for "
                             f"{triple} ({first_line(err)}): give the target the device's "
                             "host, e.g. --host android-aarch64 for a phone or linux-aarch64 "
                             "for an aarch64 board, with TVM_NDK_CC naming its cross "
                             "compiler") from err
        finally:
            del sess
    if not ok:
        raise ValueError(f"the device server of key {key!r} ran a kernel linked for {triple} "
                         "and returned wrong numbers")
    return triple


def device_train_library(export_dir: str, rpc_session):
    """The export's ``train.so`` uploaded to ``rpc_session``'s device server and loaded there
    (a ``tvm.runtime.Module`` of that session), under its own name: writing over a library the
    server has loaded (a Session's ``train.so``) ends the server's session process."""
    rpc_session.upload(os.path.join(export_dir, "train.so"), "step_check_train.so")
    return rpc_session.load_module("step_check_train.so")
