"""The settings of a ``MeanField``: one frozen ``MeanFieldOptions``, checked once, here.

The engine's collaborators (``schedules``, ``bound``, ``kernels.choice``) read these and the
CRF, never the engine. ``training`` is not a setting: it is module state that changes when the
module switches between training and evaluation mode, so every function that reads it takes
it as an argument.

The engine's attributes of the same names (``engine.kernel``, ``engine.iterations``, ...)
read and write its ``options``: writing one replaces the options with a copy holding the
new value, unchecked, as a plain attribute write always was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import graphs
from inference.mean_field.halting import HALTING, HALTING_SOURCES
from inference.mean_field.message_weights import MessageWeights, MupScales, labels_and_heads

__all__ = ["MeanFieldOptions", "OptionView", "SCHEDULES", "KERNELS", "INITIAL_HEAD_LOGITS"]

SCHEDULES = ("async", "parallel", "sequential", "macaron")
INITIAL_HEAD_LOGITS = ("none", "ones")
KERNELS = ("auto", "naive", "fused", "flex")
_NO_MUP = MupScales(temperature=1.0, attention=1.0, ternary_message=1.0, topic_message=1.0, topic_logits=1.0)
MAX_ITERATIONS = 10_000  # each iteration is a layer: far deeper than any model we train
MAX_SPAN = 2**20  # span_max, span_ramp: distances, as PTConfig's limit


@dataclass(frozen=True)
class MeanFieldOptions:
    """What a ``MeanField`` was asked to do (its constructor's arguments, parsed): the
    meaning of each is in ``MeanField``'s docstring. ``damping`` and ``step_size`` are
    ``(labels, heads)`` pairs; ``adaptive_span`` says whether the engine learns spans."""

    iterations: int = 4
    schedule: str = "async"
    mup: bool = False
    kernel: str = "auto"
    dropout: float = 0.0
    damping: tuple[float, float] = (0.0, 0.0)
    step_size: tuple[float, float] = (1.0, 1.0)
    weights: MessageWeights = MessageWeights()
    mup_scales: MupScales | None = None
    halting: str = "none"
    halting_source: str = "posterior"
    act_epsilon: float = 0.01
    exit_threshold: float = 0.9
    adaptive_span: bool = False
    span_max: int = 64
    span_ramp: int = 8
    memory_topk: int = 32
    initial_head_logits: str = "none"

    @classmethod
    def parse(
        cls,
        crf,
        iterations=4,
        schedule="async",
        mup=False,
        kernel="auto",
        dropout=0.0,
        damping=0.0,
        step_size=1.0,
        weights=None,
        mup_scales=None,
        halting="none",
        halting_source="posterior",
        act_epsilon=0.01,
        exit_threshold=0.9,
        span=False,
        span_max=64,
        span_ramp=8,
        memory_topk=32,
        initial_head_logits="none",
    ) -> MeanFieldOptions:
        """The checked options of an engine on ``crf`` (``ValueError`` naming the argument)."""
        if not isinstance(crf, graphs.CRF):
            raise TypeError(f"crf must be a graphs.CRF, got {type(crf).__name__}")
        _check_iterations_schedule_kernel_dropout(iterations, schedule, kernel, dropout)
        _check_flags(mup=mup, span=span)
        damping = labels_and_heads("damping", damping, 0.0, 0.999999)
        step_size = labels_and_heads("step_size", step_size, 0.0, 1.0, low_open=True)
        weights = MessageWeights.parse(weights, crf.labels)
        if mup_scales is not None and not isinstance(mup_scales, MupScales):
            raise TypeError(f"mup_scales must be an inference.MupScales or None, got {type(mup_scales).__name__}")
        mup_scales = mup_scales or MupScales.reconstruction(crf)
        _check_halting(halting, halting_source, act_epsilon, exit_threshold, schedule)
        if schedule == "macaron" and not crf.global_labels:
            raise ValueError("schedule 'macaron' alternates global and head updates: the CRF needs global_labels > 0")
        _check_span_memory_initial(span, span_max, span_ramp, memory_topk, initial_head_logits)
        if schedule == "sequential":
            _check_sequential(crf, damping, step_size, initial_head_logits)
        options = cls(
            iterations=iterations,
            schedule=schedule,
            mup=mup,
            kernel=kernel,
            dropout=float(dropout),
            damping=damping,
            step_size=step_size,
            weights=weights,
            mup_scales=mup_scales,
            halting=halting,
            halting_source=halting_source,
            act_epsilon=float(act_epsilon),
            exit_threshold=float(exit_threshold),
            adaptive_span=span,
            span_max=span_max,
            span_ramp=span_ramp,
            memory_topk=memory_topk,
            initial_head_logits=initial_head_logits,
        )
        if kernel in ("fused", "flex") and options.heads_need_naive:
            raise ValueError(
                f"kernel={kernel!r} supports no head damping/step size, no sequential schedule and no adaptive span; "
                "use kernel='naive'"
            )
        return options

    @property
    def heads_need_naive(self) -> bool:
        """Whether the head update needs the materialised head marginals: head damping or
        step size, the sequential schedule or an adaptive span (dropout is the other reason,
        in training only: ``kernels.choice.resolved_kernel``)."""
        return self.damping[1] > 0 or self.step_size[1] < 1 or self.schedule == "sequential" or self.adaptive_span

    def scales(self) -> dict[str, float]:
        """The effective multiplier of every message (weights times μP factors)."""
        w, mu = self.weights, self.mup_scales if self.mup else _NO_MUP
        return {
            "unary": w.unary,
            "head": w.head * mu.ternary_message,
            "dependents": w.dependents * mu.ternary_message,
            "topic": w.topic * mu.topic_message,
            "attention": w.attention * mu.attention,
            "topic_logits": w.topic_logits * mu.topic_logits,
        }


def _check_iterations_schedule_kernel_dropout(iterations, schedule, kernel, dropout) -> None:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be an integer >= 1 and <= 10000 (the limit), got {iterations!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; allowed: {list(SCHEDULES)}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; allowed: {list(KERNELS)}")
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")


def _check_flags(**flags) -> None:
    """Switches are bools: bool() would read "false" or "no" as True."""
    for name, value in flags.items():
        if not graphs.limits.is_switch(value):
            raise TypeError(f"{name} must be True or False (a bool), got {type(value).__name__} {value!r}")


def _check_halting(halting, halting_source, act_epsilon, exit_threshold, schedule) -> None:
    if halting not in HALTING or halting_source not in HALTING_SOURCES:
        raise ValueError(
            f"halting must be one of {list(HALTING)} and halting_source one of {list(HALTING_SOURCES)}, "
            f"got {halting!r}, {halting_source!r}"
        )
    for name, value in (("act_epsilon", act_epsilon), ("exit_threshold", exit_threshold)):
        if not graphs.limits.is_real(value):  # numpy's numbers too; True would read as 1
            raise TypeError(f"{name} must be a real number (an int or float), got {type(value).__name__} {value!r}")
    if not 0 < act_epsilon < 1 or not 0 < exit_threshold <= 1:
        raise ValueError(
            f"act_epsilon must lie in (0, 1) and exit_threshold in (0, 1], got {act_epsilon}, {exit_threshold}"
        )
    if halting != "none" and schedule == "sequential":
        raise ValueError("halting needs an unrolled schedule ('async', 'parallel' or 'macaron'), not 'sequential'")


def _check_span_memory_initial(span, span_max, span_ramp, memory_topk, initial_head_logits) -> None:
    for name, value in (("span_max", span_max), ("span_ramp", span_ramp)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPAN:
            raise ValueError(f"{name} must be an integer >= 1 and <= {MAX_SPAN} (the limit), got {value!r}")
    if isinstance(memory_topk, bool) or not isinstance(memory_topk, int) or memory_topk < 1:
        raise ValueError(f"memory_topk must be an integer >= 1, got {memory_topk!r}")
    if initial_head_logits not in INITIAL_HEAD_LOGITS:
        raise ValueError(f"initial_head_logits must be one of {list(INITIAL_HEAD_LOGITS)}, got {initial_head_logits!r}")


def _check_sequential(crf, damping, step_size, initial_head_logits) -> None:
    """Coordinate ascent takes each update's optimum whole: a damping or step size would be
    ignored by it, and damping against the initial cache of ones would damp every head update
    (another fixed point, a falling ELBO). Its ELBO after every step needs CRF factors."""
    damping = labels_and_heads("damping", damping, 0.0, 0.999999)  # a number or a pair, as written
    step_size = labels_and_heads("step_size", step_size, 0.0, 1.0, low_open=True)
    if damping != (0.0, 0.0) or step_size != (1.0, 1.0) or initial_head_logits != "none":
        raise ValueError(
            f"schedule 'sequential' is coordinate ascent (each update takes its optimum whole): it cannot apply "
            f"damping={damping}, step_size={step_size}, initial_head_logits={initial_head_logits!r}; use "
            "damping=0, step_size=1, initial_head_logits='none', or an unrolled schedule ('async', 'parallel', "
            "'macaron')"
        )
    if getattr(crf, "global_memory", "dense") == "product_key":
        raise ValueError(
            "schedule 'sequential' tracks the ELBO after every step, and a product-key memory is not a CRF "
            "factor (it has no ELBO); use an unrolled schedule ('async', 'parallel', 'macaron')"
        )


class OptionView:
    """A class attribute of an engine that reads and writes one field of the engine's frozen
    ``options``: writing replaces the options with a copy holding the new value."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.options, self.name)

    def __set__(self, engine, value):
        options = replace(engine.options, **{self.name: value})
        if options.schedule == "sequential":  # a write must not reach what parse refuses
            _check_sequential(engine.crf, options.damping, options.step_size, options.initial_head_logits)
        engine.options = options
