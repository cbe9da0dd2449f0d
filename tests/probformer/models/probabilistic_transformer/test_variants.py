"""The options as Probabilistic Transformer config keys: the losses they add, the
trainer running them, the configs refusing what is not derived, export refusing what
its runtime lacks."""

import math

import pytest
import torch
import torch.nn.functional as F

import probformer
from probformer.training.trainer import train

torch.set_num_threads(1)


VOCAB = 30


def model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, labels=8, channels=2, rank=2, global_labels=4, iterations=4, dropout=0.0)
    config.update(overrides)
    return probformer.ProbabilisticTransformer(probformer.PTConfig(**config))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    targets = torch.randint(0, VOCAB, (3, 7), generator=generator).masked_fill(~mask, -100)
    return tokens, mask, targets


def test_auxiliary_losses_are_what_the_config_says():
    tokens, mask, targets = batch()
    act = model(halting="act", ponder_cost=0.05)
    _, posterior = act(tokens, mask)
    ponder = posterior.halting["ponder"][:, :7]
    expected = 0.05 * (ponder * mask).sum() / mask.sum()
    assert torch.allclose(act.auxiliary_loss(posterior, mask, targets), expected)
    # given denominators (a DDP process's share of the whole batch's counts) replace the batch's own
    shared = 0.05 * (ponder * mask).sum() / 2.5
    assert torch.allclose(act.auxiliary_loss(posterior, mask, targets, token_count=2.5, target_count=7.0), shared)

    span = model(span=True, span_max=16, span_penalty=0.01)
    _, posterior = span(tokens, mask)
    assert torch.allclose(span.auxiliary_loss(posterior, mask, targets), torch.tensor(0.01 * 16.0))

    aligned = model(halting="exit", aligned_training=True)
    aligned.train()
    _, posterior = aligned(tokens, mask)
    count = (targets != -100).sum()
    by_hand = sum(
        F.cross_entropy(aligned.head(h, mask).transpose(1, 2), targets, reduction="sum") / count
        for h in posterior.history[:-1]
    )
    assert torch.allclose(aligned.auxiliary_loss(posterior, mask, targets), by_hand)
    given = aligned.auxiliary_loss(posterior, mask, targets, token_count=99.0, target_count=3.5)
    assert torch.allclose(given, by_hand * count / 3.5)
    assert model().auxiliary_loss(model()(tokens, mask)[1], mask, targets) is None


def test_exit_uses_the_task_heads_confidence_at_inference():
    tokens, mask, _ = batch()
    exiting = model(halting="exit", exit_threshold=1.0).eval()
    plain = model().eval()
    with torch.no_grad():
        assert torch.equal(exiting(tokens, mask)[0], plain(tokens, mask)[0])
        exiting.mean_field.exit_threshold = 1e-9
        logits, posterior = exiting(tokens, mask)
    assert (posterior.halting["updates"][:, :7][mask] == 1).all()
    assert torch.allclose(logits, exiting.head(posterior.history[0], mask))


def test_the_diagnostic_trace_and_inference_gap_read_the_q_an_exiting_model_predicts_with():
    """Tokens that exit at once keep their first iteration's logits in forward; the trace
    and the gap ran every iteration instead, describing another q."""
    from probformer.diagnostics.inference_gap import inference_gap

    tokens, mask, _ = batch()
    exiting = model(halting="exit", exit_threshold=1e-9).eval()
    with torch.no_grad():
        _, posterior = exiting(tokens, mask)
        trace = exiting.diagnostic_trace(tokens, mask)
    n = tokens.shape[1]
    first = posterior.history[0][:, :n]
    for t in range(trace["hidden"].shape[0]):  # frozen after the first iteration, where real
        assert torch.equal(trace["hidden"][t][mask], first[mask])
    assert torch.equal(trace["hidden"][-1], posterior.logits[:, :n])
    gap = inference_gap(exiting, tokens[:1, :3], particles=8, replicates=3)
    with torch.no_grad():
        expected = exiting(tokens[:1, :3])[1].elbo.double()
    assert gap.elbo == pytest.approx(expected.numpy(), abs=1e-9)


TINY = """
[model]
kind = "probabilistic_transformer"
labels = 16
channels = 2
rank = 4
global_labels = {global_labels}
iterations = 3
dropout = 0.1
{options}

[data]
source = "ptb"
train_sentences = 64
valid_sentences = 8
max_length = 90
vocabulary = 300

[train]
batch_size = 8
lr = 3e-3
warmup_steps = 1
steps = 3
log_every = 1
threads = 1
"""


@pytest.mark.parametrize(
    "options, global_labels",
    [
        ('halting = "act"\nhalting_source = "delta"', 4),
        ('halting = "exit"\naligned_training = true', 4),
        ('span = true\nspan_max = 8\nschedule = "macaron"\nternary_form = "tucker"\nternary_blocks = 2', 4),
        ('global_memory = "product_key"\nmemory_topk = 4\nternary_form = "cp"\ntopology = "star()"', 64),
    ],
)
def test_options_train_through_the_trainer(tmp_path, options, global_labels):
    (tmp_path / "c.toml").write_text(TINY.format(options=options, global_labels=global_labels))
    summary = train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    assert summary["steps"] == 3 and math.isfinite(summary["valid"]["loss"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mup=True, halting="act"), "cannot be combined"),
        (dict(mup=True, ternary_form="cp"), "needs ternary_form='low_rank'"),
        (dict(halting="exit", task="classification", num_classes=2), "need per-token outputs"),
        (dict(global_memory="hash"), "'global_memory' must be one of"),
        (dict(ternary_form="dense"), "'ternary_form' must be one of"),
        (dict(ponder_cost=-1.0), "'ponder_cost' must be a number >= 0"),
        (dict(halting="sometimes"), "halting must be one of"),
        (dict(schedule="macaron", global_labels=0), "needs global_labels"),
    ],
)
def test_bad_option_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        model(**overrides)


def test_export_keeps_every_variant_and_refuses_halting_in_traced_formats(tmp_path):
    tokens, mask, _ = batch()
    variants = {
        "cp": dict(ternary_form="cp", ternary_blocks=2),
        "tucker": dict(ternary_form="tucker", ternary_blocks=2),
        "act": dict(halting="act"),
        "span": dict(span=True),
        "memory": dict(global_labels=16, global_memory="product_key"),
    }
    for name, overrides in variants.items():  # the torch folder runs the model itself: every option
        source = model(**overrides).eval()
        artefact = probformer.load(probformer.export(source, tmp_path / name))
        with torch.no_grad():
            assert (artefact(tokens, mask) - source(tokens, mask)[0]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="halting='act' or 'exit'"):  # iterations depend on values
        probformer.export(model(halting="act"), tmp_path / "refused.pt2", format="exported")
    assert not (tmp_path / "refused.pt2").exists()
