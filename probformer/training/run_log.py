"""A run's metrics: ``metrics.jsonl`` (one JSON line per logged step and split), the same
records as ``metrics.csv`` (one row per line, a fixed header) and as TensorBoard scalars
(``tensorboard/``, tag ``<split>/<field>``), the window-averaged training loss, and the
loss-curve PNG.

Exact resume needs two things from the log, and a checkpoint stores both
(``state()``): how many complete lines the file held when the checkpoint was written
(on resume the file is cut back to exactly those lines, so a line logged after the
checkpoint, or half a line cut by a kill, is dropped and then logged again, once),
and the training-loss window not yet logged (its sum and step count, so the first
mean logged after a resume averages the same steps as an uninterrupted run). The CSV is
rewritten from the kept JSON lines on resume, so it equals the uninterrupted run's too;
TensorBoard's event files are appended, and the steps after the checkpoint are purged
from its view (``purge_step``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from pathlib import Path

from probformer.training import crash_points
from probformer.training.checkpoint import write_failure
from probformer.training.run_checkpoints import write_text_atomic

__all__ = ["RunLog", "Progress", "WALL_CLOCK_KEYS", "start_messages"]

# fields that measure time, not the run: they differ between any two runs
WALL_CLOCK_KEYS = ("elapsed", "tokens_per_second")


class RunLog:
    """``columns``: the CSV header (every field a record may have); ``None``: no CSV.
    ``tensorboard``: also write TensorBoard event files."""

    def __init__(self, path, enabled: bool = True, columns=None, tensorboard: bool = False):
        self.path, self.enabled = Path(path), enabled  # enabled: rank 0 of a DDP run
        self.csv_path = self.path.with_name("metrics.csv")
        self.tensorboard_path = self.path.with_name("tensorboard")
        self.columns = list(columns) if columns is not None else None
        self.tensorboard = tensorboard
        self._writer, self._purge_step = None, None
        self.lines = 0  # complete lines in the file
        self.window_loss, self.window_steps = 0.0, 0

    # -- the training-loss window --

    def add_loss(self, loss: float) -> None:
        self.window_loss, self.window_steps = self.window_loss + loss, self.window_steps + 1

    def log_train(self, step: int, **fields) -> dict:
        """Write the mean loss of the window as the ``train`` line of ``step``; reset it. A
        window whose steps had no target token has no loss: NaN, not 0."""
        loss = self.window_loss / self.window_steps if self.window_steps else math.nan
        record = {"step": step, "split": "train", "loss": loss, **fields}
        self.write(record)
        self.window_loss, self.window_steps = 0.0, 0
        return record

    # -- the file --

    def create(self) -> None:
        if self.enabled:
            write_text_atomic(self.path, "")
            self._rewrite_csv([])
        self.lines = 0
        self._purge_step = 0  # a run started again in place: hide a killed attempt's events

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
        self._append_csv(record)
        self.lines += 1
        self._add_scalars(record)
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
        self._rewrite_csv([json.loads(line) for line in kept if line.strip()])
        self._purge_step = step + 1  # TensorBoard hides what was logged after the checkpoint

    # -- the CSV --

    def _csv_text(self, records: list[dict], header: bool) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns, lineterminator="\n")
        if header:
            writer.writeheader()
        for record in records:
            unknown = sorted(set(record) - set(self.columns))
            if unknown:
                raise ValueError(f"metrics fields {unknown} have no column in {self.csv_path}")
            # floats as repr (exact); a bool as 0/1; a missing field is an empty cell
            writer.writerow({k: int(v) if isinstance(v, bool) else v for k, v in record.items()})
        return buffer.getvalue()

    def _rewrite_csv(self, records: list[dict]) -> None:
        if self.columns is not None:
            write_text_atomic(self.csv_path, self._csv_text(records, header=True))

    def _append_csv(self, record: dict) -> None:
        if self.columns is None:
            return
        try:
            with self.csv_path.open("a") as handle:
                handle.write(self._csv_text([record], header=False))
        except OSError as error:
            raise write_failure(self.csv_path, error) from None

    # -- TensorBoard --

    def _add_scalars(self, record: dict) -> None:
        if not self.tensorboard:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.tensorboard_path), purge_step=self._purge_step, flush_secs=10)
        for key, value in record.items():
            if key not in ("step", "split", "final") and isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        """Flush and close the TensorBoard writer (the JSON lines and the CSV are always complete)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

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


class Progress:
    """What a run shows while it trains: a tqdm bar (loss, tokens/s, ETA) when stderr is a
    terminal; otherwise (a log file, CI) one plain line on stderr every ``every`` logged
    training lines and at the last step, so a redirected log is not flooded."""

    def __init__(self, total: int, initial: int, enabled: bool, every: int = 10, stream=None):
        self.total, self.enabled, self.every = total, enabled, every
        self.stream = sys.stderr if stream is None else stream
        self.logged = 0
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=self.stream)

    def step(self, loss: float, tokens_per_second: float | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            speed = {} if tokens_per_second is None else {"tok_s": f"{tokens_per_second:.0f}"}
            self.bar.set_postfix(loss=f"{loss:.3f}", **speed)

    def train_line(self, record: dict) -> None:
        """A logged training record: without a bar, every ``every``-th one is printed."""
        if not self.enabled or self.bar is not None:
            return
        self.logged += 1
        if self.logged % self.every == 0 or record["step"] == self.total:
            speed = record.get("tokens_per_second")
            text = f"step {record['step']}/{self.total}: loss {record['loss']:.4f}"
            text += f", grad norm {record['grad_norm']:.3g}" if "grad_norm" in record else ""
            text += f", {speed:.0f} tokens/s" if speed is not None else ""
            print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def start_messages(trainer) -> list[str]:
    """What a run prints as it starts: its size, and what it cut or will not reach."""
    corpus, total = trainer.corpus, trainer.total_steps
    # a sentence cut into windows is several examples, and train.eval_sentences counts them
    counted = "examples (a cut sentence counts each window)" if any(corpus.windowed.values()) else "sentences"
    lines = [
        f"{trainer.config.kind}: {trainer.parameters / 1e6:.2f}M parameters; {len(corpus.train)} training / "
        f"{len(corpus.valid)} validation {counted}; vocabulary {len(corpus.vocabulary)}; {total} steps; "
        f"{trainer.world} process(es){'; freed memory held' if trainer.holds_freed_memory else ''} -> {trainer.out}"
    ]
    if any(corpus.windowed.values()):
        cut = ", ".join(f"{count} {split}" for split, count in corpus.windowed.items() if count)
        lines.append(f"sentences longer than data.max_length, cut into windows: {cut}")
    warmup = trainer.config.train.warmup_steps
    if warmup > total:  # a smoke run may mean it; a real one would not
        lines.append(
            f"note: train.warmup_steps = {warmup} is more than the run's {total} steps: the learning rate "
            f"rises to {total / warmup:.0%} of train.lr and never decays"
        )
    return lines
