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

from dataclasses import dataclass

import torch
from torch import nn

import graphs
import inference
from probformer import mup
from probformer.config import ConfigMixin
from probformer.mup import PARADIGMS
from probformer.runtime import POOLINGS, TASKS, TaskHead

__all__ = ["PTConfig", "ProbabilisticTransformer"]


@dataclass
class PTConfig(ConfigMixin):
    vocab_size: int
    labels: int = 384  # d: the width
    channels: int = 16  # C: attention heads
    rank: int = 64  # r: per-channel rank of the ternary tables
    global_labels: int = 0  # g: the FFN-like global variable (0: none)
    topology: str = "full"
    ternary_form: str = "low_rank"  # "low_rank" (U V^T per channel), "cp" or "tucker" (graphs.CRF)
    ternary_blocks: int = 1  # Tucker blocks of the "tucker" form
    gamma: int = 3  # distance clip: 2 (gamma + 1) relative-position groups
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

    def __post_init__(self):
        self.check_integers(
            {
                "vocab_size": 1,
                "labels": 1,
                "channels": 1,
                "rank": 1,
                "global_labels": 0,
                "gamma": 0,
                "iterations": 1,
                "num_classes": 0,
                "mup_base_width": 0,
                "ternary_blocks": 1,
            }
        )
        if self.ternary_form not in graphs.TERNARY_FORMS:
            raise ValueError(
                f"config key 'ternary_form' must be one of {list(graphs.TERNARY_FORMS)}, got {self.ternary_form!r}"
            )
        if self.mup and self.ternary_form != "low_rank":
            raise ValueError("config key 'mup' needs ternary_form='low_rank' (μP roles of CP/Tucker factors: not derived)")
        if self.mup_paradigm not in PARADIGMS:
            raise ValueError(f"config key 'mup_paradigm' must be one of {list(PARADIGMS)}, got {self.mup_paradigm!r}")
        inference.MessageWeights.parse(self.weights, self.labels)  # raises naming a bad weight
        if self.task not in TASKS:
            raise ValueError(f"config key 'task' must be one of {list(TASKS)}, got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"config key 'pooling' must be one of {list(POOLINGS)}, got {self.pooling!r}")
        if self.task != "mlm" and self.num_classes < 1:
            raise ValueError(f"config key 'num_classes' must be >= 1 for task {self.task!r}")
        if self.pooling == "root" and "root()" not in graphs.topology.parse(self.topology).name:
            raise ValueError("config key 'pooling'='root' needs a ROOT node: add '| root()' to 'topology'")


class ProbabilisticTransformer(nn.Module):
    def __init__(self, config: PTConfig):
        super().__init__()
        self.config = config
        self.crf = graphs.CRF(
            vocab_size=config.vocab_size,
            labels=config.labels,
            channels=config.channels,
            rank=config.rank,
            global_labels=config.global_labels,
            topology=config.topology,
            gamma=config.gamma,
            ternary_form=config.ternary_form,
            ternary_blocks=config.ternary_blocks,
        )
        # under μP the information weights are hyper-parameters of the base width, held fixed
        weights_width = mup.base_width(config) if config.mup else config.labels
        self.mean_field = inference.MeanField(
            self.crf,
            iterations=config.iterations,
            schedule=config.schedule,
            mup=config.mup,
            kernel=config.kernel,
            dropout=config.dropout,
            weights=inference.MessageWeights.parse(config.weights, weights_width),
            mup_scales=mup.engine_scales(config) if config.mup else None,
        )
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        self.head = TaskHead(config.task, config.labels, outputs, config.pooling)
        mup.initialise(self)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        """Task logits (``[B, n, V]`` for mlm, ``[B, n, classes]`` for tagging,
        ``[B, classes]`` for classification) and the mean-field ``Posterior``."""
        tokens, mask = self.crf.check_inputs(tokens, mask)
        posterior = self.mean_field(tokens, mask)
        return self.head(posterior.logits, mask), posterior

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per iteration the
        token label logits ``hidden [T, B, n, d]``, the head marginals (attention)
        ``[T, B, C, n, n]`` and the mean-field ELBO ``[T, B]``."""
        tokens, mask = self.crf.check_inputs(tokens, mask)
        trace = self.mean_field(tokens, mask).trace
        n = tokens.shape[1]
        return {"hidden": trace["logits"][:, :, :n], "attention": trace["heads"][..., :n, :n], "elbo": trace["elbo"]}
