"""The trainer: ``probformer train --config configs/<name>.toml [--out runs/<name>] [--resume]``.

One loop for every model kind (PT, Particle Transformer, BERT-style / Universal
Transformer baselines) and both tasks (MLM, UPOS tagging):

- AdamW on ``probformer.mup.param_groups`` (μP multipliers for a μP PT, standard
  groups otherwise), linear warm-up then linear/cosine decay or constant, gradient-norm
  clipping, optional bf16 autocast;
- one device for the model, its optimiser state and every batch (``train.device``: "auto"
  is CUDA when present, else the CPU); bf16 autocast is always on on CUDA. Checkpoints
  hold CPU tensors, so a run resumes on either device;
- a tqdm progress bar (loss, tokens/s, ETA) on a terminal, else a plain line every 10
  logged steps; metrics (loss, learning rate per parameter group, gradient norm before
  clipping, tokens/s, and every ``diagnostics_every`` steps the PT's and the Particle
  Transformer's per-layer ESS and diversity on a fixed probe batch) as JSONL, CSV and
  TensorBoard scalars (``run_log``), a loss-curve PNG;
- checkpoints every ``checkpoint_every`` steps and after the last (``run_checkpoints``:
  a SIGKILL at any instant leaves the last complete checkpoint loadable); metrics,
  the loss window and the loss curve in ``run_log``. Randomness (dropout, masking,
  data order) is a function of (seed, step, epoch), so ``--resume`` reproduces the
  uninterrupted run's weights and metrics bit for bit on CPU;
- a non-finite loss or gradient stops the run before the optimiser step, naming the
  step; the last checkpoint (always finite weights) stays the resume point;
- data parallel under ``torchrun`` (gloo on CPU, nccl on CUDA): every process draws
  the same global batch and masks, keeps its rows, and the loss (the model's auxiliary
  loss too) is normalised by the global counts, so the loss curve equals one process's.

Every input is validated (config, data files, lengths, vocabulary; for ``--resume``
the run folder, the saved config and the data's encoding, in ``resume``) before the
output folder is created or a step is taken. The validation metrics are
``validation.evaluate_model``'s.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probformer.diagnostics.probe import layer_metrics
from probformer.models import registry
from probformer.models.mup_parametrization import param_groups
from probformer.training import checkpoint, crash_points, placement, run_checkpoints, run_config
from probformer.training.corpus import IGNORE, collate, epoch_order, inputs_and_targets, prepare_corpus
from probformer.training.data import SubwordVocabulary
from probformer.training.early_stopping import EarlyStopping
from probformer.training.resume import check_same_encoding, resume_source, saved_fingerprint, text_fingerprint
from probformer.training.run_checkpoints import latest_checkpoint
from probformer.training.run_config import RunConfig
from probformer.training.run_log import Progress, RunLog, start_messages
from probformer.training.validation import describe, evaluate_model, refuse_validations_without_targets

__all__ = ["Trainer", "train", "latest_checkpoint", "evaluate_model"]

# the kinds whose per-layer ESS and diversity the metrics carry, and the probe batch's size
DIAGNOSED_KINDS = ("probabilistic_transformer", "particle_transformer")
PROBE_SENTENCES = 8
PROGRESS_EVERY = 10  # logged training lines between plain progress lines (no terminal)
COUNTERS = ("step", "epoch", "batch_in_epoch", "tokens_seen", "elapsed")  # where a checkpoint resumes


class Trainer:
    def __init__(self, config: RunConfig, out, resume: bool = False, progress: bool = True):
        self.config, self.out, self.resume = config, Path(out), resume
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.rank, self.world = placement.init_distributed(config.train.device)
        self.progress = progress and self.rank == 0  # bar and messages
        torch.set_num_threads(config.train.threads or placement.default_threads(self.world))

        # everything that can be wrong is checked before the output folder exists
        self.resume_from = resume_source(self.out, config) if resume else None
        saved_vocabulary = checkpoint.load(self.resume_from)[1] if self.resume_from else None
        self.data_sha256 = text_fingerprint(config.data.source)
        same_text = self.resume_from and self.data_sha256 == saved_fingerprint(self.out)
        if isinstance(saved_vocabulary, SubwordVocabulary) and same_text:
            # relearning a subword vocabulary from the same text need not give the same
            # pieces: a resumed run on unchanged text encodes with the one it saved
            self.corpus = prepare_corpus(config.data, vocabulary=saved_vocabulary)
        else:
            self.corpus = prepare_corpus(config.data)
        if self.resume_from:
            check_same_encoding(self.resume_from, self.corpus, saved_vocabulary, config.data.source)
        self._check_batches_and_validations()
        torch.manual_seed(config.train.seed)
        model_config = config.model_config(len(self.corpus.vocabulary), len(self.corpus.tags or []))
        _, model_cls = registry.classes(config.kind)
        self.device = placement.resolve_device(config.train.device)
        self.holds_freed_memory = (
            self.device.type == "cpu" and config.train.hold_freed_memory and placement.hold_freed_memory()
        )
        self.model = model_cls(model_config).to(self.device)  # before the optimiser: its state follows
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.groups = param_groups(self.model, config.train.lr, config.train.weight_decay)
        for group in self.groups:
            group["initial_lr"] = group["lr"]
        self.optimizer = torch.optim.AdamW(self.groups)
        self.wrapped = self.model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.lengths = [len(ids) for ids, _ in self.corpus.train]
        per_epoch = math.ceil(len(self.lengths) / config.train.batch_size)
        self.total_steps = config.train.steps or config.train.epochs * per_epoch
        self.step = self.epoch = self.batch_in_epoch = self.tokens_seen = 0
        self.elapsed = 0.0
        self.early_stopping = EarlyStopping(config.train.patience)
        self.probe = self._probe_batch()
        self.log = RunLog(
            self.out / "metrics.jsonl", enabled=self.rank == 0, columns=self._columns(), tensorboard=self.rank == 0
        )
        if resume:
            self._restore()
        elif self.rank == 0:
            if (self.out / "checkpoints" / "latest").exists():
                raise FileExistsError(f"{self.out} already holds a run; pass --resume or choose another --out")
            self._create_run_folder()

    def _check_batches_and_validations(self) -> None:
        """Each process trains on its own rows of every batch, the last included; every
        validation scores at least one target token."""
        batch_size, sentences = self.config.train.batch_size, len(self.corpus.train)
        if batch_size < self.world:
            raise ValueError(f"train.batch_size={batch_size} is smaller than the {self.world} processes")
        if 0 < sentences % batch_size < self.world:
            raise ValueError(
                f"an epoch's last batch has {sentences % batch_size} sentence(s) ({sentences} sentences, "
                f"train.batch_size={batch_size}), fewer than the {self.world} processes: change train.batch_size"
            )
        refuse_validations_without_targets(self.corpus, self.config)

    # -- what is logged --

    def _probe_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fixed sentences the per-layer diagnostics are measured on (the first
        validation sentences, else the first training ones); ``None``: no diagnostics."""
        if self.rank != 0 or not self.config.train.diagnostics_every or self.config.kind not in DIAGNOSED_KINDS:
            return None
        examples = (self.corpus.valid or self.corpus.train)[:PROBE_SENTENCES]
        tokens, mask, _ = collate(examples)
        return tokens.to(self.device), mask.to(self.device)

    def _columns(self) -> list[str]:
        """Every field a metrics record can have, in the CSV's order."""
        quality = "accuracy" if self.config.data.task == "pos" else "perplexity"
        groups = [f"lr/{group['name']}" for group in self.optimizer.param_groups]
        self.probe_fields = list(layer_metrics(self.model, *self.probe)) if self.probe else []
        return [
            "step", "split", "final", "loss", quality, "tokens", "lr", *groups, "grad_norm",
            "tokens_per_second", "elapsed", *self.probe_fields,
        ]  # fmt: skip

    def _train_fields(self, grad_norm: float, window_tokens: int, window_seconds: float) -> dict:
        """A logged training line's fields besides step and loss; group rates from the schedule."""
        train = self.config.train
        fields = {
            "tokens": self.tokens_seen,
            "lr": train.lr * self.lr_factor(self.step - 1),  # the schedule's base rate at this step
            **{f"lr/{g['name']}": g["initial_lr"] * self.lr_factor(self.step - 1) for g in self.optimizer.param_groups},
            "grad_norm": grad_norm,
            "tokens_per_second": window_tokens / max(window_seconds, 1e-9),
            "elapsed": self.elapsed,
        }
        due = train.diagnostics_every and (self.step % train.diagnostics_every == 0 or self.step == self.total_steps)
        if self.probe is not None and due:
            fields |= layer_metrics(self.model, *self.probe, names=self.probe_fields)
        return fields

    # -- the run folder --

    def _create_run_folder(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise checkpoint.write_failure(self.out, error) from None
        record = {**self.config.to_dict(), "data_sha256": self.data_sha256}
        run_checkpoints.write_text_atomic(self.out / "run.json", json.dumps(record, indent=1))
        self.log.create()

    # -- state --

    def save(self) -> Path:
        counters = {
            **{key: getattr(self, key) for key in COUNTERS},
            "tags": self.corpus.tags,
            "early_stopping": self.early_stopping.state(),
            **self.log.state(),
        }
        return run_checkpoints.save_training_checkpoint(
            self.out, self.step, self.model, self.optimizer, self.corpus.vocabulary, counters
        )

    def _restore(self) -> None:
        if self.rank == 0:
            run_checkpoints.remove_stale_temporaries(self.out)
        if self.resume_from is None:  # killed before the first checkpoint: start again, in place
            if self.rank == 0:
                self._create_run_folder()
            return
        counters = run_checkpoints.restore_training_checkpoint(self.resume_from, self.model, self.optimizer)
        for key in COUNTERS:
            setattr(self, key, counters[key])
        self.early_stopping.restore(counters.get("early_stopping", {}))
        self.log.restore(counters, self.step)  # drop what was logged after the checkpoint
        if self.progress:
            print(f"resuming from step {self.step} ({self.resume_from})", flush=True)

    # -- the loop --

    def lr_factor(self, step: int) -> float:
        train = self.config.train
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        if train.schedule == "constant":
            return 1.0
        progress = (step - train.warmup_steps) / max(1, self.total_steps - train.warmup_steps)
        if train.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return max(0.0, 1.0 - progress)

    def evaluate(self, limit: int = 0) -> dict:
        examples = self.corpus.valid[:limit] if limit else self.corpus.valid
        task, rate = self.config.data.task, self.config.data.mask_rate
        return evaluate_model(self.model, examples, task, len(self.corpus.vocabulary), rate)

    def train_step(self, examples) -> tuple[float | None, int, float]:
        """One optimiser step; ``(mean loss, real tokens, gradient norm before clipping)``.
        A non-finite loss or gradient norm raises ``FloatingPointError`` before the step, so
        the weights stay good. Both are read in the one host synchronisation the step always
        had (the logged loss). A batch with no target token (no position masked) trains
        nothing: no step, and the loss is None (no measurement, not 0)."""
        train, task = self.config.train, self.config.data.task
        torch.manual_seed(train.seed * 1_000_003 + self.step)  # dropout: a function of the step
        masks = torch.Generator().manual_seed(train.seed * 7_919 + self.step)
        tokens, mask, labels = collate(examples)
        inputs, targets = inputs_and_targets(
            task, tokens, mask, labels, len(self.corpus.vocabulary), self.config.data.mask_rate, masks
        )
        count, real_tokens = int((targets != IGNORE).sum()), int(mask.sum())  # on the CPU: no device read
        if count == 0:  # the count is the whole batch's: every process skips alike
            return None, real_tokens, math.nan
        inputs, mask, targets = (t.to(self.device, non_blocking=True) for t in (inputs, mask, targets))
        rows = slice(self.rank, None, self.world)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.lr_factor(self.step)
        self.wrapped.train()
        auxiliary = getattr(self.model, "auxiliary_loss", None)  # ponder cost, span penalty, ...
        bf16 = train.bf16 or self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, output = self.wrapped(inputs[rows], mask[rows])
            shares = (real_tokens / self.world, count / self.world)  # the whole batch's counts, shared out
            extra = auxiliary(output, mask[rows], targets[rows], *shares) if auxiliary else None
        loss_sum = F.cross_entropy(logits.float().transpose(1, 2), targets[rows], reduction="sum")
        # DDP averages gradients over processes: scale so the result is the global mean
        objective = loss_sum * self.world / max(count, 1)
        (objective if extra is None else objective + extra).backward()
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if train.clip:
            norm = torch.nn.utils.clip_grad_norm_(parameters, train.clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        total = placement.all_sum(loss_sum.detach().clone(), self.world)
        loss_total, grad_norm = torch.stack([total, norm.to(total)]).tolist()
        loss = loss_total / max(count, 1)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(self._non_finite_message(loss, grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, real_tokens, grad_norm

    def _non_finite_message(self, loss: float, grad_norm: float) -> str:
        pointer = self.out / "checkpoints" / "latest"
        kept = (
            f"the last good checkpoint, {pointer.parent / pointer.read_text().strip()}, is kept (--resume continues "
            "from it)"
            if self.rank == 0 and pointer.is_file()
            else "no checkpoint was written yet"
        )
        return (
            f"training stopped at step {self.step + 1}: the loss is {loss} and the gradient norm {grad_norm} "
            f"(not finite); the weights were not updated and {kept}; lower train.lr or check the data"
        )

    def run(self) -> dict:
        if self.progress:
            for line in start_messages(self):
                print(line, flush=True)
        progress = Progress(self.total_steps, self.step, self.progress, every=PROGRESS_EVERY)
        try:
            summary = self._loop(progress)
        finally:
            progress.close()
            self.log.close()
        placement.barrier(self.world)
        return summary

    def _loop(self, progress: Progress) -> dict:
        train = self.config.train
        started = time.perf_counter() - self.elapsed
        # tokens/s over each logging window, timing the training steps only (not validation or saves)
        window_tokens, window_seconds, speed = 0, 0.0, None
        while self.step < self.total_steps and not self.early_stopping.stop:
            order = epoch_order(self.lengths, train.batch_size, train.seed, self.epoch)
            if self.batch_in_epoch >= len(order):
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            indices = order[self.batch_in_epoch]
            step_started = time.perf_counter()
            loss, tokens, grad_norm = self.train_step([self.corpus.train[i] for i in indices])
            window_seconds += time.perf_counter() - step_started  # train_step ends in a host sync
            crash_points.reached("step")
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            self.tokens_seen += tokens
            window_tokens += tokens
            self.elapsed = time.perf_counter() - started
            if loss is not None:
                self.log.add_loss(loss)
            progress.step(math.nan if loss is None else loss, speed)
            diagnostics_due = train.diagnostics_every and self.step % train.diagnostics_every == 0
            if self.step % train.log_every == 0 or self.step == self.total_steps or diagnostics_due:
                record = self.log.log_train(self.step, **self._train_fields(grad_norm, window_tokens, window_seconds))
                speed = record["tokens_per_second"]
                window_tokens, window_seconds = 0, 0.0
                progress.train_line(record)
            if (
                self.rank == 0
                and train.eval_every
                and self.step % train.eval_every == 0
                and self.step < self.total_steps
            ):
                metrics = self.evaluate(train.eval_sentences)
                self.log.write({"step": self.step, "split": "valid", **metrics})
                progress.message(f"step {self.step}: validation {describe(metrics)}")
                self.plot()
                self.early_stopping.update(metrics["loss"], self.step)
                if self.early_stopping.best_step == self.step:  # a new best: its model kept apart from the last
                    self._save_model("best")
                    crash_points.reached("best:model")
            if train.patience and train.eval_every and self.step % train.eval_every == 0:
                self.early_stopping.share(self.rank, self.world, self.device)  # only rank 0 validates
                if self.early_stopping.stop:
                    progress.message(f"step {self.step}: {self.early_stopping.describe()}")
            last = self.step == self.total_steps or self.early_stopping.stop
            if self.rank == 0 and ((train.checkpoint_every and self.step % train.checkpoint_every == 0) or last):
                self.save()
        return self._finish() if self.rank == 0 else {}

    def _finish(self) -> dict:
        """After the last step (whose checkpoint is written): the final validation line,
        the model folder, the summary. No second checkpoint: the final line is not part
        of any checkpoint, so a resume after a kill here logs it again exactly once."""
        final = self.evaluate()
        self.log.write({"step": self.step, "split": "valid", "final": True, **final})
        crash_points.reached("final:logged")
        self.plot()
        self._save_model("model")
        crash_points.reached("final:model")
        train = self.config.train  # the last step's validation is the final one: a best too, on the same sentences
        same_sentences = not train.eval_sentences or train.eval_sentences >= len(self.corpus.valid)
        if train.eval_every and same_sentences and final["loss"] < self.early_stopping.best_loss:
            self._save_model("best")
        summary = {
            "kind": self.config.kind,
            "parameters": self.parameters,
            "steps": self.step,
            "tokens": self.tokens_seen,
            "seconds": self.elapsed,
            "tokens_per_second": self.tokens_seen / max(self.elapsed, 1e-9),
            "windowed_sentences": dict(self.corpus.windowed),  # cut into max_length windows, per split
            "valid": final,
            "stopped_early": self.early_stopping.stop,
            "best_periodic_valid": {"loss": self.early_stopping.best_loss, "step": self.early_stopping.best_step}
            if self.config.train.patience
            else None,
        }
        run_checkpoints.write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
        if self.progress:
            print(f"validation {describe(final)}; model in {self.out / 'model'}", flush=True)
        return summary

    def _save_model(self, name: str) -> None:  # model/ (the last step's) or best/
        run_checkpoints.save_model_folder(self.out, self.model, self.corpus.vocabulary, self.corpus.tags, name)

    def plot(self) -> Path:
        return self.log.plot(f"{self.config.kind} ({self.parameters / 1e6:.2f}M parameters)")


def train(config: RunConfig | str | Path, out, resume: bool = False, progress: bool = True) -> dict:
    """Train ``config`` (a ``RunConfig`` or a TOML path) into ``out``; the summary."""
    if not isinstance(config, RunConfig):
        config = run_config.load(config)
    return Trainer(config, out, resume=resume, progress=progress).run()
