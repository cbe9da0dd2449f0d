"""The Probabilistic Transformer: a CRF, unrolled mean field on it, and a task head.

    embedding  = the CRF's unary potentials S[w_i]          (the input layer)
    T layers   = T mean-field iterations, weights tied       (attention = head marginals)
    output     = the last unnormalised label logits M_z     (what the head reads)

The default configuration is the PT reference (pt-spec.md §2.2): async schedule,
head logits times d (``weights="reference"``), dropout on head marginals and label
logits. ``mup=True`` switches to μP's scalings relative to ``mup_base_width``
(``probformer.mup``; equal to the standard model at the base width).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import graphs
import inference
from graphs.device_checks import refuse_non_finite_parameters
from inference.mean_field.options import MeanFieldOptions
from probformer.models import mup_parametrization as mup
from probformer.models.blocks import POOLINGS, TASKS, TaskHead, refuse_non_finite_weights
from probformer.models.config import ConfigMixin
from probformer.models.mup_parametrization import PARADIGMS
from probformer.models.pretrained import PretrainedMixin

__all__ = ["PTConfig", "ProbabilisticTransformer"]


@dataclass
class PTConfig(ConfigMixin):
    vocab_size: int
    labels: int = 384  # d: the width
    channels: int = 16  # C: attention heads
    rank: int = 64  # r: per-channel rank of the ternary tables
    global_labels: int = 0  # g: the FFN-like global variable (0: none)
    topology: str | dict = "full"  # text, or Topology.to_data() (a networkx graph or mask given here becomes that)
    # "low_rank" (U V^T per group and channel), "cp", "tucker", or "shared" (U V^T per channel for
    # every distance group plus a learned bias per group and channel): graphs.ternary
    ternary_form: str = "low_rank"
    ternary_blocks: int = 1  # Tucker blocks of the "tucker" form
    gamma: int | list = 3  # distance clip: 2 (gamma + 1) relative-position groups; or bucket cut points, e.g. [2, 4]
    # a built-in label-label factor (graphs.factors.Pairwise) on this topology's arcs, stored as
    # its text: "chain()" makes the CRF a linear-chain CRF over the labels as well ("": none)
    pairwise: str = ""
    pairwise_gamma: int = 0  # the Pairwise factor's own distance clip
    iterations: int = 5  # T: layers
    schedule: str = "async"
    mup: bool = False
    mup_base_width: int = 0  # d0: the width hyper-parameters were tuned at (0: this width)
    mup_paradigm: str = "channels"  # how the model grows from d0: "channels" or "rank"
    kernel: str = "auto"
    dropout: float = 0.15
    weights: str | dict = "reference"  # "reference", "crf" or the six information weights
    task: str = "mlm"
    num_classes: int = 0  # tagging / classification outputs
    pooling: str = "mean"
    # adaptive computation (inference.mean_field.halting): "act" (ponder cost in the loss) or "exit"
    halting: str = "none"
    halting_source: str = "posterior"  # what ACT's halting unit reads: "posterior" or "delta"
    act_epsilon: float = 0.01
    ponder_cost: float = 0.01  # tau: loss += tau * mean ponder cost N(t) + R(t)
    exit_threshold: float = 0.9  # "exit": a token stops when its output max probability >= this
    aligned_training: bool = False  # loss over every iteration's output (depth-adaptive training)
    # adaptive attention span (MeanField(span=True)); loss += span_penalty * mean span
    span: bool = False
    span_max: int = 64
    span_ramp: int = 8
    span_penalty: float = 1e-3
    global_memory: str = "dense"  # "dense" or "product_key" (global_labels = s^2)
    memory_topk: int = 32

    def __post_init__(self):
        _check_distance_buckets(self.gamma)
        _check_pairwise(self.pairwise)
        self.check_integers(
            {
                "vocab_size": 1,
                "labels": 1,
                "channels": 1,
                "rank": 1,
                "global_labels": 0,
                "iterations": 1,
                "num_classes": 0,
                "mup_base_width": 0,
                "ternary_blocks": 1,
                "span_max": 1,
                "span_ramp": 1,
                "memory_topk": 1,
                "pairwise_gamma": 0,
            }
        )
        if self.pairwise_gamma and not self.pairwise:
            raise ValueError(
                f"config key 'pairwise_gamma' ({self.pairwise_gamma!r}) is the Pairwise factor's distance clip: "
                "it needs 'pairwise' (a topology's text, e.g. 'chain()')"
            )
        for key in ("ponder_cost", "span_penalty"):
            if not isinstance(getattr(self, key), int | float) or getattr(self, key) < 0:
                raise ValueError(f"config key {key!r} must be a number >= 0, got {getattr(self, key)!r}")
        if self.global_memory not in graphs.GLOBAL_MEMORIES:
            raise ValueError(
                f"config key 'global_memory' must be one of {list(graphs.GLOBAL_MEMORIES)}, got {self.global_memory!r}"
            )
        if (self.halting == "exit" or self.aligned_training) and self.task == "classification":
            raise ValueError(
                "config keys 'halting'='exit' and 'aligned_training' need per-token outputs, not task 'classification'"
            )
        new_parameters = self.halting == "act" or self.span or self.global_memory != "dense" or self.pairwise
        if self.mup and new_parameters:
            raise ValueError(
                "config key 'mup' cannot be combined with halting='act', span, a product-key memory or pairwise "
                "(their μP roles are not derived)"
            )
        if self.ternary_form not in graphs.TERNARY_FORMS:
            raise ValueError(
                f"config key 'ternary_form' must be one of {list(graphs.TERNARY_FORMS)}, got {self.ternary_form!r}"
            )
        if self.mup and self.ternary_form not in ("low_rank", "shared"):
            raise ValueError(
                "config key 'mup' needs ternary_form='low_rank' or 'shared' (μP roles of CP/Tucker factors: "
                "not derived)"
            )
        if self.mup_paradigm not in PARADIGMS:
            raise ValueError(f"config key 'mup_paradigm' must be one of {list(PARADIGMS)}, got {self.mup_paradigm!r}")
        inference.MessageWeights.parse(self.weights, self.labels)  # raises naming a bad weight
        if self.task not in TASKS:
            raise ValueError(f"config key 'task' must be one of {list(TASKS)}, got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"config key 'pooling' must be one of {list(POOLINGS)}, got {self.pooling!r}")
        self.check_num_classes()
        if self.pooling == "root" and "root" not in graphs.topology.parse(self.topology).virtual:
            raise ValueError("config key 'pooling'='root' needs a ROOT node: add '| root()' to 'topology'")


def _check_distance_buckets(gamma) -> None:
    """gamma: an integer >= 0, or distance buckets' cut points (graphs.CRF checks them)."""
    if isinstance(gamma, list):
        try:
            graphs.crf.distance_cuts(gamma)
        except ValueError as error:
            raise ValueError(f"config key 'gamma': {error}") from None
    elif isinstance(gamma, bool) or not isinstance(gamma, int):
        raise TypeError(f"config key 'gamma' must be an integer >= 0 or a list of cut points, got {gamma!r}")
    elif gamma < 0:
        raise ValueError(f"config key 'gamma' must be an integer >= 0 or a list of cut points, got {gamma!r}")


def _check_pairwise(text) -> None:
    """pairwise: "" or the text of a built-in topology without virtual nodes."""
    if not isinstance(text, str):
        raise TypeError(f"config key 'pairwise' must be a topology's text (e.g. 'chain()') or '', got {text!r}")
    if text:
        try:
            topology = graphs.topology.parse(text)
        except ValueError as error:
            raise ValueError(f"config key 'pairwise': {error}") from None
        if topology.extra_nodes:
            raise ValueError(f"config key 'pairwise' must be a topology without virtual nodes, got {text!r}")


# the config keys that are the CRF's and the engine's own arguments, passed through by name
CRF_KEYS = ("vocab_size", "labels", "channels", "rank", "global_labels", "topology", "gamma")
CRF_KEYS += ("ternary_form", "ternary_blocks", "global_memory")
ENGINE_KEYS = ("iterations", "schedule", "mup", "kernel", "dropout", "halting", "halting_source", "act_epsilon")
ENGINE_KEYS += ("exit_threshold", "span", "span_max", "span_ramp", "memory_topk")


def engine_arguments(config: PTConfig) -> dict:
    """The ``inference.MeanField`` arguments ``config`` declares."""
    # under μP the information weights are hyper-parameters of the base width, held fixed
    weights_width = mup.base_width(config) if config.mup else config.labels
    return {
        "weights": inference.MessageWeights.parse(config.weights, weights_width),
        "mup_scales": mup.engine_scales(config) if config.mup else None,
        **{key: getattr(config, key) for key in ENGINE_KEYS},
    }


class ProbabilisticTransformer(nn.Module, PretrainedMixin):
    def __init__(self, config: PTConfig):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config = config
        factors = []
        if config.pairwise:
            factors.append(graphs.factors.Pairwise(config.labels, config.pairwise, config.pairwise_gamma))
        self.crf = graphs.CRF(**{key: getattr(config, key) for key in CRF_KEYS}, factors=factors)
        self.mean_field = inference.MeanField(self.crf, **engine_arguments(config))
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        root = self.crf.topology.virtual.index("root") if config.pooling == "root" else 0
        self.head = TaskHead(config.task, config.labels, outputs, config.pooling, root)
        mup.initialise(self)

    def undeclared_engine_settings(self) -> list[str]:
        """The engine settings that differ from what ``self.config`` declares (changed after
        construction, on the engine or the config), as "name=value (the config's: value)": a
        saved model is rebuilt from its config. The kernel is left out: kernels compute the
        same answers, and each machine may pick its own."""
        declared, actual = MeanFieldOptions.parse(self.crf, **engine_arguments(self.config)), self.mean_field.options
        return [
            f"{field.name}={getattr(actual, field.name)!r} (the config's: {getattr(declared, field.name)!r})"
            for field in dataclasses.fields(actual)
            if field.name != "kernel" and getattr(actual, field.name) != getattr(declared, field.name)
        ]

    def undeclared_factors(self) -> list[str]:
        """The factors of ``self.crf`` that the config does not declare, as "'name' (Class)":
        all of them without ``pairwise``; with it, all but a first one that is that Pairwise."""
        config, factors = self.config, list(self.crf.factors)
        named = [f"{factor.name or 'unnamed'!r} ({type(factor).__name__})" for factor in factors]
        if not config.pairwise:
            return named
        if not factors:
            return ["the config's Pairwise (removed from model.crf.factors)"]
        first = factors[0]
        wanted = (config.labels, graphs.topology.parse(config.pairwise).name, config.pairwise_gamma)
        same = type(first) is graphs.factors.Pairwise and (first.labels, first.topology.name, first.gamma) == wanted
        return named[1 if same else 0 :]

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        """Task logits (``[B, n, V]`` for mlm, ``[B, n, classes]`` for tagging,
        ``[B, classes]`` for classification) and the mean-field ``Posterior``."""
        if mask is None and isinstance(tokens, torch.Tensor):
            mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        # tokens and mask are checked once, by the engine (MeanField.structure): a second
        # check here read their values again (a host synchronisation on a GPU)
        refuse_non_finite_parameters(self)  # the head and halting unit too (the engine checks the CRF)
        posterior = self.mean_field(tokens, mask, confidence=self.exit_confidence(mask))
        return self.head(posterior.logits, mask), posterior

    def exit_confidence(self, mask: torch.Tensor):
        """What ends a token under ``halting="exit"`` (the engine's ``confidence``): the task
        head's top probability on the token's label logits; virtual nodes never exit. None
        without exit or in training (every iteration runs). Forward, the diagnostic trace
        and the inference gap all read the q this gives."""
        if self.config.halting != "exit" or self.training:
            return None

        def confidence(logits):
            top = self.head(logits, mask).softmax(-1).amax(-1)
            return F.pad(top, (0, logits.shape[1] - top.shape[1]))

        return confidence

    def auxiliary_loss(self, posterior, mask: torch.Tensor, targets: torch.Tensor, token_count=None,
                       target_count=None) -> torch.Tensor | None:  # fmt: skip
        """What the trainer adds to the task loss: ACT's ponder cost (per real token), the span
        penalty and, with ``aligned_training``, the task loss of every earlier iteration's output
        (per target token, like the task loss). None when there is nothing to add.

        ``token_count`` and ``target_count`` are the per-token terms' denominators, by default
        this batch's real and target tokens. Under DDP each process holds a share of the batch
        and DDP averages the processes' gradients: the trainer passes the whole batch's counts
        divided by the process count, so that average is the whole batch's mean (as for the
        task loss), not a mean of the processes' means."""
        config, n, terms = self.config, mask.shape[1], []
        if posterior.halting is not None and "ponder" in posterior.halting and config.ponder_cost:
            ponder = posterior.halting["ponder"][:, :n]
            tokens = mask.sum().clamp(min=1) if token_count is None else token_count
            terms.append(config.ponder_cost * (ponder * mask).sum() / tokens)
        if self.mean_field.span is not None and config.span_penalty:
            terms.append(config.span_penalty * self.mean_field.spans().mean())
        if config.aligned_training:
            count = (targets != -100).sum().clamp(min=1) if target_count is None else target_count
            for logits in posterior.history[:-1]:
                outputs = self.head(logits, mask).float()
                terms.append(F.cross_entropy(outputs.transpose(1, 2), targets, reduction="sum") / count)
        return sum(terms) if terms else None

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per iteration the
        token label logits ``hidden [T, B, n, d]``, the head marginals (attention)
        ``[T, B, C, n, n]`` and the mean-field ELBO ``[T, B]``."""
        tokens, mask = self.crf.check_inputs(tokens, mask)
        trace = self.mean_field(tokens, mask, confidence=self.exit_confidence(mask)).trace
        n = tokens.shape[1]
        found = {"hidden": trace["logits"][:, :, :n], "attention": trace["heads"][..., :n, :n]}
        if "elbo" in trace:  # not for a product-key memory
            found["elbo"] = trace["elbo"]
        return found
