"""The validation metrics of a model on encoded sentences: loss and perplexity for
masked-language modelling, loss and accuracy for tagging. The trainer reports them
during and after a run, ``probformer evaluate`` for a saved model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from probformer.training.corpus import IGNORE, collate, inputs_and_targets

__all__ = ["evaluate_model", "describe", "refuse_validations_without_targets"]


EVAL_BATCH = 64  # the masks are drawn batch by batch: one batch size gives one set of masks


def _batches(examples, task: str, vocab_size: int, mask_rate: float, batch_size: int):
    """The validation batches ``(inputs, mask, targets)``, in length order, with the fixed
    masks (drawn on the CPU: the same on every device)."""
    generator = torch.Generator().manual_seed(313)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    for start in range(0, len(order), batch_size):
        tokens, mask, labels = collate([examples[i] for i in order[start : start + batch_size]])
        inputs, targets = inputs_and_targets(task, tokens, mask, labels, vocab_size, mask_rate, generator)
        yield inputs, mask, targets


def refuse_validations_without_targets(corpus, config) -> None:
    """Every validation a run makes (the periodic one on ``train.eval_sentences``, the final
    one on all) scores at least one target token (its fixed masks; no model), or the run is
    refused before it starts."""
    train, data = config.train, config.data
    for limit in sorted({0} | ({train.eval_sentences} if train.eval_every else set())):
        examples = corpus.valid[:limit] if limit else corpus.valid
        batches = _batches(examples, data.task, len(corpus.vocabulary), data.mask_rate, EVAL_BATCH)
        # an empty validation set scores no token either: refused like one without a masked position
        if not any((targets != IGNORE).any() for _, _, targets in batches):
            raise ValueError(_no_target_message(len(examples), data.task))


def _no_target_message(sentences: int, task: str) -> str:
    what = "tag" if task == "pos" else "masked token"
    return (
        f"validation has no target token: {sentences} sentence(s) gave no {what} to score; validate on more "
        "sentences (train.eval_sentences, or evaluate's --sentences)"
    )


@torch.no_grad()
def evaluate_model(
    model, examples, task: str, vocab_size: int, mask_rate: float = 0.15, batch_size: int = EVAL_BATCH
) -> dict:
    """Validation loss and perplexity (mlm, masked tokens, fixed masks) or accuracy (pos),
    on the model's device; the sums stay there until one read at the end (float64, as the
    Python floats they replace). A validation with no target token is refused: a loss of 0
    (perplexity 1) would be no measurement, and the best early stopping ever saw."""
    was_training = model.training
    model.eval()
    device = _model_device(model)
    total = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    count = 0
    for inputs, mask, targets in _batches(examples, task, vocab_size, mask_rate, batch_size):
        count += int((targets != IGNORE).sum())  # CPU tensors: no device read
        inputs, mask, targets = (t.to(device, non_blocking=True) for t in (inputs, mask, targets))
        logits, _ = model(inputs, mask)
        total += F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="sum").double()
        correct += ((logits.argmax(-1) == targets) & (targets != IGNORE)).sum()
    model.train(was_training)
    if count == 0:
        raise ValueError(_no_target_message(len(examples), task))
    total, correct = total.item(), int(correct.item())
    loss = total / count
    result = {"loss": loss, "tokens": count}
    if task == "pos":
        result["accuracy"] = correct / count
    else:
        result["perplexity"] = math.exp(min(loss, 700.0))
    return result


def describe(metrics: dict) -> str:
    """``evaluate_model``'s result as the trainer prints it."""
    if "accuracy" in metrics:
        return f"loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}"
    return f"loss {metrics['loss']:.4f}, perplexity {metrics['perplexity']:.2f}"


def _model_device(model) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
