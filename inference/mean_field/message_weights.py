"""The named multipliers of mean field's messages: ``MessageWeights`` (the six information
weights) and ``MupScales`` (μP's dimension factors). ``MeanField.scales`` multiplies them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import graphs.limits

__all__ = ["MessageWeights", "MupScales", "labels_and_heads"]


@dataclass(frozen=True)
class MessageWeights:
    """The six information weights (pt-spec.md §4.2): one multiplier per message that
    enters a softmax. All 1 is the CRF's own mean field."""

    unary: float = 1.0  # unary potential -> label logits
    head: float = 1.0  # the head i chose -> label logits of i
    dependents: float = 1.0  # every j that chose i -> label logits of i (reverse direction)
    topic: float = 1.0  # global variable -> label logits
    attention: float = 1.0  # ternary -> head logits
    topic_logits: float = 1.0  # binary -> global-variable logits

    @classmethod
    def reference(cls, labels: int) -> MessageWeights:
        """The PT reference code: lambda_H = 1/d, i.e. head and topic logits times d."""
        return cls(attention=float(labels), topic_logits=float(labels))

    @classmethod
    def parse(cls, value, labels: int) -> MessageWeights:
        if value is None or value == "crf":
            return cls()
        if value == "reference":
            return cls.reference(labels)
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"unknown message weights {sorted(unknown)}; allowed: {[f.name for f in fields(cls)]}")
            return cls(**{k: _finite(k, v) for k, v in value.items()})
        raise ValueError(f"weights must be 'crf', 'reference', a dict or MessageWeights, got {value!r}")


def _finite(name: str, value) -> float:
    """A weight as a float; float() alone would read "1e400" or True, and a NaN or infinite
    weight makes every logit it multiplies NaN."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(
            f"message weight {name!r} must be a real number (an int or float, not a bool or text), "
            f"got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"message weight {name!r} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MupScales:
    """μP's dimension factors (pt-spec.md §4.2, reconstructed): temperature tau = d / r on
    the label distribution; head logits at 1/r in quasi-distribution units (d q_z), i.e.
    ``tau * d`` on probabilities; label messages in quasi-distribution units."""

    temperature: float
    attention: float  # head logits
    ternary_message: float  # head and dependents messages to the labels
    topic_message: float  # global message to the labels
    topic_logits: float  # global-variable logits

    def __post_init__(self):
        for f in fields(self):  # each multiplies or divides logits: 0, a sign flip or NaN would poison them
            _positive(f"MupScales.{f.name}", getattr(self, f.name))

    @classmethod
    def at(cls, labels: float, rank: float, global_labels: float = 0) -> MupScales:
        """The absolute factors at width ``labels``, rank ``rank`` and ``global_labels``
        global values (floats allowed: a base width need not be buildable)."""
        for name, value in (("labels", labels), ("rank", rank)):
            _positive(name, value)
        _positive("global_labels", global_labels, zero=True)
        # no global variable: its factors are unused, so 1; a fractional count (a base width's
        # global_labels / m) stays as it is, or the ratio to it would not be the width multiplier
        d, r, m = float(labels), float(rank), float(global_labels) if global_labels > 0 else 1.0
        tau = d / r
        return cls(temperature=tau, attention=tau * d, ternary_message=d, topic_message=m, topic_logits=tau * m)

    @classmethod
    def reconstruction(cls, crf) -> MupScales:
        """The absolute factors of ``crf`` (as if tuned at width 1)."""
        return cls.at(crf.labels, crf.rank, crf.global_labels)

    def relative_to(self, base: MupScales) -> MupScales:
        """Factors divided by the base width's: all 1 at the base width, so a μP model
        tuned there equals the standard one (``probformer.mup`` uses this form)."""
        if not isinstance(base, MupScales):
            raise TypeError(f"base must be a MupScales, got {type(base).__name__}")
        return MupScales(**{f.name: getattr(self, f.name) / getattr(base, f.name) for f in fields(self)})


def _positive(name: str, value, zero: bool = False) -> None:
    """A finite real number > 0 (>= 0 with ``zero``), not a bool or text."""
    if not graphs.limits.is_real(value):  # numpy's numbers too; never a bool
        raise TypeError(f"{name} must be a real number (an int or float), got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not (value >= 0 if zero else value > 0):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")


def labels_and_heads(name: str, value, low: float, high: float, low_open: bool = False) -> tuple[float, float]:
    """``(labels, heads)``: one setting (damping, step size) for each kind of marginal, from one
    number or a pair, each in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"

    if graphs.limits.is_real(value):
        z, h = value, value
    elif isinstance(value, tuple | list) and len(value) == 2:
        z, h = value
    else:
        raise ValueError(f"{name} must be a number or a pair (labels, heads) of numbers in {bound}, got {value!r}")
    for part, v in (("labels", z), ("heads", h)):
        if not graphs.limits.is_real(v) or not (low < v if low_open else low <= v) or not v <= high:
            raise ValueError(f"{name} for {part} must lie in {bound}, got {v!r}")
    return float(z), float(h)
