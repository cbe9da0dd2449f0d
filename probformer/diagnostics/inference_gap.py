"""How wrong is the mean field? ``inference_gap(model, tokens, mask)``: per sentence, the
CRF's log Z by tempered SMC (``inference.TemperedSMC``, from the model's own mean-field
posterior q), the model's ELBO, the gap log Z - ELBO (the KL divergence from the mean-field
member, labels q and heads at their optimum, to the CRF's posterior) and the PSIS Pareto
k-hat of the importance weights p(z) / q(z) of the labels (heads and globals summed out),
with Yao et al.'s (2018) reading: k < 0.5 good, 0.5 to 0.7 acceptable, above 0.7 q cannot
be trusted as an importance proposal (nor its expectations).

``add_to_report(report, gap)`` adds the figures as an ``inference_gap`` group of a
``report`` (one draw per sentence, as its ``sample_stats``); ``plot_inference_gap`` draws
them (``inference_gap.png``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probformer.diagnostics.estimators import pareto_k

__all__ = ["InferenceGap", "inference_gap", "add_to_report", "plot_inference_gap", "KHAT_GOOD", "KHAT_ACCEPTABLE"]

KHAT_GOOD, KHAT_ACCEPTABLE = 0.5, 0.7  # Yao et al. (2018)

# name -> (long name, units), the group's variables
VARIABLES = {
    "log_partition": ("log Z by tempered SMC", "nats"),
    "log_partition_se": ("standard error of log Z", "nats"),
    "elbo": ("mean-field ELBO", "nats"),
    "kl": ("KL gap log Z - ELBO", "nats"),
    "pareto_k": ("PSIS k-hat of p(z) / q(z)", "dimensionless"),
}


@dataclass
class InferenceGap:
    """Per sentence ``[B]`` (numpy, float64): ``log_partition`` and its ``standard_error``,
    ``elbo``, ``kl`` (= log_partition - elbo), ``pareto_k`` and its ``verdict`` ("good",
    "acceptable", "untrustworthy", or "unreliable": too few draws); ``draws``, the importance
    draws per sentence; ``result``, the whole ``inference.TemperedSMCResult``."""

    log_partition: np.ndarray
    standard_error: np.ndarray
    elbo: np.ndarray
    kl: np.ndarray
    pareto_k: np.ndarray
    verdict: np.ndarray
    draws: int
    result: object

    def table(self) -> str:
        """One line per sentence, as ``probformer diagnose --inference-gap`` prints it."""
        lines = [f"{'sentence':>8} {'log Z':>12} {'± se':>7} {'ELBO':>12} {'KL gap':>9} {'k-hat':>6}  verdict"]
        for b in range(len(self.kl)):
            lines.append(
                f"{b:>8} {self.log_partition[b]:>12.3f} {self.standard_error[b]:>7.3f} {self.elbo[b]:>12.3f} "
                f"{self.kl[b]:>9.3f} {self.pareto_k[b]:>6.2f}  {self.verdict[b]}"
            )
        return "\n".join(lines)


def _verdict(k: np.ndarray) -> np.ndarray:
    labels = np.where(k < KHAT_GOOD, "good", np.where(k <= KHAT_ACCEPTABLE, "acceptable", "untrustworthy"))
    return np.where(np.isnan(k), "unreliable", labels)


def inference_gap(
    model,
    tokens,
    mask=None,
    *,
    particles: int = 16,
    replicates: int = 6,
    target_ess: float = 0.8,
    seed: int = 0,
) -> InferenceGap:
    """The inference gap of a Probabilistic Transformer (any model with a ``crf`` and its
    ``mean_field`` engine) on token ids ``tokens [B, n]`` (``mask [B, n]``, padding allowed).
    ``particles`` x ``replicates`` importance draws per sentence for k-hat (>= 21); the
    other arguments are ``inference.TemperedSMC``'s."""
    from inference.smc.tempered.sampler import TemperedSMC

    crf, engine = getattr(model, "crf", None), getattr(model, "mean_field", None)
    if crf is None or engine is None:
        raise TypeError(
            f"model must be a Probabilistic Transformer (a model with .crf and .mean_field), got {type(model).__name__}"
        )
    if getattr(engine, "span", None) is not None:
        # its ELBO bounds log Z of the CRF times the span's prior on heads; tempered SMC targets the CRF
        raise ValueError(
            "model has an adaptive span (span=True): its mean field approximates the CRF times the span's "
            "prior on heads, not the CRF whose log Z tempered SMC estimates; use a model with span=False"
        )
    tokens, mask = crf.check_inputs(tokens, mask)
    was_training = model.training
    model.eval()  # no dropout: the q the model predicts with
    try:
        with torch.no_grad():
            exit_confidence = getattr(model, "exit_confidence", None)  # halted tokens: the q it predicts with
            posterior = engine(tokens, mask, confidence=exit_confidence(mask) if exit_confidence else None)
            elbo = posterior.elbo.double()
            sampler = TemperedSMC(crf, num_particles=particles, replicates=replicates, target_ess=target_ess, seed=seed)
            result = sampler.run(tokens, mask, proposal=posterior)
    finally:
        model.train(was_training)
    ratios = result.initial_log_ratio.permute(1, 0, 2).reshape(mask.shape[0], -1)  # [B, R * P] draws from q
    psis = pareto_k(ratios)
    k = np.asarray(psis.k, dtype=float)
    # q a point mass: its draws, all one labelling, show nothing of p's tails: no verdict
    k = np.where(result.one_labelling.cpu().numpy(), np.nan, k)
    log_z = result.log_partition.double().cpu().numpy()
    elbo = elbo.cpu().numpy()
    return InferenceGap(
        log_partition=log_z,
        standard_error=result.standard_error.double().cpu().numpy(),
        elbo=elbo,
        kl=log_z - elbo,
        pareto_k=k,
        verdict=_verdict(k),
        draws=ratios.shape[1],
        result=result,
    )


def add_to_report(report, gap: InferenceGap):
    """``report`` (a ``diagnostics.report`` InferenceData) with an ``inference_gap`` group:
    dims ``chain`` (1) and ``draw`` (the sentences), like its ``sample_stats``."""
    from inference import arviz_interop

    values = {
        "log_partition": gap.log_partition,
        "log_partition_se": gap.standard_error,
        "elbo": gap.elbo,
        "kl": gap.kl,
        "pareto_k": gap.pareto_k,
    }
    group = arviz_interop.from_datasets(
        {"inference_gap": {name: (["chain", "draw"], value[None]) for name, value in values.items()}},
        attrs={"draws_per_sentence": gap.draws, "khat_good": KHAT_GOOD, "khat_acceptable": KHAT_ACCEPTABLE},
    )
    for name, array in group["inference_gap"].data_vars.items():
        long_name, units = VARIABLES[name]
        array.attrs.update(long_name=long_name, units=units)
    report.extend(group)
    return report


def plot_inference_gap(gap: InferenceGap, directory) -> str:
    """``inference_gap.png`` in ``directory``: the KL gap per sentence (bars, ± 2 se of log Z)
    beside k-hat with Yao et al.'s thresholds; its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sentences = np.arange(len(gap.kl))
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(sentences, gap.kl, yerr=2 * gap.standard_error, color="tab:blue")
    left.set_xlabel("sentence")
    left.set_ylabel("KL gap log Z - ELBO (nats)")
    left.set_title("how far the mean field is from the CRF's posterior")
    right.scatter(sentences, gap.pareto_k, color="black", zorder=3)
    right.axhline(KHAT_GOOD, color="tab:green", linestyle="--", label="0.5: good below")
    right.axhline(KHAT_ACCEPTABLE, color="tab:red", linestyle="--", label="0.7: untrustworthy above")
    right.set_xlabel("sentence")
    right.set_ylabel("PSIS k-hat of p(z) / q(z)")
    right.legend(loc="best", fontsize="small")
    figure.tight_layout()
    path = Path(directory) / "inference_gap.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return str(path)
