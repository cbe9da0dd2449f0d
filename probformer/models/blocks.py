"""Everything a trained probformer model needs at run time, with torch alone.

This file imports only torch, safetensors and the standard library: ``probformer.export``
copies it next to the weights (``probformer_runtime.py``), so a deployment runs the
exported model without probformer, pyro, numpyro, jax, arviz or networkx.

It holds the torch building blocks the trainable models are made of (``Block``,
``TaskHead``, ``check_token_inputs``) and an inference-only forward pass per model:

    ProbabilisticTransformerRuntime   T mean-field iterations unrolled (async or parallel
                                      schedule, naive head kernel, messages scaled by the
                                      exported multipliers, so μP needs no code here)
    ParticleTransformerRuntime        resampling by the fixed inference rule: every
                                      position takes its most attended ancestor (argmax)
    TransformerRuntime                the BERT-style and Universal-Transformer baselines

Every forward pass maps ``tokens [B, n]`` (int64) and ``mask [B, n]`` (bool) to the task
logits, with no data-dependent Python control flow: it traces into a fixed graph
(torch.export, ONNX) with a dynamic batch and length. The topology rules are
restated here from ``graphs.topology`` (which needs networkx); ``export`` checks
the two agree before writing anything.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Block",
    "window_attention",
    "TaskHead",
    "check_token_inputs",
    "log_attention_mass",
    "normalised_ess",
    "NORMS",
    "TASKS",
    "POOLINGS",
    "topology_mask",
    "topology_extra_nodes",
    "distance_groups",
    "ProbabilisticTransformerRuntime",
    "ParticleTransformerRuntime",
    "TransformerRuntime",
    "RUNTIMES",
    "FORMAT",
    "check_state",
    "load",
]

FORMAT = "probformer-torch/1"
NORMS = ("pre", "post")
TASKS = ("mlm", "tagging", "classification")
POOLINGS = ("mean", "root")


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def check_token_inputs(tokens, mask, vocab_size: int, max_length: int | None = None):
    """Validated ``(tokens, mask)``: integer ids ``[B, n]`` (n <= ``max_length`` if given),
    a bool mask of the same shape (default: all real), real ids in ``[0, vocab_size)``, a
    real token in every row; padded ids -> 0. Value checks are skipped while tracing."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ValueError(f"tokens must be integer ids of shape [batch, length], got {getattr(tokens, 'shape', tokens)}")
    if tokens.dtype == torch.bool or tokens.dtype.is_complex:
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    if max_length is not None and tokens.shape[1] > max_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_length={max_length}")
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
    if not isinstance(mask, torch.Tensor) or mask.shape != tokens.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(tokens.shape)}")
    if not _tracing():
        if tokens.numel() == 0:
            raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
        if ((tokens[mask] < 0) | (tokens[mask] >= vocab_size)).any():
            raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size)")
        if (~mask.any(1)).any():
            raise ValueError("every row needs at least one real token")
    return tokens.long().masked_fill(~mask, 0), mask


# ---- building blocks of the trainable models ---------------------------------------


def window_attention(q, k, v, key_bias, left: int, right: int, dropout_p: float = 0.0):
    """Attention of each query i to the keys i - left .. i + right only, never across the
    ends of the sequence: ``q, k, v [B, H, n, dh]``, ``key_bias [B, n]`` (padding -inf).
    O(n (left + right + 1) dh) time and memory, against O(n^2 dh) for a banded mask: the
    keys are unfolded into windows. A query with no allowed key (padding) attends to
    itself, so nothing turns into NaN."""
    n = q.shape[2]
    # key positions i - left .. i + right per query, gathered (not unfolded from a padded
    # copy), so a traced length stays symbolic; positions outside the sequence are masked
    window = torch.arange(n, device=q.device)[:, None] + torch.arange(-left, right + 1, device=q.device)
    inside = (window >= 0) & (window < n)  # [n, width]
    window = window.clamp(0, n - 1)
    windowed_keys, windowed_values = k[:, :, window], v[:, :, window]  # [B, H, n, width, dh]
    bias = key_bias[:, window].masked_fill(~inside, float("-inf"))  # [B, n, width]
    allowed = torch.isfinite(bias)
    itself = torch.arange(left + right + 1, device=q.device) == left
    allowed = allowed | (~allowed.any(-1, keepdim=True) & itself)
    scores = (q[..., None, :] @ windowed_keys.transpose(-1, -2)).squeeze(-2) / math.sqrt(q.shape[-1])
    bias = torch.where(allowed, torch.where(torch.isfinite(bias), bias, 0.0), float("-inf"))
    scores = scores + bias[:, None].to(scores.dtype)  # [B, H, n, width]
    probs = F.dropout(scores.softmax(-1), dropout_p, dropout_p > 0)
    return (probs[..., None, :] @ windowed_values).squeeze(-2)  # [B, H, n, dh]


class Block(nn.Module):
    """pre-LN: x + attention(LN x), then + FFN(LN x); post-LN: LN(x + attention(x)),
    then LN(x + FFN(x)). ``key_bias [B, n]`` is added to every
    query's scores (padding: -inf); with ``return_attention`` the attention
    probabilities ``[B, heads, n, n]`` are returned too (materialised), otherwise
    torch's fused ``scaled_dot_product_attention`` is used. ``window=(left, right)``
    restricts query i to keys i - left .. i + right (``window_attention``)."""

    def __init__(self, width: int, heads: int, ffn_width: int, dropout: float = 0.0, norm: str = "pre"):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {list(NORMS)}, got {norm!r}")
        self.heads, self.dropout, self.norm = heads, dropout, norm
        self.attention_norm, self.ffn_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_width), nn.GELU(), nn.Linear(ffn_width, width))

    def attend(self, x, key_bias, return_attention=False, window=None):
        """Self-attention of x (pre-LN: of LN x)."""
        B, n, width = x.shape
        q, k, v = (
            self.qkv(self.attention_norm(x) if self.norm == "pre" else x)
            .view(B, n, 3, self.heads, -1)
            .permute(2, 0, 3, 1, 4)
        )
        p = self.dropout if self.training else 0.0
        probs = None
        if window is not None:
            mixed = window_attention(q, k, v, key_bias.to(q.dtype), window[0], window[1], p)
        elif not return_attention:
            mixed = F.scaled_dot_product_attention(
                q, k, v, attn_mask=key_bias[:, None, None, :].to(q.dtype), dropout_p=p
            )
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + key_bias[:, None, None, :].to(q.dtype)
            probs = scores.softmax(-1)
            mixed = F.dropout(probs, p, self.training) @ v
        return self.out(mixed.transpose(1, 2).reshape(B, n, width)), probs

    def transition(self, x):
        """The FFN move of x (pre-LN: of LN x)."""
        return F.dropout(self.ffn(self.ffn_norm(x) if self.norm == "pre" else x), self.dropout, self.training)

    def forward(self, x, key_bias, return_attention=False, window=None):
        mixed, probs = self.attend(x, key_bias, return_attention, window)
        x = x + F.dropout(mixed, self.dropout, self.training)
        if self.norm == "post":
            x = self.attention_norm(x)
            return self.ffn_norm(x + self.transition(x)), probs
        return x + self.transition(x), probs


class TaskHead(nn.Module):
    """mlm: a linear decoder to the vocabulary at every token (untied, with bias, as the
    PT reference); tagging: a linear layer to ``num_classes`` at every token;
    classification: ``num_classes`` logits per sentence from the mean over real tokens
    ("mean") or from the ROOT node, the first virtual node ("root")."""

    def __init__(self, task: str, width: int, num_outputs: int, pooling: str = "mean"):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {list(TASKS)}")
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; allowed: {list(POOLINGS)}")
        self.task, self.pooling = task, pooling
        self.decoder = nn.Linear(width, num_outputs)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = mask.shape[1]
        if self.task != "classification":
            return self.decoder(hidden[:, :n])  # [B, n, outputs]
        if self.pooling == "root":
            return self.decoder(hidden[:, n])  # the first virtual node
        weights = mask[..., None].to(hidden.dtype)
        pooled = (hidden[:, :n] * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.decoder(pooled)  # [B, outputs]


# ---- topologies (the rules of graphs.topology, as tensor expressions of n) -----------

_TERM = re.compile(r"^\s*([a-z_]+)\s*\(\s*([^()]*?)\s*\)\s*$")
_EXTRA_NODES = {"full": 0, "causal": 0, "window": 0, "segments": 0, "star": 1, "root": 1}


def _terms(topology: str) -> list[tuple[str, list]]:
    """``"window(2) | star(wrap=False)"`` -> ``[("window", [2]), ("star", [False])]``."""
    terms = []
    for text in topology.split("|"):
        match = _TERM.match(text)
        if match is None:
            raise ValueError(f"cannot read topology {topology!r}: bad term {text.strip()!r}")
        args = []
        for raw in filter(None, (a.strip() for a in match.group(2).split(","))):
            value = raw.rpartition("=")[2].strip()
            args.append(value in ("True", "true") if value in ("True", "true", "False", "false") else int(value))
        if match.group(1) not in _EXTRA_NODES and match.group(1) != "clusters":
            raise ValueError(f"unknown topology term {match.group(1)!r} in {topology!r}")
        terms.append((match.group(1), args))
    return terms


def topology_extra_nodes(topology: str) -> int:
    return sum(args[0] if name == "clusters" else _EXTRA_NODES[name] for name, args in _terms(topology))


def _term_mask(name: str, args: list, n: int, device) -> torch.Tensor:
    position = torch.arange(n, device=device)
    offset = position[None, :] - position[:, None]  # head minus dependent
    if name == "full":
        return torch.ones_like(offset, dtype=torch.bool)
    if name == "causal":
        return offset < 0
    if name == "window":
        return offset.abs() <= args[0]
    if name == "segments":
        segment = torch.div(position, args[0], rounding_mode="floor")
        gap = segment[:, None] - segment[None, :]
        causal = len(args) > 1 and args[1]
        return ((gap == 0) & (offset < 0) if causal else gap == 0) | (gap == 1)
    if name in ("star", "root"):
        ring = offset.abs() == 1
        if name == "star" and args and args[0]:
            ring = ring | (offset.abs() == n - 1)  # closes the ring; the diagonal is cleared later
        tokens = ring if name == "star" else torch.zeros_like(ring)
        to_hub = torch.ones(n, 1, dtype=torch.bool, device=device)
        from_hub = torch.full((1, n + 1), name == "star", dtype=torch.bool, device=device)
        return torch.cat([torch.cat([tokens, to_hub], 1), from_hub], 0)
    k = args[0]  # clusters: token i belongs to cluster floor(i k / n), or to any if dynamic
    member = torch.div(position * k, n, rounding_mode="floor")
    belongs = member[:, None] == torch.arange(k, device=device)[None, :]  # [n, k]
    if len(args) > 1 and args[1]:
        belongs = torch.ones_like(belongs)
    top = torch.cat([torch.zeros(n, n, dtype=torch.bool, device=device), belongs], 1)
    bottom = torch.cat([belongs.T, torch.ones(k, k, dtype=torch.bool, device=device)], 1)
    return torch.cat([top, bottom], 0)


def topology_mask(topology: str, n: int, device=None) -> torch.Tensor:
    """``[n + m, n + m]`` bool: node i may take node j as head (``graphs.topology``'s
    ``mask``). Operands of ``|`` OR their token arcs; their virtual nodes follow the
    tokens in order."""
    blocks = [_term_mask(name, args, n, device) for name, args in _terms(topology)]
    token_arcs = torch.stack([b[:n, :n] for b in blocks]).any(0)
    extra = [b.shape[0] - n for b in blocks]
    size = n + sum(extra)
    rows = [torch.cat([token_arcs] + [b[:n, n:] for b in blocks], 1)]
    for b, m in zip(blocks, extra):
        if m:
            columns = [b[n:, :n]] + [b[n:, n:] if c is b else b.new_zeros(m, c.shape[0] - n) for c in blocks]
            rows.append(torch.cat(columns, 1))
    arcs = torch.cat(rows, 0)
    return arcs & ~torch.eye(size, dtype=torch.bool, device=device)


def distance_groups(n: int, gamma: int, extra_nodes: int = 0, device=None) -> torch.Tensor:
    """``[n + m, n + m]`` distance group of every arc (``graphs.crf.distance_groups``)."""
    position = torch.arange(n, device=device)
    offset = position[None, :] - position[:, None]
    clipped = offset.abs().clamp(max=gamma + 1)
    groups = torch.where(offset > 0, clipped - 1, gamma + clipped)
    return F.pad(groups, (0, extra_nodes, 0, extra_nodes), value=2 * (gamma + 1))


# ---- the Probabilistic Transformer ----------------------------------------------------


class _Potentials(nn.Module):
    """The CRF's parameters under their training names (``crf.unary`` ...)."""

    def __init__(self, vocab_size, labels, channels, rank, global_labels, groups):
        super().__init__()
        self.unary = nn.Parameter(torch.empty(vocab_size, labels))
        self.ternary_u = nn.Parameter(torch.empty(groups, channels, labels, rank))
        self.ternary_v = nn.Parameter(torch.empty(groups, channels, labels, rank))
        self.binary = nn.Parameter(torch.empty(global_labels, labels)) if global_labels else None


class ProbabilisticTransformerRuntime(nn.Module):
    """Mean field on the PT's CRF, T iterations unrolled, in eval mode (no dropout).

    ``config``: vocab_size, labels, channels, rank, global_labels, topology (text),
    gamma, iterations, schedule ("async" | "parallel"), scales (the effective multiplier
    of each message: unary, head, dependents, topic, attention, topic_logits), task,
    num_classes, pooling.
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.extra_nodes = topology_extra_nodes(config["topology"])
        self.scales = {k: float(v) for k, v in config["scales"].items()}
        groups = 2 * (config["gamma"] + 1) + (1 if self.extra_nodes else 0)
        self.crf = _Potentials(
            config["vocab_size"], config["labels"], config["channels"], config["rank"], config["global_labels"], groups
        )
        outputs = config["vocab_size"] if config["task"] == "mlm" else config["num_classes"]
        self.head = TaskHead(config["task"], config["labels"], outputs, config["pooling"])

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        config, s, crf = self.config, self.scales, self.crf
        tokens, mask = check_token_inputs(tokens, mask, config["vocab_size"])
        B, n = tokens.shape
        device, d = tokens.device, config["labels"]
        nodes = torch.cat([mask, mask.new_ones(B, self.extra_nodes)], 1)
        arcs = topology_mask(config["topology"], n, device)[None] & nodes[:, :, None] & nodes[:, None, :]
        no_head = torch.where(arcs.any(-1), -math.inf, 0.0).to(crf.unary.dtype)[:, None, :, None]
        groups = distance_groups(n, config["gamma"], self.extra_nodes, device)
        in_group = [groups == k for k in range(crf.ternary_u.shape[0])]
        unary = torch.cat([crf.unary[tokens] * mask[..., None], crf.unary.new_zeros(B, self.extra_nodes, d)], 1)

        logits, previous = unary, None
        for _ in range(config["iterations"]):
            q_z = logits.softmax(-1) * nodes[..., None]
            query = torch.einsum("bnd,kcdr->bnkcr", q_z, crf.ternary_u)
            key = torch.einsum("bnd,kcdr->bnkcr", q_z, crf.ternary_v)
            if config["schedule"] == "async":
                source = (query, key, q_z)
            else:  # parallel: heads and globals from the previous iteration (zeros at t = 0)
                source = previous or (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(q_z))
                previous = (query, key, q_z)
            head_logits = None  # [B, C, N, N]: each arc scored with its distance group's table
            for k, where in enumerate(in_group):
                scores = s["attention"] * (source[0][:, :, k].transpose(1, 2) @ source[1][:, :, k].permute(0, 2, 3, 1))
                head_logits = scores if head_logits is None else torch.where(where, scores, head_logits)
            head_logits = head_logits.masked_fill(~arcs[:, None], -math.inf)
            # a null column (logit 0) on rows with no legal head keeps the softmax finite
            null = no_head.expand(*head_logits.shape[:-1], 1)
            heads = torch.cat([head_logits, null], -1).softmax(-1)[..., :-1]
            forward, reverse = [], []
            for k, where in enumerate(in_group):
                chosen = heads * where
                forward.append(chosen @ key[:, :, k].transpose(1, 2))
                reverse.append(chosen.transpose(-1, -2) @ query[:, :, k].transpose(1, 2))
            forward = torch.stack(forward, 2).transpose(1, 3)  # [B, N, K, C, r]
            reverse = torch.stack(reverse, 2).transpose(1, 3)
            head = torch.einsum("bnkcr,kcdr->bnd", forward, crf.ternary_u)
            dependents = torch.einsum("bnkcr,kcdr->bnd", reverse, crf.ternary_v)
            logits = s["unary"] * unary + s["head"] * head + s["dependents"] * dependents
            if crf.binary is not None:
                q_g = (s["topic_logits"] * source[2][:, :n] @ crf.binary.T).softmax(-1) * mask[..., None]
                logits = logits + s["topic"] * F.pad(q_g @ crf.binary, (0, 0, 0, self.extra_nodes))
        return self.head(logits * nodes[..., None], mask)


# ---- the Particle Transformer and the baselines ---------------------------------------


def log_attention_mass(attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` log of the attention each real token receives, relative to the mean (1)."""
    mass = (attention * mask[:, :, None]).sum(1)  # sums to the number of real tokens
    return torch.where(mask, mass.clamp(min=1e-30).log(), -math.inf)


def normalised_ess(log_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` ESS / (number of real tokens) of per-token log-weights."""
    ess = (2 * log_weights.logsumexp(-1) - (2 * log_weights).logsumexp(-1)).exp()
    return ess / mask.sum(-1)


class ParticleTransformerRuntime(nn.Module):
    """Blocks with importance log-weights as attention bias; every ``resample_every``
    blocks, sentences whose ESS / n is below ``ess_threshold`` resample: each position
    adds the state of its most attended ancestor (the fixed inference rule)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        width = config["width"]
        self.embedding = nn.Embedding(config["vocab_size"], width)
        self.position = nn.Embedding(config["max_length"], width)
        self.blocks = nn.ModuleList(Block(width, config["heads"], config["ffn_width"]) for _ in range(config["layers"]))
        self.resample_norm = nn.LayerNorm(width)
        self.resample_value = nn.Linear(width, width)
        self.final_norm = nn.LayerNorm(width)
        outputs = config["vocab_size"] if config["task"] == "mlm" else config["num_classes"]
        self.head = TaskHead(config["task"], width, outputs, config["pooling"])

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        config = self.config
        tokens, mask = check_token_inputs(tokens, mask, config["vocab_size"], config["max_length"])
        n = tokens.shape[1]
        x = self.embedding(tokens) + self.position(torch.arange(n, device=tokens.device))
        padding = torch.where(mask, 0.0, -math.inf).to(x.dtype)
        log_weights = torch.zeros_like(padding).masked_fill(~mask, -math.inf)
        real = mask.sum(-1, keepdim=True)
        for index, block in enumerate(self.blocks):
            mixed, per_head = block.attend(x, padding + log_weights.masked_fill(~mask, 0.0), return_attention=True)
            attention = per_head.mean(1)
            x = x + mixed
            x = x + block.transition(x)
            log_weights = log_weights + log_attention_mass(attention, mask)
            log_weights = log_weights - log_weights.logsumexp(-1, keepdim=True) + real.log()
            if (index + 1) % config["resample_every"] == 0:
                ess = normalised_ess(log_weights, mask)
                active = ess < config["ess_threshold"] if config["ess_threshold"] < 1 else torch.ones_like(mask[:, 0])
                row = attention.clamp(min=1e-30).log().masked_fill(~mask[:, None, :], -math.inf)
                ancestor = row.argmax(-1)[..., None].expand(-1, -1, x.shape[-1])
                moved = x + self.resample_value(self.resample_norm(x)).gather(1, ancestor)
                x = torch.where(active[:, None, None], moved, x)
                log_weights = torch.where(active[:, None] & mask, 0.0, log_weights)
        return self.head(self.final_norm(x), mask)


class TransformerRuntime(nn.Module):
    """The BERT-style encoder (``universal`` false) or the Universal Transformer."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        width, post = config["width"], config["norm"] == "post"
        self.embedding = nn.Embedding(config["vocab_size"], width)
        self.position = nn.Embedding(config["max_length"], width)
        blocks = 1 if config["universal"] else config["layers"]
        self.blocks = nn.ModuleList(
            Block(width, config["heads"], config["ffn_width"], norm=config["norm"]) for _ in range(blocks)
        )
        self.step = nn.Embedding(config["layers"], width) if config["universal"] else None
        self.final_norm = nn.Identity() if post else nn.LayerNorm(width)
        self.embedding_norm = nn.LayerNorm(width) if post else nn.Identity()
        outputs = config["vocab_size"] if config["task"] == "mlm" else config["num_classes"]
        self.head = TaskHead(config["task"], width, outputs, config["pooling"])

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        config = self.config
        tokens, mask = check_token_inputs(tokens, mask, config["vocab_size"], config["max_length"])
        x = self.embedding(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.embedding_norm(x)
        key_bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, -math.inf)
        for layer in range(config["layers"]):
            if self.step is not None:
                x = x + self.step.weight[layer]
            x, _ = self.blocks[0 if config["universal"] else layer](x, key_bias)
        return self.head(self.final_norm(x), mask)


RUNTIMES = {
    "probabilistic_transformer": ProbabilisticTransformerRuntime,
    "particle_transformer": ParticleTransformerRuntime,
    "transformer": TransformerRuntime,
}

_REQUIRED = {
    "probabilistic_transformer": (
        "vocab_size labels channels rank global_labels topology gamma iterations schedule scales task "
        "num_classes pooling"
    ),
    "particle_transformer": (
        "vocab_size width heads layers ffn_width max_length resample_every ess_threshold task num_classes pooling"
    ),
    "transformer": "vocab_size width heads layers ffn_width max_length norm universal task num_classes pooling",
}


# ---- loading ------------------------------------------------------------------------


def read_config(directory) -> dict:
    """``config.json`` of an exported model, checked: the format, a known model kind and
    every key the runtime needs."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"not an exported probformer model: {path} is missing")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: format must be {FORMAT!r}, got {found!r}")
    if meta.get("model") not in RUNTIMES:
        raise ValueError(f"{path}: unknown model {meta.get('model')!r}; known: {sorted(RUNTIMES)}")
    config = meta.get("config")
    missing = [k for k in _REQUIRED[meta["model"]].split() if not isinstance(config, dict) or k not in config]
    if missing:
        raise ValueError(f"{path}: config lacks keys {missing}")
    return meta


def check_state(weights: dict, expected: dict, path) -> None:
    """Raise ``ValueError`` naming ``path`` unless ``weights`` has exactly the keys of
    ``expected`` with the same shapes."""
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    wrong = [k for k in expected if expected[k].shape != weights[k].shape]
    if wrong:
        raise ValueError(
            f"{path}: shape mismatch for {wrong[:5]} (e.g. {wrong[0]}: "
            f"{tuple(weights[wrong[0]].shape)} in the file, {tuple(expected[wrong[0]].shape)} by the config)"
        )


def load(directory, device="cpu") -> nn.Module:
    """The model in an export directory (``config.json`` + ``model.safetensors``), in eval
    mode. Files that are not what they claim raise ``ValueError`` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = read_config(directory)
    weights_path = directory / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"not an exported probformer model: {weights_path} is missing")
    try:
        weights = load_file(str(weights_path), device=str(device))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {error}") from None
    try:
        with torch.device("meta"):
            model = RUNTIMES[meta["model"]](meta["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{directory / 'config.json'}: bad config value: {error!r}") from None
    check_state(weights, model.state_dict(), weights_path)
    model.load_state_dict(weights, assign=True)
    return model.requires_grad_(False).eval()
