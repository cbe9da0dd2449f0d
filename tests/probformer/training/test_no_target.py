"""A batch or a validation set with no target token (no position masked) measures nothing:
validation refuses it by name instead of reporting loss 0 (perplexity 1), and a training
step on it changes no weight and adds nothing to the logged loss (a window of such steps
logs NaN, not 0)."""

import math

import pytest
import torch

from probformer.training import run_config
from probformer.training.run_log import RunLog
from probformer.training.trainer import Trainer
from probformer.training.validation import evaluate_model, refuse_validations_without_targets
from tests.builders import write_tiny_run_config as write_config

ONE_TOKEN = ([5], None)  # a one-word sentence: at a low mask rate no position is masked


@pytest.fixture
def trainer(tmp_path):
    torch.set_num_threads(1)
    config = run_config.load(write_config(tmp_path), ["data.mask_rate=0.01"])
    return Trainer(config, tmp_path / "run", progress=False)


def test_validation_without_a_target_token_is_refused_naming_the_setting(trainer):
    with pytest.raises(ValueError, match=r"no target token: 3 sentence\(s\) .*train.eval_sentences"):
        evaluate_model(trainer.model, [ONE_TOKEN] * 3, "mlm", len(trainer.corpus.vocabulary), mask_rate=1e-9)
    scored = evaluate_model(trainer.model, [ONE_TOKEN] * 3, "mlm", len(trainer.corpus.vocabulary), mask_rate=0.99)
    assert scored["tokens"] == 3 and scored["loss"] > 0 and math.isfinite(scored["perplexity"])


def test_an_empty_validation_set_is_refused_as_one_that_scores_nothing(trainer):
    """No sentence scores no token: skipping the check for an empty set let a run train and
    stop at its final validation, leaving a run folder without a model."""
    trainer.corpus.valid = []
    with pytest.raises(ValueError, match=r"validation has no target token: 0 sentence\(s\)"):
        refuse_validations_without_targets(trainer.corpus, trainer.config)


def text_run(tmp_path, last_lines: list[str], batch_size: int = 8):
    """A text source of 38 six-word lines and ``last_lines``: the last 1/20 (2 lines) validate."""
    source = tmp_path / "text.txt"
    source.write_text("\n".join(["the cat sat on the mat"] * 38 + last_lines) + "\n")
    config = write_config(tmp_path, source=str(source))
    overrides = ["data.mask_rate=0.01", f"train.batch_size={batch_size}", "data.vocabulary=50"]
    return run_config.load(config, overrides)


def test_a_run_whose_validation_scores_no_token_is_refused_before_its_folder_exists(tmp_path):
    with pytest.raises(ValueError, match=r"validation has no target token: 2 sentence\(s\)"):
        Trainer(text_run(tmp_path, ["cat", "mat"]), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_whose_validation_lines_encode_to_nothing_is_refused_before_its_folder_exists(tmp_path):
    """Zero-width lines are not blank, so they validate, but encode to no token: the run
    is refused naming data.source, not trained and then stopped without a model."""
    config = text_run(tmp_path, ["\u200b", "\u200b"])
    with pytest.raises(ValueError, match=r"data.source .*none of the 2 validation sentences"):
        Trainer(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_last_batch_smaller_than_the_process_count_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """38 training sentences in batches of 4: the last has 2 rows, one per process of 2 but
    none for a third."""
    from probformer.training import placement

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(placement, "init_distributed", lambda device: (0, 3))
    config = text_run(tmp_path, ["the cat sat", "on the mat"], batch_size=4)
    with pytest.raises(ValueError, match=r"last batch has 2 sentence\(s\) \(38 sentences, train.batch_size=4\), fewer"):
        Trainer(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_step_without_a_target_token_trains_nothing(trainer):
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss, tokens, grad_norm = trainer.train_step([ONE_TOKEN])
    assert loss is None and tokens == 1 and math.isnan(grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_each_groups_logged_rate_is_this_steps_even_when_the_step_had_no_target(trainer):
    """A step without a target returns before it sets the groups' rates, which the log then
    read: the previous step's rate (or the un-warmed initial one). The rate is the schedule's,
    by hand: warm-up ramps (s + 1) / W, then decays linearly to 0 at the last step."""
    train, skipped = trainer.config.train, 0
    for _ in range(6):
        trainer.step += 1
        skipped += trainer.train_step([ONE_TOKEN])[0] is None
        s, warmup, total = trainer.step - 1, train.warmup_steps, trainer.total_steps
        factor = (s + 1) / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
        fields = trainer._train_fields(math.nan, 1, 1.0)
        for group in trainer.optimizer.param_groups:
            assert fields[f"lr/{group['name']}"] == pytest.approx(group["initial_lr"] * factor, rel=1e-12)
    assert skipped >= 2  # the path in question ran


def test_a_log_window_without_a_measured_step_logs_nan_and_a_measured_one_its_mean(tmp_path):
    log = RunLog(tmp_path / "metrics.jsonl", enabled=False)
    assert math.isnan(log.log_train(1)["loss"])
    log.add_loss(2.0)
    log.add_loss(4.0)
    assert log.log_train(2)["loss"] == 3.0
