"""An export checked against a device's limits before its first step.

A buffer larger than the device's largest allocation (``CL_DEVICE_MAX_MEM_ALLOC_SIZE``), a
step whose tensors do not fit its global memory, or a kernel that asks for more local memory
or larger work-groups than the device has, fails on the device with a bare OpenCL error code
(``CL_INVALID_BUFFER_SIZE``, ``CL_MEM_OBJECT_ALLOCATION_FAILURE``,
``CL_OUT_OF_RESOURCES``, ``CL_INVALID_WORK_GROUP_SIZE``). :func:`check_export` finds these
from the export alone and a device profile (``thomas-tune rpc probe``,
:mod:`thomas_tune.rpc.probe`), and names the tensor or kernel and the fix.

What an export tells, without TVM's compiler:

* tensors: every parameter and BatchNorm state (``params.npz``), the optimizer's state
  (``optim_state.npz``), the input batches (the manifest's ``input_shape`` and ``batch``),
  and the largest tensors of the training step with the step's peak (the manifest's
  ``buffers``, written by ``export`` from the training graph: :func:`step_buffers`). The
  Relax VM's memory plan puts each tensor in a storage at least its size, so a tensor over
  the largest allocation cannot run; the resident tensors (parameters, states, optimizer
  state, the input batch, the step's largest tensor) live at once, so their sum over the
  global memory cannot run either. The peak (liveness over the step's bindings,
  :mod:`thomas_tune.memory`) is an upper bound: over the global memory it is a warning;
* kernels: each kernel's ``__local`` arrays, from the OpenCL C embedded in ``train.so`` and
  ``inference.so`` (:func:`library_kernels`), against ``CL_DEVICE_LOCAL_MEM_SIZE``; the
  work-group sizes are set by the host code, not written in the source: the schedules keep
  them within the target's ``max_threads_per_block``, which is checked against
  ``CL_DEVICE_MAX_WORK_GROUP_SIZE``.
"""

from __future__ import annotations

import os
import re

import numpy as np

from .manifest import Manifest

MIB = 1 << 20
_LOCAL_ARRAY = re.compile(r"__local\s+(\w+)\s+(\w+)\s*\[(\d+)\]")
_FUNCTION = re.compile(r"^// Function: (\w+)\s*$", re.M)
STEP_BUFFERS_KEPT = 8  # the largest tensors of the step the manifest lists


class DeviceLimitError(ValueError):
    """An export that the device cannot run: the message names the tensor or kernel, the
    device's limit and the fix."""


def step_buffers(func, keep: int = STEP_BUFFERS_KEPT) -> dict:
    """The largest tensors a Relax training function (``train_adjoint``) computes and its
    peak: ``{"tensors": [{"name", "op", "shape", "bytes"}, ...]`` (the ``keep`` largest,
    largest first), ``"peak_bytes"`` (:mod:`thomas_tune.memory`'s liveness peak, an upper
    bound)}. Tensors of a shape that is not static are left out."""
    from tvm import relax

    from .memory import _liveness_peak
    found = []
    for block in func.body.blocks:
        for b in block.bindings:
            ty = b.var.ty
            if not isinstance(ty, relax.TensorType) or ty.shape is None:
                continue
            try:
                shape = [int(d) for d in ty.shape.values]
            except (TypeError, AttributeError):
                continue
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(str(ty.dtype)).itemsize
            v = b.value
            if not isinstance(v, relax.Call):  # a view or a copy of a tensor counted already
                continue
            op = str(getattr(v.op, "name", v.op))
            if op == "relax.call_tir":  # name the kernel it calls
                op = str(getattr(v.args[0], "name_hint", op))
            found.append({"name": str(b.var.name), "op": str(op), "shape": shape,
                          "bytes": nbytes})
    found.sort(key=lambda t: -t["bytes"])
    return {"tensors": found[:keep], "peak_bytes": int(_liveness_peak(func)[0])}


def _read_text(data: bytes, at: int) -> tuple[str, int]:
    n = int.from_bytes(data[at:at + 8], "little")
    return data[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n


def library_kernels(path: str) -> dict[str, str]:
    """The OpenCL C of each kernel embedded in the exported library ``path`` (name -> source),
    read from the bytes TVM embeds for an "opencl" module: format ``cl``, the function map,
    then the source (:func:`thomas_tune.opencl.serialize` writes the same layout), split at
    the code generator's ``// Function: NAME`` lines. Empty for a library with no OpenCL."""
    with open(path, "rb") as f:
        data = f.read()
    out: dict[str, str] = {}
    at = data.find(b"\x02\x00\x00\x00\x00\x00\x00\x00cl")
    while at >= 0:
        pos = at + 10
        try:
            count = int.from_bytes(data[pos:pos + 8], "little")
            pos += 8
            for _ in range(count):
                _, pos = _read_text(data, pos)  # key
                _, pos = _read_text(data, pos)  # name
                pos += 8 + 4 * int.from_bytes(data[pos:pos + 8], "little")  # argument dtypes
                tags = int.from_bytes(data[pos:pos + 8], "little")
                pos += 8
                for _ in range(tags):
                    _, pos = _read_text(data, pos)
                pos += 8 + 4 * int.from_bytes(data[pos:pos + 8], "little")  # extra tags
            source, _ = _read_text(data, pos)
        except (ValueError, IndexError):
            source = ""
        parts = _FUNCTION.split(source)
        for name, body in zip(parts[1::2], parts[2::2]):
            out[name] = body
        at = data.find(b"\x02\x00\x00\x00\x00\x00\x00\x00cl", at + 10)
    return out


def local_bytes(source: str) -> int:
    """Bytes of the ``__local`` arrays a kernel's OpenCL C declares."""
    from .opencl_source import SCALAR_BYTES
    total = 0
    for ctype, _, n in _LOCAL_ARRAY.findall(source):
        m = re.match(r"([a-z]+?)(\d*)$", ctype)
        lanes = int(m.group(2)) if m and m.group(2) else 1
        total += SCALAR_BYTES.get(m.group(1) if m else ctype, 4) * lanes * int(n)
    return total


def export_tensors(export_dir: str, manifest: Manifest, mode: str) -> list[dict]:
    """The tensors of an export a run of ``mode`` (``train`` or ``infer``) allocates, each
    ``{"name", "shape", "bytes", "batch"}`` (``batch``: the batch it grows with, or None)."""
    tensors = []
    with np.load(os.path.join(export_dir, "params.npz")) as z:
        for name in z.files:
            if not name.startswith("__"):
                tensors.append({"name": name, "shape": list(z[name].shape),
                                "bytes": int(z[name].nbytes), "batch": None})
    shape = list(manifest.input_shape)
    b = manifest.batch if mode == "train" else manifest.infer_batch
    tensors.append({"name": f"the input batch ({mode})", "shape": [b, *shape[1:]],
                    "bytes": 4 * int(np.prod([b, *shape[1:]])), "batch": b})
    if mode == "train":
        path = os.path.join(export_dir, "optim_state.npz")
        if os.path.exists(path):
            with np.load(path) as z:
                for name in z.files:
                    tensors.append({"name": f"optimizer state {name}",
                                    "shape": list(z[name].shape),
                                    "bytes": int(z[name].nbytes), "batch": None})
        for t in manifest.buffers.get("tensors", []):
            grows = bool(t["shape"]) and t["shape"][0] == manifest.batch
            tensors.append({"name": f"step tensor {t['name']} ({t['op']})",
                            "shape": t["shape"], "bytes": int(t["bytes"]),
                            "batch": manifest.batch if grows else None})
    return tensors


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _fix(t: dict, limit: int) -> str:
    """The fix for tensor ``t`` over ``limit`` bytes: a smaller batch where it grows with it."""
    if t["batch"]:
        fits = max(1, t["batch"] * limit // max(t["bytes"], 1))
        return (f"export again with a smaller batch (--batch {min(fits, t['batch'] - 1)} or "
                "less)" if t["batch"] > 1 else "a smaller input resolution (--resolution)")
    return "a smaller model (--width)"


def check_export(export_dir: str, profile: dict, mode: str = "train") -> list[str]:
    """Check the export in ``export_dir`` against a device profile (``thomas-tune rpc probe``)
    for a run of ``mode`` (``train``: the training step's tensors and ``train.so``'s kernels,
    ``infer``: the inference module's, ``export``: both). Returns warnings (lines: the step's
    peak, an upper bound, over the global memory; an export whose manifest lists no step
    tensors). Raises :class:`DeviceLimitError` for an autocast16 export and a device without
    ``cl_khr_fp16``, naming the first tensor over the largest
    allocation, the resident tensors over the global memory, a kernel over the local memory,
    or the target's work-group size over the device's, each with the fix."""
    manifest = Manifest.read(export_dir)
    props, sources = profile["properties"], profile.get("sources", {})
    where = f"the device {props.get('device_name', '?')!r} (profile of key {profile.get('key')!r})"
    _check_half_arithmetic(manifest, props, where)
    modes = ("train", "infer") if mode == "export" else (mode,)
    warnings = []
    alloc, memory = int(props["max_alloc_bytes"]), int(props["global_memory_bytes"])
    alloc_src = sources.get("max_alloc_bytes", "CL_DEVICE_MAX_MEM_ALLOC_SIZE")
    for m in modes:
        tensors = export_tensors(export_dir, manifest, m)
        for t in sorted(tensors, key=lambda t: -t["bytes"]):
            if t["bytes"] > alloc:
                raise DeviceLimitError(
                    f"{t['name']} {t['shape']} takes {_mib(t['bytes'])}, more than the largest "
                    f"allocation of {where}, {_mib(alloc)} ({alloc_src}): "
                    f"{_fix(t, alloc)}")
        steps = [t for t in tensors if t["name"].startswith("step tensor")]
        resident = sum(t["bytes"] for t in tensors if t not in steps) + \
            max((t["bytes"] for t in steps), default=0)
        if resident > memory:
            big = max(tensors, key=lambda t: t["bytes"] if t["batch"] else 0)
            raise DeviceLimitError(
                f"the {m} run needs at least {_mib(resident)} at once (parameters, states, "
                f"optimizer state, input batch, the step's largest tensor), more than the "
                f"global memory of {where}, {_mib(memory)}: {_fix(big, memory)}")
        peak = manifest.buffers["peak_bytes"]
        if m == "train" and peak > memory:
            warnings.append(f"the training step's peak, at most {_mib(peak)} (liveness over "
                            f"its tensors, an upper bound), is over the global memory of "
                            f"{where}, {_mib(memory)}: if the step fails to allocate, "
                            "export with a smaller batch")
    _check_kernels(export_dir, manifest, modes, props, where)
    return warnings


def profile_reports_fp16(props: dict) -> bool | None:
    """Whether a device profile's ``properties`` (``thomas-tune rpc probe``) say the device
    reports ``cl_khr_fp16``: its extension list, else its ``fp16`` (found by building a half
    kernel); None where the profile says neither."""
    if "extensions" in props:
        return "cl_khr_fp16" in str(props["extensions"] or "").split()
    if "fp16" in props:
        return bool(props["fp16"])
    return None


def _check_half_arithmetic(manifest: Manifest, props: dict, where: str) -> None:
    """DeviceLimitError for an export of ``--precision autocast16`` (half arithmetic) and a
    device whose profile says it has no ``cl_khr_fp16`` (:func:`profile_reports_fp16`): its
    OpenCL programs would fail to build there. Nothing where the profile does not say."""
    if manifest.precision == "autocast16" and profile_reports_fp16(props) is False:
        raise DeviceLimitError(
            f"the export computes in float16 (--precision autocast16), which OpenCL C allows "
            f"only with cl_khr_fp16, and {where} does not report it: export again with "
            "--precision mixed16 (float16 storage, core OpenCL on every device)")


def _check_kernels(export_dir, manifest, modes, props, where) -> None:
    threads = manifest.target.get("max_threads_per_block")
    wg = int(props["max_work_group_size"])
    if threads is not None and int(threads) > wg:
        raise DeviceLimitError(
            f"the export's target allows work-groups of {int(threads)} work-items "
            f"(max_threads_per_block), {where} at most {wg} (CL_DEVICE_MAX_WORK_GROUP_SIZE): "
            "export again for this device's target (--target opencl:remote with --tracker and "
            f"--key, or a target file whose max_threads_per_block is at most {wg})")
    local = int(props["local_memory_bytes"])
    libraries = {"train": "train.so", "infer": "inference.so"}
    for m in modes:
        path = os.path.join(export_dir, libraries[m])
        if not os.path.exists(path):
            continue
        for name, source in library_kernels(path).items():
            need = local_bytes(source)
            if need > local:
                raise DeviceLimitError(
                    f"kernel {name} of {libraries[m]} declares {need} bytes of local memory, "
                    f"{where} has {local} (CL_DEVICE_LOCAL_MEM_SIZE): export again for this "
                    "device's target (--target opencl:remote, or a target file whose "
                    f"max_shared_memory_per_block is at most {local}), with a tuning log made "
                    "on it")


def find_profile(*folders: str | None) -> str | None:
    """The first ``device_profile.json`` in ``folders`` (an export, a tuning log), or None."""
    from .rpc.probe import PROFILE_FILE
    for folder in folders:
        if folder and os.path.exists(os.path.join(folder, PROFILE_FILE)):
            return os.path.join(folder, PROFILE_FILE)
    return None


def check_before_run(export_dir: str, mode: str, profile_path: str | None = None,
                     say=print) -> dict | None:
    """The check a ``train``, ``infer`` or ``export`` runs before the first step: the profile
    ``profile_path`` (or the export's own ``device_profile.json``; none: no check, None
    returned) read (:func:`thomas_tune.rpc.probe.read_profile`) and :func:`check_export`
    run; its warnings go to ``say``. Returns the profile. Raises DeviceLimitError, ValueError
    for a profile that is not one."""
    from .rpc.probe import read_profile
    path = profile_path or find_profile(export_dir)
    if path is None:
        return None
    profile = read_profile(path)
    for line in check_export(export_dir, profile, mode):
        say(f"warning: {line}")
    return profile


#: the tuning runner's bound on a trial's program build (s) without a profile, and its floor
COMPILE_FLOOR_S = 30.0
#: the bound is this many times the probed compile time of the slowest fresh program: a tuned
#: candidate's program is larger than the probe's, and a trial builds its check kernels too
COMPILE_MULTIPLE = 20.0
#: the bound on a trial's timed runs (s) without a profile, and its floor
TRIAL_FLOOR_S = 20.0


def runner_bounds(profile: dict | None, compile_timeout_s: float | None = None,
                  trial_timeout_s: float | None = None, repeat: int = 3,
                  max_number: int = 1000) -> tuple[float, float, str]:
    """(compile_timeout_s, trial_timeout_s, how) for the tuning runner
    (:class:`thomas_tune.measure.runner.FarmRunner`): a bound given wins; else, with a device
    profile, the program build may take :data:`COMPILE_MULTIPLE` x the probed
    ``compile_s_max`` (at least :data:`COMPILE_FLOOR_S`), and the timed runs 4 x the launch
    overhead of ``repeat`` x ``max_number`` launches (at least :data:`TRIAL_FLOOR_S`); without
    one, the floors. ``how``: a line saying where the bounds came from."""
    compile_s, trial_s = COMPILE_FLOOR_S, TRIAL_FLOOR_S
    how = "default bounds (no device profile)"
    if profile is not None:
        m = profile["measured"]
        compile_s = max(COMPILE_FLOOR_S, COMPILE_MULTIPLE * float(m["compile_s_max"]))
        trial_s = max(TRIAL_FLOOR_S, 4 * repeat * max_number * float(m["launch_us"]) * 1e-6)
        how = (f"bounds from the device profile of key {profile.get('key')!r}: program build "
               f"{compile_s:g} s ({COMPILE_MULTIPLE:g} x the probed {m['compile_s_max']:.3g} s, "
               f"at least {COMPILE_FLOOR_S:g} s), timed runs {trial_s:g} s")
    if compile_timeout_s is not None or trial_timeout_s is not None:
        how += "; given: " + ", ".join(
            f"{n} {v:g} s" for n, v in (("--compile-timeout", compile_timeout_s),
                                        ("--trial-timeout", trial_timeout_s)) if v is not None)
    return (compile_s if compile_timeout_s is None else compile_timeout_s,
            trial_s if trial_timeout_s is None else trial_timeout_s, how)
