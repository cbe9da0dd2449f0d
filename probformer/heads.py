"""Task heads shared by every model: they read per-node representations
``[B, N, D]`` (for PT: the final unnormalised label logits) and the token mask."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TASKS", "POOLINGS", "TaskHead"]

TASKS = ("mlm", "tagging", "classification")
POOLINGS = ("mean", "root")


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
