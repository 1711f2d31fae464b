"""Dynamic loss scaling of a half-gradient step (``--precision mixed16 --loss-scale dynamic``).

A step whose activation gradients are stored as float16 (:mod:`thomas_tune.half_grads`) loses
gradients below float16's smallest subnormal (2^-24) to zero and turns those above its largest
value (65,504) into infinities. Loss scaling moves them into range: the step multiplies the
loss's gradient by a scale ``S`` (its input ``loss_scale``, a 0-d float32), so every gradient of
the backward is ``S`` times the true one; the optimizer multiplies each parameter gradient by
``1 / S`` (float32) before its update, and a step whose unscaled parameter gradients are not all
finite changes no parameter and no optimizer state (the compiled step decides, and returns a
0-d float32: how many unscaled gradient elements are not finite, 0 where it updated).

:class:`DynamicScaler` chooses ``S`` step by step as PyTorch's ``torch.amp.GradScaler`` does
(``GradScaler.update``; its documentation, "Gradient Scaling" in the AMP notes): after a skipped
step ``S`` is multiplied by ``backoff_factor`` and the count of finite steps in a row is reset;
after ``growth_interval`` finite steps in a row ``S`` is multiplied by ``growth_factor``. Its
defaults are GradScaler's: ``init_scale`` 2^16, ``growth_factor`` 2, ``backoff_factor`` 0.5,
``growth_interval`` 2000. The scale lives on the host (the runtime passes it at each call and
reads the flag beside the loss, which it reads anyway), so the step runs no kernel for it.

What stays as PyTorch's: the BatchNorm running statistics of a skipped step are updated (they
come from the forward pass, which PyTorch runs before it knows of the overflow); the loss the
step returns is unscaled.

Runtime-side only (no compiler import): :class:`thomas_tune.runtime.Session` uses it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: the loss-scaling modes an export takes: none (float32 activation gradients), or dynamic
LOSS_SCALES = ("none", "dynamic")


def require_mixed16(precision: str) -> None:
    """Raise ValueError unless ``precision`` is ``mixed16``: a loss-scaled step stores its
    activation gradients as float16 beside mixed16's layer outputs."""
    if precision != "mixed16":
        raise ValueError(f"--loss-scale stores activation gradients as float16 beside the "
                         f"layer outputs of --precision mixed16, not {precision}: give "
                         "--precision mixed16")


@dataclass(frozen=True)
class LossScale:
    """The dynamic loss scaling of an export (the manifest's ``loss_scale``): GradScaler's
    parameters (module docstring). Raises ValueError for a scale that is not a positive finite
    number, a growth factor not above 1, a backoff factor outside (0, 1) or a growth interval
    below 1."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (0 < self.init_scale < float("inf")):
            raise ValueError(f"loss scale {self.init_scale}: give a positive finite number")
        if not self.growth_factor > 1.0:
            raise ValueError(f"loss-scale growth factor {self.growth_factor}: give one above 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor {self.backoff_factor}: give one in "
                             "(0, 1)")
        if int(self.growth_interval) != self.growth_interval or self.growth_interval < 1:
            raise ValueError(f"loss-scale growth interval {self.growth_interval}: give a "
                             "whole number of steps, 1 or more")

    def as_dict(self) -> dict:
        return {"kind": "dynamic", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict | None) -> LossScale | None:
        """The manifest's ``loss_scale`` (None: none) as a :class:`LossScale`."""
        if d is None:
            return None
        if d.get("kind") != "dynamic":
            raise ValueError(f"loss scale {d!r}: this thomas_tune runs 'dynamic' loss scaling "
                             "only; export the model again")
        return cls(**{k: v for k, v in d.items() if k != "kind"})


class DynamicScaler:
    """The host's state of dynamic loss scaling (module docstring): ``scale`` (the next step's
    ``S``), ``growth_tracker`` (finite steps in a row since the last change), ``skipped`` (steps
    whose update was skipped) and ``steps`` (steps seen)."""

    def __init__(self, config: LossScale):
        self.config = config
        self.scale = float(config.init_scale)
        self.growth_tracker = 0
        self.skipped = 0
        self.steps = 0

    def update(self, skipped: bool) -> None:
        """After a step: back off on a skipped one, grow after ``growth_interval`` finite steps
        in a row (GradScaler.update)."""
        c = self.config
        self.steps += 1
        if skipped:
            self.skipped += 1
            self.scale *= c.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == c.growth_interval:
            self.scale *= c.growth_factor
            self.growth_tracker = 0

