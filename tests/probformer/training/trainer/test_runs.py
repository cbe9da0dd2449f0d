"""What a training run does: DDP over two processes gives the single process's loss curve,
a text source trains a tokenizer that travels with the checkpoint, the learning-rate
schedule, the epoch order, bf16 autocast, every model kind and task (next-token
prediction needs a causal model), and steps that end the run whatever the epochs say."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probformer.training import checkpoint, run_config
from probformer.training.corpus import epoch_order
from probformer.training.evaluate import evaluate
from probformer.training.trainer import Trainer, train
from tests.builders import TINY_PT_RUN as TINY
from tests.builders import train_losses
from tests.builders import write_tiny_run_config as write_config


@pytest.mark.parametrize("variant", ["plain", "act_aligned"])
def test_ddp_two_processes_give_the_single_process_loss_curve(tmp_path, variant):
    """act_aligned: ACT's ponder cost and the aligned losses are per-token terms too; each
    process's share of the batch has its own token counts, so a mean of the processes' means
    would train another model than one process does (a step later, another loss)."""
    config = write_config(tmp_path, dropout=0.0, steps=6)
    if variant == "act_aligned":
        text = config.read_text().replace("mup = true", 'halting = "act"\nponder_cost = 0.5\naligned_training = true')
        config.write_text(text)
    single = tmp_path / "single"
    train(config, single, progress=False)
    ddp = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517",
               "-m", "probformer", "train", "--config", str(config), "--out", str(ddp)]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    a, b = train_losses(single), train_losses(ddp)
    assert [s for s, _ in a] == [s for s, _ in b]
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5


def test_text_source_trains_a_tokenizer_that_travels_with_the_checkpoint(tmp_path):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n".join(f"sentence number {i} talks about tokenisers" for i in range(120)))
    (corpus / "b.txt").write_text("\n".join(f"another line {i} with unbelievably long words" for i in range(120)))
    (tmp_path / "c.toml").write_text(TINY.format(dropout=0.0, source=corpus, task="mlm", max_length=40, steps=3))
    train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()
    model, vocabulary = checkpoint.load(tmp_path / "run" / "model")
    ids = vocabulary.encode("unbelievably long words".split())
    assert len(ids) >= 3 and all(0 <= i < model.config.vocab_size for i in ids)
    metrics = evaluate(tmp_path / "run", "mlm", str(corpus / "a.txt"))
    assert math.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    # a resumed run encodes with the tokenizer it saved (relearning it may order the pieces
    # differently, which made every text-source resume fail with a vocabulary mismatch)
    (tmp_path / "c.toml").write_text(TINY.format(dropout=0.0, source=corpus, task="mlm", max_length=40, steps=5))
    train(tmp_path / "c.toml", tmp_path / "run", resume=True, progress=False)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 5
    resumed, resumed_vocabulary = checkpoint.load(tmp_path / "run" / "model")
    assert resumed_vocabulary.words == vocabulary.words


def test_learning_rate_schedule(tmp_path):
    trainer = Trainer(run_config.load(write_config(tmp_path, steps=10)), tmp_path / "run", progress=False)
    factors = [trainer.lr_factor(s) for s in range(10)]
    assert factors[:2] == [0.5, 1.0]  # warm-up over 2 steps
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))  # then linear decay
    assert factors[-1] == pytest.approx(1 / 8)
    groups = {g["name"]: g["initial_lr"] for g in trainer.optimizer.param_groups}
    assert groups["hidden"] == groups["input"]  # μP at its own base width: equal learning rates


def test_epoch_order_is_a_deterministic_permutation():
    lengths = [3, 9, 1, 4, 4, 7, 2, 8, 5, 6, 1]
    order = epoch_order(lengths, batch_size=3, seed=1, epoch=2)
    assert sorted(i for batch in order for i in batch) == list(range(len(lengths)))
    assert order == epoch_order(lengths, batch_size=3, seed=1, epoch=2)
    assert order != epoch_order(lengths, batch_size=3, seed=1, epoch=3)


def test_bf16_autocast_trains(tmp_path):
    config = write_config(tmp_path, steps=3)
    config.write_text(config.read_text().replace("threads = 1", "threads = 1\nbf16 = true"))
    summary = train(config, tmp_path / "run", progress=False)
    assert math.isfinite(summary["valid"]["loss"])


@pytest.mark.parametrize("name", ["bert-small", "particle-small"])
def test_other_model_kinds_train(tmp_path, name):
    text = (Path("configs") / f"{name}.toml").read_text()
    text = text.replace("epochs = 1", "steps = 2").replace(
        'source = "ptb"', 'source = "ptb"\ntrain_sentences = 64\nvalid_sentences = 8'
    )
    (tmp_path / "c.toml").write_text(text)
    summary = train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    assert summary["steps"] == 2 and math.isfinite(summary["valid"]["loss"])
    metrics = evaluate(tmp_path / "run", "mlm", sentences=8)
    assert math.isfinite(metrics["perplexity"])


@pytest.mark.parametrize("name", ["swarm-gumbel", "folded-lm"])
def test_swarmformer_and_folded_context_train(tmp_path, name):
    text = (Path("configs/variants") / f"{name}.toml").read_text()
    text = text.replace("epochs = 1", "steps = 2").replace("train_sentences = 8000", "train_sentences = 64")
    (tmp_path / "c.toml").write_text(text.replace("valid_sentences = 500", "valid_sentences = 8"))
    summary = train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    assert summary["steps"] == 2 and math.isfinite(summary["valid"]["perplexity"])
    model, _ = checkpoint.load(tmp_path / "run" / "model")
    assert type(model).__name__ == {"swarm-gumbel": "SwarmFormer", "folded-lm": "FoldedContext"}[name]


def test_lm_targets_are_the_next_real_token():
    from probformer.training.corpus import IGNORE, inputs_and_targets

    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = tokens != 0
    inputs, targets = inputs_and_targets("lm", tokens, mask, None, 20, 0.15, None)
    assert torch.equal(inputs, tokens)
    assert targets.tolist() == [[6, 7, 8, IGNORE], [10, IGNORE, IGNORE, IGNORE]]


@pytest.mark.parametrize("kind,task", [("folded_context", "mlm"), ("transformer", "lm"), ("swarmformer", "lm")])
def test_next_token_prediction_needs_a_causal_model(kind, task):
    with pytest.raises(ValueError, match="causal model"):
        run_config.RunConfig.from_dict({"model": {"kind": kind}, "data": {"task": task}, "train": {}})


def test_steps_end_the_run_whatever_the_epochs_say(tmp_path):
    """A quick run of a config written for epochs (the demo does this): steps win, as documented."""
    config = run_config.load(write_config(tmp_path), ["train.steps=3", "train.epochs=5"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    assert trainer.total_steps == 3
