"""Coordinate check: does every activation keep its size as the model widens?

For each width, train a few AdamW steps on the same PTB MLM batches (same seed) and
record the mean |coordinate| of every activation group at every step (step 0 = at
initialisation). Under μP each group's size should be flat in width; under the
standard parametrisation something drifts (the control that proves the check can
fail). Groups (docs/mup.md, "Coordinate check"):

    unary               S[w_i], the input layer
    quasi_distribution  d * q_z - 1 after the last iteration: its distance from uniform
                        in Theta(1) units (d * q_z itself has mean exactly 1)
    head_logits         the last iteration's head logits over legal arcs
    messages            label logits minus the unary term (head, dependents, topic)
    label_logits        M_z, what the decoder reads
    output_logits       the MLM decoder's logits
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from inference.mean_field.kernels import head_kernels
from probformer.mup import param_groups, widen
from probformer.training import data

__all__ = ["ACTIVATIONS", "activation_sizes", "run", "width_ratios", "plot"]

MAX_STEPS, MAX_SEEDS = 10_000, 1_000  # a check of the first steps, averaged over a few initialisations
ACTIVATIONS = ("unary", "quasi_distribution", "head_logits", "messages", "label_logits", "output_logits")


def _mean_abs(x: torch.Tensor, where: torch.Tensor) -> float:
    where = where.expand_as(x)
    return torch.where(where, x.abs(), 0.0).sum().item() / max(where.sum().item(), 1)


@torch.no_grad()
def activation_sizes(model, tokens, mask) -> dict[str, float]:
    """Mean |coordinate| of each activation group over real tokens (legal arcs for
    heads), recomputed from the engine's own building blocks."""
    engine, crf = model.mean_field, model.crf
    output, posterior = model(tokens, mask)
    tokens, mask, structure = engine.structure(tokens, mask)
    n = mask.shape[1]
    unary = crf.unary_table(tokens, mask)
    history = posterior.trace["logits"]  # [T, B, N, d]
    before_last = history[-2] if len(history) > 1 else unary
    q_before = before_last.softmax(-1) * structure.nodes[..., None]
    query, key = engine.project(q_before)
    head_logits = head_kernels.naive_logits(query, key, engine.scales()["attention"], structure, engine.head_bias())
    logits = posterior.logits
    tokens_only = mask[..., None]
    return {
        "unary": _mean_abs(unary[:, :n], tokens_only),
        "quasi_distribution": _mean_abs(crf.labels * posterior.z[:, :n] - 1, tokens_only),
        "head_logits": _mean_abs(head_logits, structure.arcs[:, None]),
        "messages": _mean_abs((logits - engine.scales()["unary"] * unary)[:, :n], tokens_only),
        "label_logits": _mean_abs(logits[:, :n], tokens_only),
        "output_logits": _mean_abs(output, tokens_only),
    }


def fixed_batches(steps: int, batch_size: int = 16, max_length: int = 20, vocab_size: int = 2000, seed: int = 0):
    """``steps + 1`` masked PTB batches and the vocabulary size, identical for every width."""
    sentences = [s for s in data.ptb_sentences("train")[:4000] if 4 <= len(s) <= max_length]
    vocabulary = data.Vocabulary.build(sentences, max_size=vocab_size)
    generator = torch.Generator().manual_seed(seed)
    stream = data.batches(sentences, vocabulary, batch_size, max_length, shuffle=True, generator=generator)
    out = []
    for _, (tokens, mask) in zip(range(steps + 1), stream):
        inputs, targets = data.mask_tokens(tokens, mask, len(vocabulary), generator=generator)
        out.append((inputs, mask, targets))
    return out, len(vocabulary)


def work(width: int, base: int) -> float:
    """The relative cost of one seed's run at ``width``: the head kernel's C·d·r and the
    ternary tables grow as width squared, so the progress bar's estimate weighs by it."""
    return (width / base) ** 2


def progress_bar(total: float, description: str):
    """A tqdm bar with an estimate of the time left on stderr: redrawn in place on a
    terminal; elsewhere (a log file, CI) one plain line at most every minute."""
    import sys

    from tqdm import tqdm

    layout = "{desc}: {percentage:3.0f}%|{bar}| elapsed {elapsed}, about {remaining} left"
    if sys.stderr.isatty():
        return tqdm(total=total, desc=description, bar_format=layout, dynamic_ncols=True)

    class Lines(tqdm):
        def display(self, msg=None, pos=None):  # a whole line each time: no carriage returns in a log
            print(msg or str(self), file=sys.stderr, flush=True)
            return True

        def clear(self, nolock=False):  # nothing drawn in place, nothing to clear
            pass

    return Lines(total=total, desc=description, bar_format=layout, ncols=80, mininterval=60, ascii=True)


def _check_run(widths, steps, lr, seeds) -> None:
    """The coordinate check's own arguments: seeds=0 averaged nothing (every size 0.0)."""
    if isinstance(widths, str) or not isinstance(widths, list | tuple) or not widths:
        raise ValueError(f"widths must be a non-empty list of integers >= 1, got {widths!r}")
    for name, value, low, high in (("steps", steps, 0, MAX_STEPS), ("seeds", seeds, 1, MAX_SEEDS)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer >= {low} and <= {high} (the limit), got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")


def run(base_config, widths, steps: int = 5, lr: float = 1e-2, seeds: int = 4, batches=None, progress=None) -> dict:
    """``{"widths", "steps", "sizes": {width: {group: [size at step 0..steps]}}}`` for
    ``base_config`` widened to each width (its ``mup`` flag picks the parametrisation),
    each size averaged over ``seeds`` initialisations (one seed's random features make
    narrow models noisy). ``progress``: a tqdm bar advanced by ``work`` per seed."""
    from probformer.models.probabilistic_transformer import ProbabilisticTransformer

    _check_run(widths, steps, lr, seeds)
    if batches is None:
        batches, vocab_size = fixed_batches(steps)
        base_config = dataclasses.replace(base_config, vocab_size=vocab_size)
    if len(batches) < steps + 1:  # one batch measured before each step and one after the last
        raise ValueError(f"steps must be at most {len(batches) - 1} (the batches there are), got {steps}")
    sizes = {}
    for width in widths:
        per_step = {group: [0.0] * (steps + 1) for group in ACTIVATIONS}
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = ProbabilisticTransformer(widen(base_config, width))
            optimizer = torch.optim.AdamW(param_groups(model, lr), lr=lr)
            for step in range(steps + 1):
                inputs, mask, targets = batches[step]
                model.eval()  # dropout off while measuring
                for group, value in activation_sizes(model, inputs, mask).items():
                    per_step[group][step] += value / seeds
                if step == steps:
                    break
                model.train()
                logits, _ = model(inputs, mask)
                loss = F.cross_entropy(logits.transpose(1, 2), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if progress is not None:
                progress.update(work(width, min(widths)))
        sizes[width] = per_step
    return {"widths": sorted(widths), "steps": steps, "seeds": seeds, "sizes": sizes}


def width_ratios(result: dict, widths=None) -> dict[str, float]:
    """Per group: the largest max/min ratio of its size over ``widths`` (default all),
    taken over steps."""
    keys = ("widths", "steps", "sizes")
    if not isinstance(result, dict) or any(key not in result for key in keys):
        found = sorted(result) if isinstance(result, dict) else type(result).__name__
        raise ValueError(f"result must be coord_check.run's result, a dict with {list(keys)}, got {found}")
    widths = widths or result["widths"]
    if any(width not in result["sizes"] for width in widths):
        raise ValueError(f"widths must be among the result's widths {sorted(result['sizes'])}, got {widths!r}")
    ratios = {}
    for group in ACTIVATIONS:
        worst = 1.0
        for step in range(result["steps"] + 1):
            values = [result["sizes"][w][group][step] for w in widths]
            if any(math.isnan(value) for value in values):  # a diverged run: no ratio (max, min ignore a NaN but first)
                worst = math.nan
                break
            worst = max(worst, max(values) / max(min(values), 1e-30))
        ratios[group] = worst
    return ratios


def plot(results: dict[str, dict], path) -> Path:
    """One row per parametrisation, one column per activation group: size vs width,
    a line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results)
    figure, axes = plt.subplots(len(rows), len(ACTIVATIONS), figsize=(3 * len(ACTIVATIONS), 2.6 * len(rows)))
    axes = axes.reshape(len(rows), len(ACTIVATIONS))
    for row, name in enumerate(rows):
        result = results[name]
        for column, group in enumerate(ACTIVATIONS):
            axis = axes[row, column]
            for step in range(result["steps"] + 1):
                values = [result["sizes"][w][group][step] for w in result["widths"]]
                axis.plot(result["widths"], values, marker="o", color=plt.cm.viridis(step / max(result["steps"], 1)))
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_title(f"{name}: {group}", fontsize=8)
            axis.tick_params(labelsize=7)
    figure.supxlabel("width d (colour: training step 0 .. last)")
    figure.supylabel("mean |coordinate|")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(out, widths=(64, 128, 256, 512, 1024), steps: int = 5, lr: float = 1e-2) -> dict:
    """Both paradigms, standard and μP; writes ``coord_check.json`` and one PNG per
    paradigm to ``out``; returns the ratios."""
    from probformer.models.probabilistic_transformer import PTConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batches, vocab_size = fixed_batches(steps)
    base = min(widths)
    starts = {  # the base shapes: 4 channels of rank 16 / 2 channels whose rank grows with d
        "channels": {"channels": max(1, base // 16), "rank": 16},
        "rank": {"channels": 2, "rank": max(1, base // 4)},
    }
    summary = {}
    total = len(starts) * 2 * 4 * sum(work(w, base) for w in widths)  # paradigms x parametrisations x seeds
    bar = progress_bar(total, f"coord-check, widths {min(widths)}..{max(widths)}")
    for paradigm, shape in starts.items():
        results = {}
        for name, use_mup in (("standard", False), ("mup", True)):
            config = PTConfig(
                vocab_size=vocab_size,
                labels=base,
                iterations=3,
                dropout=0.0,
                mup=use_mup,
                mup_paradigm=paradigm,
                **shape,
            )
            results[name] = run(config, widths, steps=steps, lr=lr, batches=batches, progress=bar)
            bar.write(
                f"{paradigm:8s} {name:8s} max/min over widths: "
                + ", ".join(f"{g} {r:.2f}" for g, r in width_ratios(results[name]).items())
            )
        plot(results, out / f"coord_check_{paradigm}.png")
        summary[paradigm] = {
            name: {
                **result,
                "ratios_all_widths": width_ratios(result),
                "ratios_two_widest": width_ratios(result, result["widths"][-2:]),
            }
            for name, result in results.items()
        }
    bar.close()
    (out / "coord_check.json").write_text(json.dumps(summary, indent=1))
    return summary
