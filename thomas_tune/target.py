"""Targets: what the user types (``llvm``, ``opencl``, a tag, a JSON dict) -> ``tvm.target.Target``.

This TVM takes targets as JSON dicts (plain strings such as ``"llvm"`` raise) or tag names.
"""

from __future__ import annotations

import json
import os

import tvm

HOST = {"kind": "llvm"}
GPU_KINDS = ("opencl", "cuda", "vulkan", "metal", "rocm")


def parse_target(text: str | dict | tvm.target.Target) -> tvm.target.Target:
    """Build a target from ``llvm``, ``opencl``, ``opencl:N`` (built from what this machine's
    OpenCL device N reports: work-group size, local memory), a tag (``qcom/adreno-opencl``),
    JSON, or a ``.json`` file holding JSON.

    A GPU target gets an ``llvm`` host. Raises ValueError naming the accepted forms.
    """
    if isinstance(text, tvm.target.Target):
        return text
    if isinstance(text, str):
        text = text.strip()
        if text.endswith(".json") and not text.startswith("{"):
            try:
                with open(text) as f:
                    text = f.read().strip()
            except OSError as err:
                raise ValueError(f"target file {text!r}: {err.strerror}") from err
        if text.startswith("opencl:") and text[7:].isdigit():
            from .opencl import target_for  # limits as this machine's OpenCL device reports
            return target_for(int(text[7:]))
        if text.startswith("{"):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"target {text!r}: invalid JSON ({err})") from err
        elif "/" in text:
            try:
                target = tvm.target.Target(text)
            except Exception as err:  # TVM raises its own error types
                raise ValueError(f"target {text!r}: unknown tag ({err})") from err
            return tvm.target.Target(target, host=HOST) if target.kind.name in GPU_KINDS else target
        else:
            text = {"kind": text}
    try:
        host = text.pop("host", None) if isinstance(text, dict) else None
        kind = text.get("kind") if isinstance(text, dict) else None
        if host is None and kind in GPU_KINDS:
            host = HOST
        if kind == "llvm" and "num-cores" not in text:
            # MetaSchedule's CPU rules need the core count; default to this machine's.
            text = {**text, "num-cores": os.cpu_count() or 1}
        return tvm.target.Target(text, host=host) if host else tvm.target.Target(text)
    except Exception as err:
        raise ValueError(f"target {text!r}: not a target TVM knows; use llvm, opencl, a tag such "
                         f"as qcom/adreno-opencl, or a JSON dict ({err})") from err


def is_gpu(target: tvm.target.Target) -> bool:
    """True for targets whose kernels need thread bindings (OpenCL, CUDA, Vulkan, ...)."""
    return target.kind.name in GPU_KINDS


def device_kind(target: tvm.target.Target) -> str:
    """The runtime device name for a target (``cpu``, ``opencl``, ...)."""
    return "cpu" if target.kind.name == "llvm" else target.kind.name


def describe(target: tvm.target.Target) -> str:
    """A short, file-name-safe name for a target, e.g. ``llvm`` or ``opencl-adreno``."""
    dev = str(target.attrs.get("device", "")) if hasattr(target, "attrs") else ""
    return target.kind.name + (f"-{dev}" if dev else "")
