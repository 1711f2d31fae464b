"""The whole training step checked: an export's loss and every gradient against PyTorch.

A build is timed only if its numbers are right. On :data:`CHECK_BATCHES` batches
(:func:`batch`: inputs made to reach every path of the step, see below) with random dropout
masks, the export's ``train_adjoint`` (loss, gradients of the trainable parameters, BatchNorm
in its training form) is compared with the same network in PyTorch (:mod:`thomas_tune.reference`,
torchvision's layout) in float64, from the same parameters and running statistics.

The float64 step follows the build's branches (:mod:`thomas_tune.kinks`): at every ReLU, ReLU6
and max-pool window whose float64 input lies within the forward's rounding of the kink, it takes
the side the build's gradients show the build took, and only there; every other decision is
float64's own. The two steps then differ by rounding only, on every batch, so **every batch
counts**: a parameter's error is the largest over the batches, the loss's likewise.

The error of a parameter (:func:`gradient_errors`) is ``max |g - g_ref| / scale`` on its own
scale, ``scale = max |g_ref|``; only a bias or BatchNorm weight whose gradient cancels to
below a share of the sum of its absolute terms (:func:`term_floor`; a bias followed by a
training-form BatchNorm, :data:`CANCELLED`; a BatchNorm weight that the next training-form
BatchNorm undoes, through a ReLU and a depthwise convolution: zero in exact arithmetic but for
that BatchNorm's epsilon and the ReLU6s that clip, :data:`CANCELLED_WEIGHT`;
:func:`thomas_tune.kinks.term_sums`) is judged against that share of the sum, the size of
float32's rounding of such a sum, not of the step's largest gradient. Its bound
(:func:`bounds`) is :data:`FACTOR` x PyTorch float32's error on the same batches (measured
against float64 following PyTorch float32's own branches), at least :data:`FACTOR` x
:data:`ROUNDING` and at most :data:`CAP`; the loss's :data:`FACTOR` x max(PyTorch float32's,
:data:`LOSS_ROUNDING`). A kernel that writes zeros, a wrong sign or a gradient 1% off moves
the error of the parameters it feeds to 1e-2..1, over every bound.

The check inputs (:func:`batch`): labels hold every class in every batch (when the batch has
at least as many images as there are classes; else every class over the batches); 3% of each
image's values are multiplied by 12, so the first training-form BatchNorms normalise values
far in their tails and ReLU6s see inputs above 6; each image has a constant square (a quarter
of its side), which makes exact ties in max-pool windows; dropout masks are drawn with the
layer's rate. What the float64 forward reached is counted (:attr:`StepCheck.coverage`: per
ReLU6 the inputs above 6, per pool the windows with a tie). A weight whose reference gradient
is zero on the check batches (a dead layer) cannot show an error: the check fails and names it
(:attr:`StepCheck.dead`), as it does a training-form BatchNorm over fewer than
:data:`MIN_BN_VALUES` values per channel (:attr:`StepCheck.few_bn_values`).

A half-storage build (``--precision mixed16``) is checked against float64 rounding its layer
outputs to float16 where the build stores them (:mod:`thomas_tune.half_reference`), with
PyTorch float32 rounded the same way as the yardstick. Two such steps decide differently
wherever a value lies within float32's error of a midpoint between two float16 values, and
within a few layers of training-form BatchNorms their roundings are unrelated; so, as at the
kinks, the reference follows the build's decisions: the float16 tensors the build stored on
each check batch are read back (:func:`thomas_tune.step_run.stored_step`, the check-only form
of the step, whose loss must be the export's own bit for bit, else the build fails: its
forward is not the step its manifest states), and at each
place both PyTorch steps take the build's value where it is the other float16 neighbour of
their own unrounded value, never beyond one step (a value 1% off is not taken:
:func:`thomas_tune.half_reference.round_like`, counted in :attr:`StepCheck.aligned`).
Where the stored tensors cannot be read (a build run on a device server, on cached features,
built with a tuning log or a memory budget) the roundings are not followed and the bounds are
those of PyTorch's half-storage step: where its error is over :data:`CAP` / :data:`FACTOR`
the check cannot tell a right build from one 1% off, and it says so
(:attr:`StepCheck.unverifiable`, the build not passed) instead of judging.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kink_step import torch_forward, torch_step  # noqa: F401
from .kinks import numpy_of as _numpy
from .step_run import export_step  # noqa: F401

#: batches a step is checked on: different labels, dropout masks and tails on each
CHECK_BATCHES = 3
#: a gradient's (and the loss's) error may be this many times PyTorch float32's on the same
#: batches (both against float64 following their own branches): rounding of the same sums in
#: another order; the largest ratio of right builds over 40 seeds is in docs/journal/precision.md
FACTOR = 4.0
#: the smallest yardstick of a gradient's error: float32 rounding of the step's sums, amplified
#: by the BatchNorms' backward; a right MobileNetV2 0.35@64 build on PoCL reached 4.5e-4 where
#: PyTorch float32 was 9.6e-5 (docs/journal/precision.md), so the floor of the bounds, 2e-3,
#: is 4x that; a gradient 1% off (1e-2) is 5x over it
ROUNDING = 5e-4
#: no parameter's error may be above this, whatever the yardstick (a gradient 1% off fails)
CAP = 1e-2
#: the smallest yardstick of the loss's relative error: PyTorch float32's loss error on the
#: test network (MobileNetV2 0.35@32, batch 8, training-form BatchNorms) reached 6.3e-6 over
#: 40 seeds, a right build's 9.8e-6 where PyTorch's was under 2e-6 on those batches
#: (docs/journal/precision.md); a loss 1% off is 500x over the bound this gives
LOSS_ROUNDING = 5e-6
#: a bias whose largest gradient is below this share of its largest sum of absolute terms (per
#: channel, sum over batch and positions of |output gradient|; :func:`thomas_tune.kinks.term_sums`)
#: is judged on that share of the sum: the gradient cancels (zero in exact arithmetic: a bias
#: before a training-form BatchNorm, whose backward removes each channel's mean gradient, and
#: with it the mean of the incoming gradient's errors), and float32's rounding of a sum of M
#: terms is about u sqrt(M) of the absolute sum (Higham, Accuracy and Stability of Numerical
#: Algorithms, 2002, section 4.2), under 1e-5 for M <= 1e4
CANCELLED = 1e-3
#: the same share for a BatchNorm weight (sum of |output gradient x x-hat|). Its gradient
#: cancels only approximately: the next training-form BatchNorm undoes its scale through a ReLU
#: and a depthwise convolution, channel by channel, but not where a ReLU6 between them clips
#: (x-hat > 6 / weight), nor through that BatchNorm's epsilon. There it is a true sum of terms
#: that carry the incoming gradient's own error, about 1e-5 of their absolute sum after a few
#: blocks (MobileNetV2 0.35@32: the bias gradient beside it is 2e-5 of its sum off in the
#: build, 8e-6 in PyTorch float32), i.e. 1e-2 of a scale of 1e-3 of the sum; at 1e-2 of the
#: sum it is 1e-3 (docs/journal/precision.md). MobileNetV1 0.25@32's first BatchNorm weight
#: (fresh parameters, batch 8) has a gradient 1.5e-5 of its sum
CANCELLED_WEIGHT = 1e-2
#: a weight whose largest reference gradient is at most this share of the step's largest is dead
DEAD = 1e-12
#: the fewest values per channel a training-form BatchNorm may normalise in a checked step: the
#: bounds were measured on steps with 8 or more; over 4 values float32 rounding is amplified so
#: much that a right build's error reaches 2e-2 on some batches (docs/journal/precision.md)
MIN_BN_VALUES = 8


def term_floor(name: str, sums) -> float:
    """The smallest scale a gradient is judged on: for a bias, :data:`CANCELLED` x its largest
    sum of absolute terms (``sums``: per channel, :func:`thomas_tune.kinks.term_sums`), for a
    BatchNorm weight :data:`CANCELLED_WEIGHT` x it; 0.0 for a parameter with no sums (None)."""
    if sums is None or not np.size(sums):
        return 0.0
    share = CANCELLED if name.endswith("bias") else CANCELLED_WEIGHT
    return share * float(np.max(sums))


def gradient_errors(grads: dict[str, np.ndarray], grads_ref: dict[str, np.ndarray],
                    sums: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Per parameter (name -> error, float; inf where not finite), ``max |g - g_ref| /
    scale`` with ``scale = max |g_ref|``, or for a bias or BatchNorm weight whose gradient
    cancels, :func:`term_floor` of its sums of absolute terms (module docstring).
    ``grads`` and ``grads_ref``: name -> array (any float dtype, same shapes); ``sums``: bias
    or BatchNorm weight name -> its sum of absolute terms per channel
    (:func:`thomas_tune.kinks.term_sums`). Raises ValueError when the two name different
    parameters."""
    if set(grads) != set(grads_ref):
        raise ValueError(f"the build's trainable parameters {sorted(set(grads) ^ set(grads_ref))} "
                         "are not the reference's: compare builds of the same trainable set")
    errors = {}
    for name, ref in grads_ref.items():
        ref = np.asarray(ref, "float64")
        got = np.asarray(grads[name], "float64")
        if not ref.size:
            errors[name] = 0.0
            continue
        floor = term_floor(name, (sums or {}).get(name))
        scale = max(float(np.max(np.abs(ref))), floor, 1e-300)
        err = float(np.max(np.abs(got - ref))) / scale
        errors[name] = err if np.isfinite(err) else float("inf")
    return errors


def dead_parameters(grads_ref: dict[str, np.ndarray]) -> list[str]:
    """Weights (tensors of 2 or more dimensions) whose reference gradient is zero (at most
    :data:`DEAD` of the step's largest): their layer's input or output gradient is all zero on
    this batch, so no error of theirs can be seen. Biases are left out: a bias followed by
    BatchNorm has a gradient of zero in exact arithmetic."""
    top = max((float(np.max(np.abs(r))) for r in grads_ref.values() if np.size(r)), default=0.0)
    return [n for n, r in grads_ref.items()
            if np.ndim(r) >= 2 and float(np.max(np.abs(r))) <= DEAD * top]


def loss_error(loss: float, loss_ref: float) -> float:
    """``|loss - loss_ref| / |loss_ref|`` (inf where not finite)."""
    err = abs(loss - loss_ref) / max(abs(loss_ref), 1e-30)
    return err if np.isfinite(err) else float("inf")


@dataclass
class StepCheck:
    """The comparison of one build's step with the reference: ``loss`` and ``loss_ref`` (of the
    first batch), ``loss_err`` (relative, the largest over the batches), ``errors`` (parameter
    name -> error, the largest over the batches, :func:`gradient_errors`), ``bounds``
    (parameter name -> the largest error accepted), ``loss_bound``, ``failing`` (names over
    their bound, worst first), ``dead`` (weights whose reference gradient is zero on every
    batch: unchecked, :func:`dead_parameters`), ``yardstick`` (PyTorch float32's errors, the
    same way; empty when the bounds are the rounding floors alone), ``flips`` (per batch, the
    kink elements where the reference took the build's side against float64's,
    :mod:`thomas_tune.kinks`), ``unresolved`` (ambiguous kink elements past
    :data:`thomas_tune.kinks.MAX_FLIPS`, the farthest from their kink: not followed; said
    beside a failure),
    ``coverage`` (what the check inputs reached, :func:`reference_steps`), ``update`` (the
    optimizer update's check, :mod:`thomas_tune.update_check`; its failure fails the step)."""

    loss: float
    loss_ref: float
    loss_err: float
    errors: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    bounds: dict[str, float] = field(default_factory=dict)
    loss_bound: float = FACTOR * LOSS_ROUNDING
    dead: list[str] = field(default_factory=list)
    yardstick: dict[str, float] = field(default_factory=dict)
    yardstick_loss_err: float | None = None
    #: (layer, values per channel) of the training-form BatchNorm that normalises the fewest,
    #: when that is under MIN_BN_VALUES: the step cannot be checked to the bounds
    few_bn_values: tuple[str, int] | None = None
    flips: list[int] = field(default_factory=list)
    unresolved: int = 0
    #: a mixed16 build's parameters whose bound PyTorch's own half-storage step already
    #: exceeds (its error x FACTOR above CAP): not checkable on these batches
    #: (:func:`thomas_tune.export_check.check_export`)
    unverifiable: list[str] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    #: the optimizer update against torch.optim (thomas_tune.update_check.UpdateCheck), or None
    update: object = None
    #: a mixed16 build whose float16 roundings the reference followed: over the check
    #: batches, the places rounded, their elements, those where the build's float16 value was
    #: taken and those beyond one float16 step (the reference's own kept;
    #: thomas_tune.half_reference.Aligned as a dict), and ``same_forward``: whether the
    #: build's loss is the stated step's bit for bit (False fails the build); None where not
    #: followed
    aligned: dict | None = None

    @property
    def ok(self) -> bool:
        return (self.loss_err <= self.loss_bound and not self.failing and not self.dead
                and self.few_bn_values is None and not self.unverifiable
                and (self.aligned is None or self.aligned["same_forward"])
                and (self.update is None or self.update.ok))

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.get) if self.errors else ""
        return name, self.errors.get(name, 0.0)

    def line(self) -> str:
        """One line: right or wrong, the loss, the worst gradient (beside PyTorch float32's
        error of that parameter), the failing and the dead ones."""
        name, err = self.worst
        torch_part = (f", PyTorch float32 {self.yardstick[name]:.1e}"
                      if name in self.yardstick else "")
        bound = f" (bound {self.bounds[name]:.1e})" if name in self.bounds else ""
        head = (f"loss {self.loss:.6f} (PyTorch {self.loss_ref:.6f}, error {self.loss_err:.1e}, "
                f"bound {self.loss_bound:.1e}); {len(self.errors)} gradients, worst {name} "
                f"{err:.1e}{bound}{torch_part}"
                + (f"; {self.update.line()}" if self.update is not None else "")
                + (f"; float16 roundings followed: {self.aligned['taken']} of "
                   f"{self.aligned['elements']} stored elements taken from the build, "
                   f"{self.aligned['beyond']} beyond one step"
                   if self.aligned is not None else ""))
        if self.ok:
            return f"right: {head}"
        fail = ", ".join(f"{n} {self.errors[n]:.1e} (bound {self.bounds[n]:.1e})"
                         for n in self.failing[:6]) + (" ..." if len(self.failing) > 6 else "")
        parts = [f"WRONG: {head}"]
        if self.failing:
            parts.append(f"{len(self.failing)} over their bound: {fail}")
        if self.loss_err > self.loss_bound:
            parts.append(f"loss error {self.loss_err:.1e} (bound {self.loss_bound:.1e})")
        if self.few_bn_values is not None:
            layer, k = self.few_bn_values
            parts.append(f"not checkable: BatchNorm {layer} normalises {k} values per channel "
                         f"(batch x height x width), under the {MIN_BN_VALUES} the bounds hold "
                         "for; check at a larger batch or resolution")
        if self.unverifiable:
            parts.append(
                f"not checkable: on {len(self.unverifiable)} parameter(s) PyTorch's own step "
                f"with the same float16 storage is already over {CAP / FACTOR:.1e} from its "
                f"float64 step ({', '.join(self.unverifiable[:4])}"
                f"{' ...' if len(self.unverifiable) > 4 else ''}): half storage's rounding, "
                "amplified by BatchNorms over few values, hides a 1% error there; check the "
                "float32 build of the same records, or at a larger batch or resolution")
        if self.aligned is not None and not self.aligned["same_forward"]:
            parts.append("the build's loss is not, bit for bit, that of the mixed16 step its "
                         "manifest states compiled here: its forward is not that step's (a "
                         "wrong forward kernel, or a build of another precision)")
        if self.unresolved:
            parts.append(f"{self.unresolved} kink elements within rounding of their kink were "
                         "past the ones the reference follows: a failure may be one of them")
        if self.dead:
            parts.append(f"{len(self.dead)} weight(s) with a zero gradient on the check "
                         f"batches, whose errors cannot be seen (a dead layer: check other "
                         f"weights): {', '.join(self.dead[:6])}")
        return "; ".join(parts)

    def table(self) -> str:
        """Every parameter's error and bound, one a line, worst share of its bound first."""
        rows = sorted(self.errors, key=lambda n: -self.errors[n] / self.bounds.get(n, 1.0))
        return "\n".join(f"  {n:40s} error {self.errors[n]:.2e}  bound {self.bounds.get(n, 0):.2e}"
                         f"  PyTorch float32 {self.yardstick.get(n, float('nan')):.2e}"
                         for n in rows)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "line": self.line(), "loss": self.loss, "loss_ref": self.loss_ref,
                "loss_err": self.loss_err, "loss_bound": self.loss_bound,
                "worst": list(self.worst), "failing": self.failing, "dead": self.dead,
                "errors": self.errors, "bounds": self.bounds,
                "torch_float32_errors": self.yardstick,
                "torch_float32_loss_err": self.yardstick_loss_err,
                "few_bn_values": self.few_bn_values, "flips": self.flips,
                "unresolved": self.unresolved, "unverifiable": self.unverifiable,
                "coverage": self.coverage, "aligned": self.aligned,
                "update": self.update.as_dict() if self.update is not None else None}


def batch(model, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch to check on (module docstring): images (float32, the model's input shape)
    standard normal with 3% of their values times 12 and a constant square of a quarter of
    the side; labels (int64) holding ``batch_size`` consecutive classes from ``seed`` x
    ``batch_size`` on (so every class when ``batch_size`` >= the classes), shuffled."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(model.input_shape(batch_size))
    x[rng.random(x.shape) < 0.03] *= 12.0
    side = max(2, x.shape[-1] // 4)
    for img in x:
        r, c = rng.integers(0, x.shape[-2] - side + 1), rng.integers(0, x.shape[-1] - side + 1)
        img[:, r:r + side, c:c + side] = rng.standard_normal((x.shape[1], 1, 1))
    y = (np.arange(batch_size) + seed * batch_size) % model.num_classes
    return x.astype("float32"), rng.permutation(y).astype("int64")


def dropout_masks(model, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    """Inverted dropout masks of the step (``<layer>.mask`` -> float32 array of 0 and
    1 / (1 - p)), drawn with each layer's rate ``p``."""
    from .models import spec
    rng = np.random.default_rng([seed, 1])
    return {name: ((rng.random(shape) >= p) / (1.0 - p)).astype("float32")
            for name, (shape, p) in spec(model, batch_size).masks.items()}


def compare_step(loss: float | list[float], grads, loss_ref, grads_ref,
                 yardstick: dict[str, float] | None = None,
                 yardstick_loss_err: float | None = None, sums=None) -> StepCheck:
    """The :class:`StepCheck` of a step against its reference, on one batch or several.

    ``loss``/``loss_ref``: floats, or lists of one per batch; ``grads``/``grads_ref``: name ->
    array, or lists of such dicts, one per batch; ``sums``: per batch, bias or BatchNorm
    weight name -> its sums of absolute terms (:func:`gradient_errors`), or None. Per
    parameter the error is the largest over the batches, the loss error likewise.
    ``yardstick``: PyTorch float32's errors on the same batches (name -> error),
    ``yardstick_loss_err`` its loss error: a parameter
    may be off by :data:`FACTOR` x max(its yardstick, :data:`ROUNDING`), never more than
    :data:`CAP`; the loss by :data:`FACTOR` x max(the loss yardstick, :data:`LOSS_ROUNDING`);
    None: the rounding floors alone. Raises ValueError when the steps name different
    parameters or the lists differ in length."""
    many = isinstance(grads, (list, tuple))
    losses, refs_l = (list(loss), list(loss_ref)) if many else ([loss], [loss_ref])
    gs, rs = (list(grads), list(grads_ref)) if many else ([grads], [grads_ref])
    ss = list(sums) if sums is not None and many else [sums] * len(gs)
    if not (len(losses) == len(refs_l) == len(gs) == len(rs) == len(ss) >= 1):
        raise ValueError("compare_step: one loss and one set of gradients per batch, on both "
                         "sides")
    per_batch = [gradient_errors(g, r, sm) for g, r, sm in zip(gs, rs, ss)]
    errors = {n: max(e[n] for e in per_batch) for n in per_batch[0]}
    dead = sorted(set.intersection(*(set(dead_parameters(r)) for r in rs)))
    loss_err = max(loss_error(a, b) for a, b in zip(losses, refs_l))
    yard = dict(yardstick or {})
    bounds = {n: min(CAP, FACTOR * max(yard.get(n, 0.0), ROUNDING)) for n in errors}
    failing = sorted((n for n, e in errors.items() if e > bounds[n]), key=lambda n: -errors[n])
    loss_bound = FACTOR * max(yardstick_loss_err or 0.0, LOSS_ROUNDING)
    return StepCheck(losses[0], refs_l[0], loss_err, errors, failing, bounds, loss_bound,
                     dead, yard, yardstick_loss_err)


def manifest_frozen_bn(m) -> set:
    """The BatchNorms an export's step runs in inference form, from its manifest
    (:class:`thomas_tune.manifest.Manifest`): the names of its ``frozen_bn``."""
    return set(m.frozen_bn)


def _coverage(kinks, into: dict) -> None:
    """Count into ``into`` what one float64 forward reached (module docstring)."""
    for i, k in enumerate(kinks):
        key = f"{k.kind}{i}"
        x = k.x.detach()
        if k.kind == "relu6":
            into[key] = into.get(key, 0) + int((x > 6.0).sum())
        elif k.kind == "pool":
            into[key] = into.get(key, 0) + int((k.gap == 0).sum())


def check_batches(model, batch_size: int, seed: int, batches: int = CHECK_BATCHES
                  ) -> tuple[list, list]:
    """The check batches of ``seed``: ([(x, y) of :func:`batch` for ``seed``, ``seed + 1``,
    ...], [their :func:`dropout_masks`]), ``batches`` of each."""
    return ([batch(model, batch_size, seed + i) for i in range(batches)],
            [dropout_masks(model, batch_size, seed + i) for i in range(batches)])


def reference_steps(model, tensors: dict[str, np.ndarray], trainable: list[str], batch_size: int,
                    seed: int, frozen_bn: bool | set = False,
                    batches: int = CHECK_BATCHES, precision: str = "float32",
                    halves: list | None = None) -> dict:
    """The check batches of ``seed`` (:func:`batch` and :func:`dropout_masks` of ``seed``,
    ``seed + 1``, ...) and PyTorch's steps on them: ``{"batches": [(x, y)...], "masks":
    [masks...], "float64": [(loss, grads)...] (float64's own decisions), "float32": [(loss,
    grads)...], "sums": [sums of absolute terms...], "rounding": [per kink layer, the
    largest float32 - float64 difference of its input...], "yardstick": PyTorch float32's
    StepCheck against float64 following float32's branches, "few_bn_values": (layer, values)
    of a training-form BatchNorm over fewer than :data:`MIN_BN_VALUES` values per channel, or None,
    "coverage": per ReLU6 the inputs above 6 and per pool the windows with an exact tie,
    "context": what :func:`following_step` needs, "precision": ``precision``}``. With
    ``precision`` mixed16 both PyTorch steps round the layer outputs to float16 where that
    build stores them (:mod:`thomas_tune.half_reference`): the reference of a mixed16 build,
    and PyTorch float32 rounded the same as its yardstick; with ``halves`` (per batch, the
    float16 tensors a mixed16 build stored on it, :func:`thomas_tune.step_run.stored_step`)
    both round each place as the build did where within one float16 step
    (:func:`thomas_tune.half_reference.round_like`), and ``"aligned"`` is per batch the
    float64 step's :class:`thomas_tune.half_reference.Aligned` (else None), ``"halves"``
    ``halves``. Raises ValueError for another precision
    (:func:`thomas_tune.kink_step.torch_forward`), and for ``halves`` not one per place.
    Needs torch."""
    import torch

    from .kink_step import follow_float32
    xs, ms = check_batches(model, batch_size, seed, batches)
    counts: dict[str, int] = {}
    cover: dict[str, int] = {}
    f64, f32, own32, sums, rounding, aligned = [], [], [], [], [], []
    for i, ((x, y), m) in enumerate(zip(xs, ms)):
        h = halves[i] if halves is not None else None
        loss, g, params, names = torch_forward(model, tensors, trainable, x, y, frozen_bn,
                                               masks=m, precision=precision, halves=h)
        loss32, g32, params32, _ = torch_forward(model, tensors, trainable, x, y, frozen_bn,
                                                 dtype="float32", masks=m, precision=precision,
                                                 halves=h)
        aligned.append(g.aligned if h is not None else None)
        counts.update(g.bn_values)
        _coverage(g.kinks, cover)
        from .kinks import term_sums
        sums.append({n: v for n, v in term_sums(loss, g).items() if n in names})
        f64.append((float(loss.detach()),
                    _numpy(names, torch.autograd.grad(loss, params, retain_graph=True))))
        f32.append((float(loss32.detach()), _numpy(names, torch.autograd.grad(loss32, params32))))
        rounding.append([float((k32.x.detach().double() - k.x.detach()).abs().max())
                         for k, k32 in zip(g.kinks, g32.kinks)])
        own32.append(follow_float32(loss, g, g32, params, names))
    yard = compare_step([r[0] for r in f32], [r[1] for r in f32], [r[0] for r in f64], own32,
                        sums=sums)
    fewest = min(counts.items(), key=lambda kv: kv[1]) if counts else None
    few = fewest if fewest is not None and fewest[1] < MIN_BN_VALUES else None
    yard.few_bn_values, yard.coverage = few, cover
    return {"batches": xs, "masks": ms, "float64": f64, "float32": f32, "sums": sums,
            "rounding": rounding, "yardstick": yard, "few_bn_values": few, "coverage": cover,
            "context": (model, tensors, list(trainable), frozen_bn), "precision": precision,
            "halves": halves, "aligned": aligned if halves is not None else None}


def cancelled_gradients(reference: dict) -> list[str]:
    """The biases and BatchNorm weights whose float64 gradient cancels below
    :func:`term_floor` of its sums of absolute terms on every check batch of ``reference``
    (:func:`reference_steps`): zero in exact arithmetic (module docstring), so no factor on it
    shows."""
    out = set.intersection(*(
        {n for n, v in sums.items()
         if float(np.max(np.abs(f[1][n]))) < term_floor(n, v)}
        for sums, f in zip(reference["sums"], reference["float64"])))
    return sorted(out)


def following_step(reference: dict, i: int, grads: dict[str, np.ndarray]):
    """The float64 step of check batch ``i`` of ``reference`` (:func:`reference_steps`) with
    the build's decisions at the kinks within rounding, read from ``grads`` (the build's
    gradients on that batch): a :class:`thomas_tune.kinks.Following`."""
    from .kinks import follow
    model, tensors, trainable, frozen_bn = reference["context"]
    x, y = reference["batches"][i]
    halves = reference.get("halves")
    loss, g, params, names = torch_forward(model, tensors, trainable, x, y, frozen_bn,
                                           masks=reference["masks"][i],
                                           precision=reference.get("precision", "float32"),
                                           halves=halves[i] if halves is not None else None)
    ref = reference["float64"][i][1]
    floors = reference["sums"][i]
    scales = {n: max(float(np.max(np.abs(ref[n]))) if ref[n].size else 0.0,
                     term_floor(n, floors.get(n))) for n in names}
    # float64's own decisions that already explain the build within the bounds' floor need
    # no following
    return follow(loss, g, reference["rounding"][i], params, names, grads, scales,
                  within=FACTOR * ROUNDING)
