"""Baselines of equal parameter count: a BERT-style encoder (L distinct blocks) and a
Universal Transformer (one weight-tied block applied L times, with a step signal).

Both read token + learned position embeddings, use the shared ``Block`` (pre-LN by
default, post-LN as BERT originally) and the shared ``TaskHead``, so the only
difference from the Probabilistic Transformer is the encoder. ``equal_size`` picks
the width that matches a target parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from graphs.device_checks import refuse_non_finite_parameters
from probformer.models.blocks import NORMS, Block, TaskHead, check_token_inputs, refuse_non_finite_weights
from probformer.models.config import ConfigMixin
from probformer.models.pretrained import PretrainedMixin

__all__ = ["TransformerConfig", "Transformer", "equal_size", "parameter_count"]


@dataclass
class TransformerConfig(ConfigMixin):
    vocab_size: int
    width: int = 256
    heads: int = 8
    layers: int = 4  # distinct blocks, or applications of the one block if universal
    ffn_width: int = 1024
    max_length: int = 512
    dropout: float = 0.1
    norm: str = "pre"  # "pre" or "post" (original BERT)
    universal: bool = False  # one weight-tied block applied `layers` times
    task: str = "mlm"
    num_classes: int = 0
    pooling: str = "mean"

    def __post_init__(self):
        self.check_integers(
            {"vocab_size": 1, "width": 1, "heads": 1, "layers": 1, "ffn_width": 1, "max_length": 1, "num_classes": 0}
        )
        if self.width % self.heads:
            raise ValueError(f"config key 'width' ({self.width}) must be divisible by 'heads' ({self.heads})")
        if self.norm not in NORMS:
            raise ValueError(f"config key 'norm' must be one of {list(NORMS)}, got {self.norm!r}")
        self.check_dropout()
        self.check_flags("universal")
        self.check_task("transformer")


class Transformer(nn.Module, PretrainedMixin):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.max_length, config.width)
        blocks = 1 if config.universal else config.layers
        self.blocks = nn.ModuleList(
            Block(config.width, config.heads, config.ffn_width, config.dropout, config.norm) for _ in range(blocks)
        )
        # the Universal Transformer's "coordinate" signal: which application this is
        self.step = nn.Embedding(config.layers, config.width) if config.universal else None
        self.final_norm = nn.LayerNorm(config.width) if config.norm == "pre" else nn.Identity()
        self.embedding_norm = nn.LayerNorm(config.width) if config.norm == "post" else nn.Identity()
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        self.head = TaskHead(config.task, config.width, outputs, config.pooling)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        """Task logits and, per layer, the hidden states ``[L, B, n, width]``."""
        c, device = self.config, self.embedding.weight.device
        tokens, mask = check_token_inputs(tokens, mask, c.vocab_size, c.max_length, device)
        refuse_non_finite_parameters(self)  # a weight overwritten in memory: refused by name, no host read
        n = tokens.shape[1]
        x = self.embedding(tokens) + self.position(torch.arange(n, device=tokens.device))
        x = nn.functional.dropout(self.embedding_norm(x), self.config.dropout, self.training)
        key_bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        hidden = []
        for layer in range(self.config.layers):
            block = self.blocks[0 if self.config.universal else layer]
            if self.step is not None:
                x = x + self.step.weight[layer]
            x, _ = block(x, key_bias)
            hidden.append(x)
        return self.head(self.final_norm(x), mask), torch.stack(hidden)

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per layer the token
        states ``hidden [L, B, n, width]`` and the attention ``[L, B, heads, n, n]``. Hooks
        ask each block call for its materialised attention probabilities, so the forward
        pass runs as it is (a weight-tied block is called once per layer)."""
        attention = []

        def materialise(block, args):
            return (*args[:2], True)  # Block.forward(x, key_bias, return_attention=True)

        def keep(block, args, output):
            attention.append(output[1])

        handles = []
        for block in self.blocks:
            handles += [block.register_forward_pre_hook(materialise), block.register_forward_hook(keep)]
        try:
            _, hidden = self(tokens, mask)
        finally:
            for handle in handles:
                handle.remove()
        return {"hidden": hidden, "attention": torch.stack(attention)}


def parameter_count(config: TransformerConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(config).parameters())


def equal_size(template: TransformerConfig, target: int) -> TransformerConfig:
    """``template`` with the width (a multiple of ``heads``; FFN keeps its width ratio)
    whose parameter count is closest to ``target``."""
    ratio = template.ffn_width / template.width
    best = None
    for width in range(template.heads, 8193, template.heads):
        candidate = replace(template, width=width, ffn_width=max(1, round(ratio * width)))
        gap = abs(parameter_count(candidate) - target)
        if best is None or gap < best[0]:
            best = (gap, candidate)
        elif parameter_count(candidate) > target:
            break
    return best[1]
