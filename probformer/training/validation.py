"""The validation metrics of a model on encoded sentences: loss and perplexity for
masked-language modelling, loss and accuracy for tagging. The trainer reports them
during and after a run, ``probformer evaluate`` for a saved model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from probformer.training.corpus import IGNORE, collate, inputs_and_targets

__all__ = ["evaluate_model", "describe"]


@torch.no_grad()
def evaluate_model(model, examples, task: str, vocab_size: int, mask_rate: float = 0.15, batch_size: int = 64) -> dict:
    """Validation loss and perplexity (mlm, masked tokens, fixed masks) or accuracy (pos),
    on the model's device; the sums stay there until one read at the end (float64, as the
    Python floats they replace)."""
    was_training = model.training
    model.eval()
    device = _model_device(model)
    generator = torch.Generator().manual_seed(313)  # masks drawn on the CPU: the same on every device
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    total = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    count = 0
    for start in range(0, len(order), batch_size):
        tokens, mask, labels = collate([examples[i] for i in order[start : start + batch_size]])
        inputs, targets = inputs_and_targets(task, tokens, mask, labels, vocab_size, mask_rate, generator)
        count += int((targets != IGNORE).sum())  # CPU tensors: no device read
        inputs, mask, targets = (t.to(device, non_blocking=True) for t in (inputs, mask, targets))
        logits, _ = model(inputs, mask)
        total += F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="sum").double()
        correct += ((logits.argmax(-1) == targets) & (targets != IGNORE)).sum()
    model.train(was_training)
    if count == 0:  # a loss of 0 (perplexity 1) would be no measurement, and the best early stopping saw
        what = "tag" if task == "pos" else "masked token"
        raise ValueError(
            f"validation has no target token: {len(examples)} sentence(s) gave no {what} to score; validate on "
            "more sentences (train.eval_sentences, or evaluate's --sentences)"
        )
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
