"""Early stopping on the validation loss: stop once ``patience`` periodic validations in a
row have not improved on the best one.

Its state (the best loss, the step it was reached at, the validations since) is part of
every training checkpoint, so a resumed run stops at exactly the step the uninterrupted
run would have stopped at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probformer.training import placement

__all__ = ["EarlyStopping"]


@dataclass
class EarlyStopping:
    patience: int  # validations without a new best before stopping; 0: never stop early
    best_loss: float = math.inf
    best_step: int = 0
    since_best: int = 0

    def update(self, loss: float, step: int) -> None:
        """Record the validation loss measured after ``step``."""
        if loss < self.best_loss:  # a NaN loss never counts as an improvement
            self.best_loss, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1

    @property
    def stop(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def share(self, rank: int, world: int, device: torch.device) -> None:
        """Every process of a DDP run takes rank 0's decision (only rank 0 validates)."""
        if world > 1:
            flag = torch.tensor([float(rank == 0 and self.stop)], device=device)
            stop = bool(placement.all_sum(flag, world).item())  # a validation step: the host waits for it anyway
            if rank != 0:
                self.since_best = self.patience if stop else 0

    def describe(self) -> str:
        return (
            f"stopping early, {self.patience} validations without a new best "
            f"(best loss {self.best_loss:.4f} at step {self.best_step})"
        )

    def state(self) -> dict:
        best = self.best_loss if math.isfinite(self.best_loss) else None  # strict JSON has no Infinity
        return {"best_loss": best, "best_step": self.best_step, "since_best": self.since_best}

    def restore(self, state: dict) -> None:
        """The counters saved by ``state``; a checkpoint written before early stopping
        existed holds none, and starts with no best."""
        best = state.get("best_loss")
        self.best_loss = math.inf if best is None else best
        self.best_step = state.get("best_step", 0)
        self.since_best = state.get("since_best", 0)
