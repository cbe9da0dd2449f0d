"""The trainer end to end: exact resume after SIGKILL, DDP == one process, bad input
caught before anything is written, tasks and data sources, evaluate."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import checkpoint, run_config
from probformer.training.corpus import epoch_order
from probformer.training.evaluate import evaluate
from probformer.training.trainer import Trainer, latest_checkpoint, train
from tests.builders import TINY_PT_RUN as TINY
from tests.builders import train_losses
from tests.builders import write_tiny_run_config as write_config


def cli(*args, env=None, **kwargs):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "probformer", *args], env=environment, **kwargs)


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    """A longer CLI run killed after its fourth checkpoint; make test covers the same path in
    tests/probformer/training/test_resume.py (every named crash point, and a CLI kill at a random time)."""
    config = write_config(tmp_path, steps=40)
    full = tmp_path / "full"
    train(config, full, progress=False)
    killed = tmp_path / "killed"
    process = cli(
        "train", "--config", str(config), "--out", str(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    pointer = killed / "checkpoints" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and not (pointer.is_file() and pointer.read_text() >= "step-0000004"):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert pointer.is_file(), "no checkpoint was written before the kill"
    assert not (killed / "summary.json").exists(), "the run finished before the kill: nothing was tested"
    model, vocabulary = checkpoint.load(latest_checkpoint(killed))  # whatever moment: loadable
    assert vocabulary is not None
    resumed = cli("train", "--config", str(config), "--out", str(killed), "--resume", stderr=subprocess.PIPE)
    _, error = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, error.decode()[-2000:]
    assert train_losses(killed) == train_losses(full)  # bit-identical, every step
    summary_full = json.loads((full / "summary.json").read_text())
    summary_killed = json.loads((killed / "summary.json").read_text())
    assert summary_full["valid"] == summary_killed["valid"]


def test_resume_refuses_a_changed_config(tmp_path):
    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    changed = write_config(tmp_path, name="changed.toml", dropout=0.2, steps=4)
    with pytest.raises(ValueError, match="model.dropout"):
        Trainer(run_config.load(changed), tmp_path / "run", resume=True)
    longer = write_config(tmp_path, name="longer.toml", steps=4)  # more steps is allowed
    summary = train(longer, tmp_path / "run", resume=True, progress=False)
    assert summary["steps"] == 4
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(run_config.load(longer), tmp_path / "run")


def test_resume_of_a_run_from_before_a_config_key_existed(tmp_path):
    """A run.json written before a key was added (so without it) resumes when the key is at
    its default, and is refused when the key is set to something else."""
    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["data"].pop("long_sentences") == "error"  # as if written before data.long_sentences
    (tmp_path / "run" / "run.json").write_text(json.dumps(saved))
    longer = write_config(tmp_path, name="longer.toml", steps=3)
    assert train(longer, tmp_path / "run", resume=True, progress=False)["steps"] == 3
    (tmp_path / "run" / "run.json").write_text(json.dumps(saved))
    (tmp_path / "other.toml").write_text(longer.read_text().replace("[data]", '[data]\nlong_sentences = "windows"'))
    with pytest.raises(ValueError, match="data.long_sentences"):
        Trainer(run_config.load(tmp_path / "other.toml"), tmp_path / "run", resume=True)


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


@pytest.mark.parametrize(
    "mutate,error",
    [
        (lambda t: t.replace('kind = "probabilistic_transformer"', 'kind = "lstm"'), "model.kind"),
        (lambda t: t.replace("labels = 16", 'labels = "16"'), "model.labels"),
        (lambda t: t.replace("batch_size = 8", "batch_size = 8\nbatch = 3"), "train.batch"),
        (lambda t: t.replace("lr = 3e-3", "lr = -1.0"), "train.lr"),
        (lambda t: t.replace("lr = 3e-3", "lr = true"), "train.lr"),
        (lambda t: t.replace("max_length = 90", "max_length = 5"), "longer than data.max_length"),
        (lambda t: t.replace('source = "ptb"', 'source = "/no/such/file.txt"'), "does not exist"),
        (lambda t: t.replace('task = "mlm"', 'task = "pos"'), "data.source"),
        (lambda t: t.replace("[data]", "[data]\nvocab_size = 3"), "data.vocab_size"),
        (lambda t: t.replace("iterations = 2", "iterations = 2\nvocab_size = 9"), "set from the data"),
        (lambda t: t + "\n[extra]\n", "unknown config tables"),
        (lambda t: t.replace("[model]", "[model"), "not valid TOML"),
    ],
)
def test_bad_input_is_caught_before_anything_is_written(tmp_path, mutate, error):
    config = tmp_path / "bad.toml"
    config.write_text(mutate(TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=2)))
    out = tmp_path / "out"
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=error):
        train(config, out, progress=False)
    assert not out.exists()


def test_empty_and_malformed_data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    text = TINY.format(dropout=0.1, source=empty, task="mlm", max_length=90, steps=2)
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ValueError, match="no text"):
        train(tmp_path / "c.toml", tmp_path / "out", progress=False)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "c.toml").write_text(text.replace(str(empty), str(binary)))
    with pytest.raises(ValueError, match="not UTF-8"):
        train(tmp_path / "c.toml", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_vocabulary_mismatch_on_resume(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the cat number {i} sat on mat {i % 7}" for i in range(200)))
    config = TINY.format(dropout=0.1, source=corpus, task="mlm", max_length=40, steps=2)
    (tmp_path / "c.toml").write_text(config)
    train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    corpus.write_text("\n".join(f"a dog called {i} ran past house {i % 5} quickly" for i in range(200)))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        Trainer(run_config.load(tmp_path / "c.toml"), tmp_path / "run", resume=True)


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


# ---- sizes and values refused by the run config, before any folder -------------------------


NOT_FINITE = "must be a finite number with |value| <= 1e+06 (the limit)"  # ConfigMixin's check, first


@pytest.mark.parametrize(
    "table,key,value,limit",
    [
        ("train", "lr", math.inf, NOT_FINITE),
        ("train", "lr", math.nan, NOT_FINITE),
        ("train", "lr", -1e-3, "must be a finite number in (0, 10]"),
        ("train", "lr", 0, "must be a finite number in (0, 10]"),
        ("train", "lr", 100.0, "must be a finite number in (0, 10]"),
        ("train", "weight_decay", math.nan, NOT_FINITE),
        ("train", "clip", math.inf, NOT_FINITE),
        ("train", "batch_size", 10**5, "must be an integer in [1, 65,536]"),
        ("train", "batch_size", 0, "must be an integer in [1, 65,536]"),
        ("train", "steps", 10**12, "must be an integer in [0, 100,000,000]"),
        ("train", "epochs", 10**6, "must be an integer in [1, 100,000]"),
        ("train", "threads", 2_000, "must be an integer in [0, 1,024]"),
        ("train", "seed", 2**40, "must be an integer in [0, 4,294,967,295]"),
        ("train", "seed", -1, "must be an integer in [0, 4,294,967,295]"),
        ("train", "log_every", 0, "must be an integer in [1, 100,000,000]"),
        ("data", "max_length", 10**5, "must be an integer in [1, 16,384]"),
        ("data", "vocabulary", 2 * 10**6, "must be an integer in [4, 1,000,000]"),
        ("data", "mask_rate", math.nan, NOT_FINITE),
        ("data", "mask_rate", 1.5, "must lie in (0, 1)"),
        ("model", "labels", 10**6, "must be <= 65536 (the limit)"),
    ],
)
def test_absurd_values_are_refused_naming_the_key_and_the_limit(table, key, value, limit):
    values = {"model": {"kind": "probabilistic_transformer"}, "data": {}, "train": {}}
    values[table][key] = value
    with pytest.raises(ValueError, match=rf"config key '{table}\.{key}' {re.escape(limit)}, got"):
        run_config.RunConfig.from_dict(values)


@settings(max_examples=50, deadline=None)
@given(
    kind=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
        lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
        max_leaves=4,
    )
)
def test_model_kind_is_one_of_the_kinds_or_refused_naming_the_key(kind):
    """Oracle: the registry's kind names are the only values; anything else (a list was an
    unhashable-type TypeError) is a ValueError naming 'model.kind'."""
    from probformer.models import registry

    values = {"model": {"kind": kind}, "data": {}, "train": {}}
    if isinstance(kind, str) and kind in registry.KINDS:
        return
    with pytest.raises(ValueError, match=r"config key 'model\.kind' must be one of"):
        run_config.RunConfig.from_dict(values)


def test_a_model_too_large_for_the_data_vocabulary_is_refused_before_allocating():
    # estimated from the config's numbers at the largest vocabulary data.vocabulary allows
    values = {"model": {"kind": "probabilistic_transformer", "labels": 60_000}, "data": {"vocabulary": 10**6}}
    with pytest.raises(ValueError, match=r"parameters, more than the limit 2,147,483,648"):
        run_config.RunConfig.from_dict({**values, "train": {}})


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t.replace("lr = 3e-3", "lr = inf"), f"config key 'train.lr' {NOT_FINITE}, got inf"),
        (lambda t: t.replace("lr = 3e-3", "lr = 50.0"), "config key 'train.lr' must be a finite number in (0, 10]"),
        (
            lambda t: t.replace("labels = 16", "labels = 60000").replace("vocabulary = 400", "vocabulary = 1000000"),
            "more than the limit 2,147,483,648",
        ),
        (lambda t: t.replace("channels = 2", "channels = 0"), "config key 'model.channels'"),
        (
            lambda t: (
                t.replace('kind = "probabilistic_transformer"', 'kind = "transformer"\nmax_length = 16')
                .replace(
                    "labels = 16\nchannels = 2\nrank = 4\niterations = 2",
                    "width = 8\nheads = 2\nlayers = 1\nffn_width = 8",
                )
                .replace("mup = true\n", "")
            ),
            "config key 'model.max_length' (16) is below 'data.max_length' (90)",
        ),
    ],
)
def test_cli_validates_the_whole_config_before_creating_the_run_folder(tmp_path, mutate, message):
    config = tmp_path / "bad.toml"
    config.write_text(mutate(TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=2)))
    out = tmp_path / "X"
    process = cli("train", "--config", str(config), "--out", str(out), stderr=subprocess.PIPE)
    _, error = process.communicate(timeout=120)
    assert process.returncode == 2  # a user error (docs/cli.md)
    assert message in error.decode() and "Traceback" not in error.decode()
    assert not out.exists()


def test_steps_end_the_run_whatever_the_epochs_say(tmp_path):
    """A quick run of a config written for epochs (the demo does this): steps win, as documented."""
    config = run_config.load(write_config(tmp_path), ["train.steps=3", "train.epochs=5"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    assert trainer.total_steps == 3


def test_resume_of_a_missing_run_is_refused_without_creating_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(write_config(tmp_path, steps=2), tmp_path / "nowhere", resume=True, progress=False)
    assert not (tmp_path / "nowhere").exists()


# ---- non-finite numbers stop the run and keep the last good checkpoint ---------------------


def final_weights(run: Path) -> bytes:
    return (run / "model" / "model.safetensors").read_bytes()


def test_a_non_finite_loss_stops_at_its_step_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    config = write_config(tmp_path, steps=6)
    train(config, tmp_path / "full", progress=False)
    trainer = Trainer(run_config.load(config), tmp_path / "run", progress=False)
    forward = trainer.wrapped.forward

    def poisoned(*args, **kwargs):  # the fifth step's logits are NaN
        logits, output = forward(*args, **kwargs)
        return (logits * math.nan if trainer.step == 4 else logits), output

    monkeypatch.setattr(trainer.wrapped, "forward", poisoned)
    with pytest.raises(FloatingPointError, match=r"training stopped at step 5: the loss is nan") as error:
        trainer.run()
    assert "step-0000004, is kept" in str(error.value)
    assert latest_checkpoint(tmp_path / "run").name == "step-0000004"
    assert not (tmp_path / "run" / "model").exists()
    train(config, tmp_path / "run", resume=True, progress=False)  # from the last good checkpoint
    assert final_weights(tmp_path / "run") == final_weights(tmp_path / "full")


def test_non_finite_weights_after_a_step_are_never_checkpointed(tmp_path, monkeypatch):
    trainer = Trainer(run_config.load(write_config(tmp_path, steps=6)), tmp_path / "run", progress=False)
    step = trainer.optimizer.step

    def overflowing(*args, **kwargs):
        step(*args, **kwargs)
        if trainer.step == 5:  # the last step's update overflows a weight (no evaluation follows it)
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = math.inf

    monkeypatch.setattr(trainer.optimizer, "step", overflowing)
    name = next(n for n, _ in trainer.model.named_parameters())
    refused = rf"parameters after step 6: tensor '{re.escape(name)}' holds NaN or infinite"
    with pytest.raises(FloatingPointError, match=refused):
        trainer.run()
    assert latest_checkpoint(tmp_path / "run").name == "step-0000004"
    assert not (tmp_path / "run" / "model").exists()
    checkpoint.load(latest_checkpoint(tmp_path / "run"))


# ---- failed writes: one clear error naming the path, nothing half-written -----------------------


def stale(run: Path) -> list[str]:
    return [p.name for p in run.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


def test_disk_full_during_a_checkpoint(tmp_path, monkeypatch):
    import errno

    from probformer.training import run_checkpoints

    config = write_config(tmp_path, steps=6)
    writes, write = [], run_checkpoints.save_file

    def filling_up(tensors, path):
        writes.append(path)
        if len(writes) == 2:  # the second checkpoint finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        write(tensors, path)

    monkeypatch.setattr(run_checkpoints, "save_file", filling_up)
    with pytest.raises(checkpoint.WriteError, match=r"cannot write .*checkpoints/step-0000004: No space left") as e:
        train(config, tmp_path / "run", progress=False)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one error, not a chain from inside
    assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert stale(tmp_path / "run") == []
    monkeypatch.undo()
    assert train(config, tmp_path / "run", resume=True, progress=False)["steps"] == 6


def test_unwritable_checkpoint_folder_and_run_folder(tmp_path):
    from tests.builders import unwritable

    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    longer = write_config(tmp_path, name="longer.toml", steps=4)
    with unwritable(tmp_path / "run" / "checkpoints"):
        with pytest.raises(
            checkpoint.WriteError, match=r"cannot write .*checkpoints/step-0000004: .*(denied|permitted)"
        ):
            train(longer, tmp_path / "run", resume=True, progress=False)
        assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert stale(tmp_path / "run") == []
    assert train(longer, tmp_path / "run", resume=True, progress=False)["steps"] == 4
    with unwritable(tmp_path / "locked") as locked:
        process = cli("train", "--config", str(config), "--out", str(locked / "run"), stderr=subprocess.PIPE)
        _, error = process.communicate(timeout=120)
        assert process.returncode == 1
        assert f"probformer train: error: cannot write {locked / 'run'}" in error.decode()
        assert "Traceback" not in error.decode()
