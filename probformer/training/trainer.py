"""The trainer: ``probformer train --config configs/<name>.toml [--out runs/<name>] [--resume]``.

One loop for every model kind (PT, Particle Transformer, BERT-style / Universal
Transformer baselines) and both tasks (MLM, UPOS tagging):

- AdamW on ``probformer.mup.param_groups`` (μP multipliers for a μP PT, standard
  groups otherwise), linear warm-up then linear/cosine decay or constant, gradient-norm
  clipping, optional bf16 autocast;
- a tqdm progress bar (loss, tokens/s, ETA), metrics as JSONL, a loss-curve PNG;
- checkpoints every ``checkpoint_every`` steps: a complete directory
  ``checkpoints/step-NNNNNNN`` (weights, optimizer state and RNG state as safetensors,
  counters as JSON) is written under a temporary name and renamed, then the
  ``checkpoints/latest`` pointer is replaced atomically: a SIGKILL at any moment
  leaves the last complete checkpoint loadable. Randomness (dropout, masking, data
  order) is a function of (seed, step, epoch), so ``--resume`` reproduces the
  uninterrupted run bit for bit on CPU;
- data parallel under ``torchrun`` (gloo on CPU, nccl on CUDA): every process draws
  the same global batch and masks, keeps its rows, and the loss is normalised by the
  global count of predicted tokens, so the loss curve equals one process's.

Every input is validated (config, data files, lengths, vocabulary) before the
output folder is created or a step is taken.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from probformer import mup
from probformer.training import checkpoint, run_config
from probformer.training.corpus import IGNORE, collate, epoch_order, inputs_and_targets, prepare_corpus
from probformer.training.run_config import RunConfig

__all__ = ["Trainer", "train", "latest_checkpoint", "evaluate_model"]

_RESUMABLE_CHANGES = {"steps", "epochs", "threads", "log_every", "eval_every", "checkpoint_every"}


# ---- evaluation ---------------------------------------------------------------------


@torch.no_grad()
def evaluate_model(model, examples, task: str, vocab_size: int, mask_rate: float = 0.15, batch_size: int = 64) -> dict:
    """Validation loss and perplexity (mlm, masked tokens, fixed masks) or accuracy (pos)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(313)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    total, count, correct = 0.0, 0, 0
    for start in range(0, len(order), batch_size):
        tokens, mask, labels = collate([examples[i] for i in order[start : start + batch_size]])
        inputs, targets = inputs_and_targets(task, tokens, mask, labels, vocab_size, mask_rate, generator)
        logits, _ = model(inputs, mask)
        total += F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="sum").item()
        picked = targets != IGNORE
        count += int(picked.sum())
        correct += int((logits.argmax(-1)[picked] == targets[picked]).sum())
    model.train(was_training)
    loss = total / max(count, 1)
    result = {"loss": loss, "tokens": count}
    if task == "pos":
        result["accuracy"] = correct / max(count, 1)
    else:
        result["perplexity"] = math.exp(min(loss, 700.0))
    return result


# ---- checkpoints ----------------------------------------------------------------------


def latest_checkpoint(run_dir) -> Path:
    """The newest complete checkpoint of a run folder (via ``checkpoints/latest``)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({pointer} is missing)")
    path = pointer.parent / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist")
    return path


def _write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def _optimizer_state(optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """AdamW's state as flat tensors (for safetensors; nothing pickled) and its groups."""
    state = optimizer.state_dict()
    tensors = {
        f"optimizer.{index}.{key}": value.detach().contiguous().cpu()
        for index, slots in state["state"].items()
        for key, value in slots.items()
    }
    return tensors, state["param_groups"]


def _load_optimizer_state(optimizer, tensors: dict, groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for group in groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- the trainer -------------------------------------------------------------------------


class Trainer:
    def __init__(self, config: RunConfig, out, resume: bool = False, progress: bool = True):
        self.config, self.out, self.resume = config, Path(out), resume
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self._init_distributed()
        self.progress = progress and self.rank == 0  # bar and messages
        torch.set_num_threads(config.train.threads or _default_threads(self.world))

        # everything that can be wrong is checked before the output folder exists
        if resume:
            self.resume_from = latest_checkpoint(self.out)
            self._check_resumable(json.loads((self.out / "run.json").read_text()))
        self.corpus = prepare_corpus(config.data)
        if resume:  # the data must encode exactly as it did for the checkpoint
            _, saved_vocabulary = checkpoint.load(self.resume_from)
            saved_tags = json.loads((self.resume_from / "training.json").read_text()).get("tags")
            if list(self.corpus.vocabulary.words) != list(saved_vocabulary.words) or self.corpus.tags != saved_tags:
                raise ValueError(
                    f"vocabulary mismatch between checkpoint {self.resume_from} ({len(saved_vocabulary)} words, "
                    f"tags {saved_tags}) and data.source {config.data.source!r} ({len(self.corpus.vocabulary)} "
                    f"words, tags {self.corpus.tags})"
                )
        torch.manual_seed(config.train.seed)
        model_config = config.model_config(len(self.corpus.vocabulary), len(self.corpus.tags or []))
        _, model_cls = checkpoint.MODELS[config.kind]
        self.model = model_cls(model_config)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.groups = mup.param_groups(self.model, config.train.lr, config.train.weight_decay)
        for group in self.groups:
            group["initial_lr"] = group["lr"]
        self.optimizer = torch.optim.AdamW(self.groups)
        self.wrapped = self.model
        if self.world > 1:
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model)
        self.lengths = [len(ids) for ids, _ in self.corpus.train]
        per_epoch = math.ceil(len(self.lengths) / config.train.batch_size)
        if config.train.batch_size < self.world:
            raise ValueError(f"train.batch_size={config.train.batch_size} is smaller than the {self.world} processes")
        self.total_steps = config.train.steps or config.train.epochs * per_epoch
        self.step = self.epoch = self.batch_in_epoch = self.tokens_seen = 0
        self.elapsed = 0.0
        if resume:
            self._restore()
        elif self.rank == 0:
            if (self.out / "checkpoints" / "latest").exists():
                raise FileExistsError(f"{self.out} already holds a run; pass --resume or choose another --out")
            self.out.mkdir(parents=True, exist_ok=True)
            _write_text_atomic(self.out / "run.json", json.dumps(config.to_dict(), indent=1))
            (self.out / "metrics.jsonl").write_text("")

    # -- distributed --

    def _init_distributed(self):
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _all_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
        return value

    # -- state --

    def _check_resumable(self, saved: dict) -> None:
        now = self.config.to_dict()
        changed = [
            f"{table}.{key}"
            for table in ("model", "data", "train")
            for key in set(saved.get(table, {})) | set(now[table])
            if saved.get(table, {}).get(key) != now[table].get(key)
            and not (table == "train" and key in _RESUMABLE_CHANGES)
        ]
        if changed:
            raise ValueError(
                f"--resume with a different config: {sorted(changed)} changed since {self.out / 'run.json'}"
            )

    def save(self) -> Path:
        folder = self.out / "checkpoints"
        name = f"step-{self.step:07d}"
        temporary = folder / f".{name}.tmp-{os.getpid()}"
        if temporary.exists():
            shutil.rmtree(temporary)
        checkpoint.save(self.model, temporary, self.corpus.vocabulary)
        tensors, groups = _optimizer_state(self.optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(temporary / "training.safetensors"))
        counters = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "tokens_seen": self.tokens_seen,
            "elapsed": self.elapsed,
            "param_groups": groups,
            "tags": self.corpus.tags,
        }
        (temporary / "training.json").write_text(json.dumps(counters))
        final = folder / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        _write_text_atomic(folder / "latest", name)
        for old in folder.glob("step-*"):  # keep the newest complete checkpoint only
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _restore(self) -> None:
        source = self.resume_from
        model, _ = checkpoint.load(source)
        self.model.load_state_dict(model.state_dict())
        counters = json.loads((source / "training.json").read_text())
        tensors = load_file(str(source / "training.safetensors"))
        _load_optimizer_state(self.optimizer, tensors, counters["param_groups"])
        torch.set_rng_state(tensors["rng.torch"])
        for key in ("step", "epoch", "batch_in_epoch", "tokens_seen", "elapsed"):
            setattr(self, key, counters[key])
        if self.rank == 0:  # drop metrics logged after the checkpoint (the run was killed)
            path = self.out / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= self.step]
            path.write_text("".join(line + "\n" for line in kept))

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

    def _log(self, record: dict) -> None:
        if self.rank == 0:
            with (self.out / "metrics.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")

    def evaluate(self, limit: int = 0) -> dict:
        examples = self.corpus.valid[:limit] if limit else self.corpus.valid
        task, rate = self.config.data.task, self.config.data.mask_rate
        return evaluate_model(self.model, examples, task, len(self.corpus.vocabulary), rate)

    def train_step(self, examples) -> tuple[float, int]:
        train, task = self.config.train, self.config.data.task
        torch.manual_seed(train.seed * 1_000_003 + self.step)  # dropout: a function of the step
        masks = torch.Generator().manual_seed(train.seed * 7_919 + self.step)
        tokens, mask, labels = collate(examples)
        inputs, targets = inputs_and_targets(
            task, tokens, mask, labels, len(self.corpus.vocabulary), self.config.data.mask_rate, masks
        )
        count = int((targets != IGNORE).sum())
        rows = slice(self.rank, None, self.world)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.lr_factor(self.step)
        self.wrapped.train()
        auxiliary = getattr(self.model, "auxiliary_loss", None)  # ponder cost, span penalty, ...
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=train.bf16):
            logits, output = self.wrapped(inputs[rows], mask[rows])
            extra = auxiliary(output, mask[rows], targets[rows]) if auxiliary else None
        loss_sum = F.cross_entropy(logits.float().transpose(1, 2), targets[rows], reduction="sum")
        # DDP averages gradients over processes: scale so the result is the global mean
        objective = loss_sum * self.world / max(count, 1)
        (objective if extra is None else objective + extra).backward()
        if train.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = self._all_sum(loss_sum.detach().clone())
        return total.item() / max(count, 1), int(mask.sum())

    def run(self) -> dict:
        from tqdm.auto import tqdm

        train = self.config.train
        if self.progress:
            print(
                f"{self.config.kind}: {self.parameters / 1e6:.2f}M parameters; {len(self.corpus.train)} training / "
                f"{len(self.corpus.valid)} validation sentences; vocabulary {len(self.corpus.vocabulary)}; "
                f"{self.total_steps} steps; {self.world} process(es) -> {self.out}",
                flush=True,
            )
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not self.progress, unit="step", dynamic_ncols=True
        )
        started, tokens_at_start = time.perf_counter() - self.elapsed, self.tokens_seen
        window_loss, window_steps, last_eval = 0.0, 0, None
        while self.step < self.total_steps:
            order = epoch_order(self.lengths, train.batch_size, train.seed, self.epoch)
            if self.batch_in_epoch >= len(order):
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            indices = order[self.batch_in_epoch]
            loss, tokens = self.train_step([self.corpus.train[i] for i in indices])
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {self.step}; lower train.lr")
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            self.tokens_seen += tokens
            self.elapsed = time.perf_counter() - started
            window_loss, window_steps = window_loss + loss, window_steps + 1
            speed = (self.tokens_seen - tokens_at_start) / max(self.elapsed, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed:.0f}")
            if self.step % train.log_every == 0 or self.step == self.total_steps:
                self._log(
                    {
                        "step": self.step,
                        "split": "train",
                        "loss": window_loss / window_steps,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        "tokens": self.tokens_seen,
                        "tokens_per_second": speed,
                        "elapsed": self.elapsed,
                    }
                )
                window_loss, window_steps = 0.0, 0
            if (
                self.rank == 0
                and train.eval_every
                and self.step % train.eval_every == 0
                and self.step < self.total_steps
            ):
                last_eval = self.evaluate(train.eval_sentences)
                self._log({"step": self.step, "split": "valid", **last_eval})
                if self.progress:
                    bar.write(f"step {self.step}: validation {_describe(last_eval)}")
                self.plot()
            if self.rank == 0 and (
                (train.checkpoint_every and self.step % train.checkpoint_every == 0) or self.step == self.total_steps
            ):
                self.save()
        bar.close()
        summary = {}
        if self.rank == 0:
            final = self.evaluate()
            self._log({"step": self.step, "split": "valid", "final": True, **final})
            self.plot()
            self.save()
            checkpoint.save(self.model, self.out / "model", self.corpus.vocabulary)
            if self.corpus.tags:
                _write_text_atomic(self.out / "model" / "tags.json", json.dumps(self.corpus.tags))
            summary = {
                "kind": self.config.kind,
                "parameters": self.parameters,
                "steps": self.step,
                "tokens": self.tokens_seen,
                "seconds": self.elapsed,
                "tokens_per_second": self.tokens_seen / max(self.elapsed, 1e-9),
                "valid": final,
            }
            _write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
            if self.progress:
                print(f"validation {_describe(final)}; model in {self.out / 'model'}", flush=True)
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
        return summary

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines() if line]
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for split, style in (("train", "-"), ("valid", "o-")):
            points = [(r["step"], r["loss"]) for r in records if r["split"] == split]
            if points:
                axis.plot(*zip(*points), style, label=split)
        axis.set_xlabel("step")
        axis.set_ylabel("loss (nats per predicted token)")
        axis.set_title(f"{self.config.kind} ({self.parameters / 1e6:.2f}M parameters)")
        axis.legend()
        figure.tight_layout()
        path = self.out / "loss.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path


def _default_threads(world: int) -> int:
    """OMP_NUM_THREADS when set (benchmarks run jobs side by side), else the cores split
    between processes, at most 2: oversubscribed threads have made runs 50x slower."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, min(2, os.cpu_count() or 1) // world)


def _describe(metrics: dict) -> str:
    if "accuracy" in metrics:
        return f"loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}"
    return f"loss {metrics['loss']:.4f}, perplexity {metrics['perplexity']:.2f}"


def train(config: RunConfig | str | Path, out, resume: bool = False, progress: bool = True) -> dict:
    """Train ``config`` (a ``RunConfig`` or a TOML path) into ``out``; the summary."""
    if not isinstance(config, RunConfig):
        config = run_config.load(config)
    return Trainer(config, out, resume=resume, progress=progress).run()
