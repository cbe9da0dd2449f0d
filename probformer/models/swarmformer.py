"""SwarmFormer, enhanced: tokens attend locally, route themselves into clusters, the
clusters talk among themselves, and a gate lets each token take back what its cluster
learned.

One layer (every attention and MLP pre-LN):
    1. local:     ``local_rounds`` blocks of window attention, keys i - w .. i + w, never
                  across the ends of the sequence (``runtime.window_attention``);
    2. routing:   token i scores cluster k by attention, ``(W_r LN x_i) . key_k / sqrt(d)``;
                  "gumbel": a Gumbel-softmax sample, one-hot in the forward pass and soft
                  in the backward pass (straight-through; the argmax at evaluation);
                  "contiguous": token i of a row of n real tokens joins cluster
                  floor(i C / n) (any n, the original SwarmFormer's fixed chunks);
    3. update:    only the ``top_p`` fraction of each row's tokens whose routing is most
                  confident write to the clusters: a cluster is its key plus the mean of
                  its writers' states (contiguous: every token, top_p = 1: all are equally
                  confident);
    4. clusters:  multi-head attention among the clusters with one tied projection for
                  queries, keys and values, then an MLP;
    5. feedback:  each token reads its cluster's state through a residual MLP gate,
                  ``x + sigmoid(MLP([LN x, c])) * W c``.
A pyramid halves the clusters up the stack: C in the lowest third, C/2, then C/4.

Costs per layer: O(n w d) local attention + O(n C d) routing + O(C^2 d) among clusters +
O(n d^2) projections, against O(n^2 d) for full attention.

The probabilistic reading is ``graphs.topology.window(w) | graphs.topology.clusters(C,
dynamic=True)``: a token's head posterior over the cluster nodes is its routing
distribution, and ``inference.MeanField`` runs on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphs.device_checks import refuse_non_finite_parameters
from probformer.models.blocks import Block, TaskHead, check_token_inputs, one_hot, refuse_non_finite_weights
from probformer.models.config import ConfigMixin
from probformer.models.pretrained import PretrainedMixin

__all__ = ["SwarmConfig", "SwarmFormer", "SwarmLayer", "ROUTINGS"]

ROUTINGS = ("gumbel", "contiguous")


@dataclass
class SwarmConfig(ConfigMixin):
    vocab_size: int
    width: int = 128
    heads: int = 4
    layers: int = 3
    ffn_width: int = 512
    window: int = 3  # w: local attention reaches w tokens each side
    local_rounds: int = 1  # local blocks per layer
    clusters: int = 16  # C, in the lowest layers
    pyramid: bool = True  # C, C/2, C/4 up the stack
    routing: str = "gumbel"
    top_p: float | None = None  # the fraction of tokens that update the clusters; None: 0.5, contiguous 1
    temperature: float = 1.0  # of the Gumbel-softmax
    max_length: int = 512
    dropout: float = 0.1
    task: str = "mlm"
    num_classes: int = 0
    pooling: str = "mean"

    def __post_init__(self):
        self.check_integers(
            {"vocab_size": 1, "width": 1, "heads": 1, "layers": 1, "ffn_width": 1, "window": 1}
            | {"local_rounds": 1, "clusters": 1, "max_length": 1, "num_classes": 0}
        )
        if self.width % self.heads:
            raise ValueError(f"config key 'width' ({self.width}) must be divisible by 'heads' ({self.heads})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"config key 'routing' must be one of {list(ROUTINGS)}, got {self.routing!r}")
        if self.top_p is None:
            self.top_p = 1.0 if self.routing == "contiguous" else 0.5
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"config key 'top_p' must lie in (0, 1], got {self.top_p!r}")
        if self.routing == "contiguous" and self.top_p < 1:
            # fixed chunks give every token confidence 1: the writers would be chosen by position,
            # the first ceil(top_p n) tokens, and the later chunks' clusters would get none
            raise ValueError(
                f"config keys 'routing'='contiguous' and 'top_p'={self.top_p!r}: contiguous chunks give every token "
                "routing confidence 1, so top-p would take the first tokens of each sentence as writers and leave "
                "the later chunks' clusters without any; use top_p = 1 (every token writes its chunk, the default "
                "for contiguous routing) or routing = 'gumbel'. A model saved with it learned with those writers: "
                "retrain it (top_p = 1 in its config.json runs it with every token writing)"
            )
        if not isinstance(self.temperature, int | float) or self.temperature <= 0:
            raise ValueError(f"config key 'temperature' must be > 0, got {self.temperature!r}")
        self.check_dropout()
        self.check_flags("pyramid")
        self.check_task("SwarmFormer")

    def cluster_counts(self) -> list[int]:
        """Clusters per layer: C, then C/2, then C/4 over thirds of the stack (at least 1)."""
        if not self.pyramid:
            return [self.clusters] * self.layers
        return [max(1, self.clusters >> min(2, 3 * layer // self.layers)) for layer in range(self.layers)]


def _top_fraction(confidence, mask, fraction: float):
    """``[B, n]`` bool: each row's ceil(fraction * real tokens) most confident real tokens;
    ties go in position order (earlier first) whatever the backend. O(n log n): the keep-th
    largest confidence from sorted values (which do not depend on how a sort orders ties),
    then every token above it and the first of those equal to it."""
    keep = torch.ceil(fraction * mask.sum(1, keepdim=True)).long()  # [B, 1], 1 .. real tokens
    scores = confidence.masked_fill(~mask, float("-inf"))
    threshold = scores.sort(1, descending=True).values.gather(1, keep - 1)  # [B, 1]
    above = scores > threshold
    tied = scores == threshold
    wanted = keep - above.sum(1, keepdim=True)  # how many of the tied tokens, in position order
    return (above | (tied & (tied.long().cumsum(1) <= wanted))) & mask


class SwarmLayer(nn.Module):
    def __init__(self, config: SwarmConfig, clusters: int):
        super().__init__()
        c = config
        self.config, self.clusters = c, clusters
        self.local = nn.ModuleList(Block(c.width, c.heads, c.ffn_width, c.dropout) for _ in range(c.local_rounds))
        self.route_norm = nn.LayerNorm(c.width)
        self.route_query = nn.Linear(c.width, c.width)
        self.cluster_keys = nn.Parameter(torch.randn(clusters, c.width) / math.sqrt(c.width))
        self.cluster_norm = nn.LayerNorm(c.width)
        self.cluster_projection = nn.Linear(c.width, c.width)  # tied: queries = keys = values
        self.cluster_out = nn.Linear(c.width, c.width)
        self.cluster_ffn_norm = nn.LayerNorm(c.width)
        self.cluster_ffn = nn.Sequential(nn.Linear(c.width, c.ffn_width), nn.GELU(), nn.Linear(c.ffn_width, c.width))
        self.feedback_norm = nn.LayerNorm(c.width)
        self.feedback_value = nn.Linear(c.width, c.width)
        self.gate = nn.Sequential(nn.Linear(2 * c.width, c.width), nn.GELU(), nn.Linear(c.width, c.width))

    def route(self, x, mask):
        """``(assignment [B, n, C], probabilities [B, n, C], writers [B, n])``: the
        one-hot (straight-through) assignment, the routing distribution, and the tokens
        that update the clusters. Padding is assigned nowhere."""
        c = self.config
        scores = self.route_query(self.route_norm(x)) @ self.cluster_keys.T / math.sqrt(c.width)
        probabilities = scores.softmax(-1)
        if c.routing == "contiguous":
            length = mask.sum(1, keepdim=True)
            member = torch.div(torch.arange(x.shape[1], device=x.device) * self.clusters, length, rounding_mode="floor")
            assignment = one_hot(member.clamp(max=self.clusters - 1), self.clusters, x.dtype)
            probabilities = assignment
        elif self.training:
            assignment = F.gumbel_softmax(scores, tau=c.temperature, hard=True)
        else:
            assignment = one_hot(scores.argmax(-1), self.clusters, x.dtype)
        assignment = assignment * mask[..., None]
        confidence = (probabilities * assignment).sum(-1)
        writers = _top_fraction(confidence.detach(), mask, c.top_p)
        return assignment, probabilities * mask[..., None], writers

    def attend_clusters(self, clusters):
        """Pre-LN multi-head self-attention among clusters with a tied Q/K/V projection."""
        B, C, width = clusters.shape
        heads = self.config.heads
        shared = self.cluster_projection(self.cluster_norm(clusters)).view(B, C, heads, -1).transpose(1, 2)
        p = self.config.dropout if self.training else 0.0
        mixed = F.scaled_dot_product_attention(shared, shared, shared, dropout_p=p)
        clusters = clusters + self.cluster_out(mixed.transpose(1, 2).reshape(B, C, width))
        return clusters + F.dropout(self.cluster_ffn(self.cluster_ffn_norm(clusters)), p, self.training)

    def forward(self, x, mask, key_bias):
        w = self.config.window
        for block in self.local:
            x = block(x, key_bias, window=(w, w))[0]
        assignment, probabilities, writers = self.route(x, mask)
        written = assignment * writers[..., None].to(x.dtype)  # [B, n, C]
        counts = written.sum(1)  # [B, C]
        members = written.transpose(1, 2) @ self.route_norm(x)  # [B, C, width]
        clusters = self.cluster_keys + members / counts.clamp(min=1)[..., None]
        clusters = self.attend_clusters(clusters)
        read = assignment @ clusters  # [B, n, width]: each token's cluster
        gate = torch.sigmoid(self.gate(torch.cat([self.feedback_norm(x), read], -1)))
        x = x + F.dropout(gate * self.feedback_value(read), self.config.dropout, self.training)
        return x, {"assignment": assignment, "probabilities": probabilities, "writers": writers, "clusters": clusters}


class SwarmFormer(nn.Module, PretrainedMixin):
    def __init__(self, config: SwarmConfig):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.max_length, config.width)
        self.layers = nn.ModuleList(SwarmLayer(config, k) for k in config.cluster_counts())
        self.final_norm = nn.LayerNorm(config.width)
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        self.head = TaskHead(config.task, config.width, outputs, config.pooling)

    def encode(self, tokens, mask=None):
        """Final states ``[B, n, width]``, per-layer states ``[L, B, n, width]`` and the
        per-layer routing (assignment, probabilities, writers, cluster states)."""
        c, device = self.config, self.embedding.weight.device
        tokens, mask = check_token_inputs(tokens, mask, c.vocab_size, c.max_length, device)
        refuse_non_finite_parameters(self)  # a weight overwritten in memory: refused by name, no host read
        n = tokens.shape[1]
        x = self.embedding(tokens) + self.position(torch.arange(n, device=tokens.device))
        x = F.dropout(x, self.config.dropout, self.training)
        key_bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        hidden, routes = [], []
        for layer in self.layers:
            x, route = layer(x, mask, key_bias)
            hidden.append(x)
            routes.append(route)
        return self.final_norm(x), torch.stack(hidden), routes, mask

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        """Task logits and, per layer, the hidden states ``[L, B, n, width]``."""
        final, hidden, _, mask = self.encode(tokens, mask)
        return self.head(final, mask), hidden

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per layer the token
        states ``hidden [L, B, n, width]`` and the routing (``assignment [B, n, C]`` ...).
        The window attention is never materialised: the report has no attention ESS."""
        _, hidden, routes, _ = self.encode(tokens, mask)
        return {"hidden": hidden, "routing": routes}
