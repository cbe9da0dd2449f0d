"""A run's metrics: ``metrics.jsonl`` (one JSON line per logged step and split), the
window-averaged training loss, and the loss-curve PNG.

Exact resume needs two things from the log, and a checkpoint stores both
(``state()``): how many complete lines the file held when the checkpoint was written
(on resume the file is cut back to exactly those lines, so a line logged after the
checkpoint, or half a line cut by a kill, is dropped and then logged again, once),
and the training-loss window not yet logged (its sum and step count, so the first
mean logged after a resume averages the same steps as an uninterrupted run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from probformer.training import crash_points
from probformer.training.checkpoint import write_failure
from probformer.training.checkpointing import write_text_atomic

__all__ = ["RunLog", "WALL_CLOCK_KEYS"]

# fields that measure time, not the run: they differ between any two runs
WALL_CLOCK_KEYS = ("elapsed", "tokens_per_second")


class RunLog:
    def __init__(self, path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled  # enabled: rank 0 of a DDP run
        self.lines = 0  # complete lines in the file
        self.window_loss, self.window_steps = 0.0, 0

    # -- the training-loss window --

    def add_loss(self, loss: float) -> None:
        self.window_loss, self.window_steps = self.window_loss + loss, self.window_steps + 1

    def log_train(self, step: int, **fields) -> dict:
        """Write the mean loss of the window as the ``train`` line of ``step``; reset it."""
        record = {"step": step, "split": "train", "loss": self.window_loss / max(self.window_steps, 1), **fields}
        self.write(record)
        self.window_loss, self.window_steps = 0.0, 0
        return record

    # -- the file --

    def create(self) -> None:
        if self.enabled:
            write_text_atomic(self.path, "")
        self.lines = 0

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record) + "\n"
        half = len(line) // 2
        try:
            with self.path.open("a") as handle:
                handle.write(line[:half])
                handle.flush()
                crash_points.reached("metrics:partial")
                handle.write(line[half:])
        except OSError as error:
            raise write_failure(self.path, error) from None
        self.lines += 1
        crash_points.reached("metrics:written")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def state(self) -> dict:
        """What a checkpoint stores to restore this log exactly."""
        return {"metrics_lines": self.lines, "window_loss": self.window_loss, "window_steps": self.window_steps}

    def restore(self, state: dict, step: int) -> None:
        """Cut the file back to the lines it held at the checkpoint (``state``) and restore
        the window. Checkpoints from before this log kept no line count: keep the
        non-final lines up to ``step``."""
        self.window_loss, self.window_steps = state.get("window_loss", 0.0), state.get("window_steps", 0)
        if not self.enabled:
            return
        text = self.path.read_text() if self.path.is_file() else ""
        complete = text.split("\n")[:-1]  # a last line without its newline was cut by a kill
        if "metrics_lines" in state:
            kept = complete[: state["metrics_lines"]]
            if len(kept) < state["metrics_lines"]:
                raise ValueError(
                    f"{self.path} holds {len(complete)} lines, fewer than the {state['metrics_lines']} "
                    "its checkpoint was written after: the file was changed outside the trainer"
                )
        else:
            records = [(line, json.loads(line)) for line in complete if line.strip()]
            kept = [line for line, r in records if r["step"] <= step and not r.get("final")]
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self.lines = len(kept)

    # -- the picture --

    def plot(self, title: str) -> Path:
        """``loss.png`` next to the metrics (train and validation loss against step),
        written through a temporary file."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for split, style in (("train", "-"), ("valid", "o-")):
            points = [(r["step"], r["loss"]) for r in records if r["split"] == split]
            if points:
                axis.plot(*zip(*points), style, label=split)
        axis.set_xlabel("step")
        axis.set_ylabel("loss (nats per predicted token)")
        axis.set_title(title)
        axis.legend()
        figure.tight_layout()
        path = self.path.with_name("loss.png")
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            figure.savefig(temporary, dpi=100, format="png")
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise write_failure(path, error) from None
        finally:
            plt.close(figure)
        return path
