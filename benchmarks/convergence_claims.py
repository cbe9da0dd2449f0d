"""What the convergence study's rows support: each arm's final best perplexity (mean ± sd
over its seeds, once every seed has finished) and the ranking of PT against BERT beside the
PT paper's converged one, by the curves so far or by the final means. ``convergence_report``
writes them into its section."""

from __future__ import annotations

import statistics


def ppl(value: float, signed: bool = False, decimals: int = 1) -> str:
    """A perplexity (or, ``signed``, a gap between two) as the report prints it: one
    decimal (a final figure: two, as the paper's), or powers of ten past a million."""
    sign = "+" if signed else ""
    return f"{value:{sign}.{decimals}f}" if abs(value) < 1e6 else f"{value:{sign}.2e}"


PAPER_TRANSFORMER, PAPER_PT = 58.43, 62.86  # PTB MLM at convergence, mean over 5 seeds (± 0.58, ± 0.40)
PAPER = (
    "the PT paper's converged ranking on PTB MLM (its own recipe, 5 seeds), where the Transformer is ahead: "
    f"{PAPER_TRANSFORMER} ± 0.58 vs PT {PAPER_PT} ± 0.40, PT's {100 * (PAPER_PT / PAPER_TRANSFORMER - 1):.1f}% higher"
)


def leader(pt: float, bert: float) -> str | None:
    """The model with the lower perplexity, None in a tie."""
    return None if pt == bert else "BERT" if bert < pt else "PT"


def verdict(leader: str | None) -> str:
    """How a leader (None: a tie) stands to the paper's ranking, where the Transformer leads."""
    if leader is None:
        return f"neither is ahead; for comparison, {PAPER}"
    return f"this {'agrees with' if leader == 'BERT' else 'is the reverse of'} {PAPER}"


def against_the_paper(pt: list[float], bert: list[float], name: str = "PT") -> str:
    """The ranking so far (the last epoch both curves have) beside the PT paper's converged one."""
    common = min(len(pt), len(bert))
    if common == 0:
        return f"No common epoch yet; {PAPER}."
    ahead = leader(pt[common - 1], bert[common - 1])
    figures = f"{ppl(pt[common - 1])} PT vs {ppl(bert[common - 1])} BERT"
    return f"{name}: at epoch {common}, {f'{ahead} is ahead' if ahead else 'a tie'} ({figures}): {verdict(ahead)}."


def plus_minus(mean: float, sd: float | None) -> str:
    return ppl(mean, decimals=2) + (f" ± {ppl(sd, decimals=2)}" if sd is not None else " (one seed)")


def final_best(rows: list[dict], config: str) -> tuple[float, float | None] | None:
    """The best validation perplexity's mean and sd over ``config``'s seeds once every seed has
    finished (a diverged one too: early stopping keeps its best epoch, before it diverged),
    else None: a mean over the seeds finished so far is no final number."""
    seeds = [r for r in rows if r["config"] == config]
    if not seeds or not all(r["finished"] and r["best_perplexity"] is not None for r in seeds):
        return None
    bests = [r["best_perplexity"] for r in seeds]
    return statistics.mean(bests), statistics.stdev(bests) if len(bests) > 1 else None  # n − 1, as the paper's


def arm_result(rows: list[dict], config: str) -> str:
    """``config``'s final best perplexity, mean ± sd and each seed's best with its epoch, or
    that it is still in progress."""
    seeds = [r for r in rows if r["config"] == config]
    if not all(r["finished"] for r in seeds):
        each = "; ".join(
            f"s{r['seed']} {r['status']}" + (f", diverged at epoch {r['diverged_at']}" if r["diverged_at"] else "")
            for r in seeds
        )
        return f"{config}: in progress ({each}): no final number until every seed has finished."
    unmeasured = [f"s{r['seed']}" for r in seeds if r["best_perplexity"] is None]
    if unmeasured:
        return f"{config}: finished, but {', '.join(unmeasured)} has no finite validation perplexity: no mean."
    each = "; ".join(
        f"s{r['seed']} {ppl(r['best_perplexity'], decimals=2)} at epoch {r['best_epoch']}"
        + (f", diverged at epoch {r['diverged_at']}: its best, before that, stands" if r["diverged_at"] else "")
        for r in seeds
    )
    best = plus_minus(*final_best(rows, config))
    return f"{config}: final best validation perplexity {best} (mean ± sample sd over {len(seeds)} seeds; {each})."


def final_against_the_paper(rows: list[dict], pt: str, bert: str = "bert-small") -> str:
    """The final ranking of ``pt`` and ``bert`` (their best perplexities' means over seeds, every
    seed finished) beside the paper's: who is ahead and by what percentage."""
    (pt_mean, pt_sd), (bert_mean, bert_sd) = final_best(rows, pt), final_best(rows, bert)
    figures = f"{plus_minus(pt_mean, pt_sd)} {pt} vs {plus_minus(bert_mean, bert_sd)} {bert}"
    diverged = [f"{r['config']} s{r['seed']}" for r in rows if r["config"] in (pt, bert) and r["diverged_at"]]
    if diverged:  # its best, before it diverged, is in the mean: a reader should know
        figures += f"; {', '.join(diverged)} diverged, its best before that counted"
    ahead = leader(pt_mean, bert_mean)
    if ahead is None:
        return f"{pt}, final: a tie ({figures}): {verdict(None)}."
    behind = "PT" if ahead == "BERT" else "BERT"
    percent = 100 * (max(pt_mean, bert_mean) / min(pt_mean, bert_mean) - 1)
    spreads = [sd for sd in (pt_sd, bert_sd) if sd is not None]
    if spreads and abs(pt_mean - bert_mean) <= max(spreads):  # a gap this small agrees with no ranking
        return (
            f"{pt}, final: neither is clearly ahead: {ahead}'s mean best perplexity is the lower, {behind}'s "
            f"{percent:.1f}% higher ({figures}), a gap no larger than a seed's standard deviation "
            f"({ppl(max(spreads), decimals=2)}): too small to rank with {sum(r['config'] == pt for r in rows)} "
            f"seeds; for comparison, {PAPER}."
        )
    ranked = f"{ahead} is ahead, {behind}'s best perplexity {percent:.1f}% higher ({figures})"
    return f"{pt}, final: {ranked}: {verdict(ahead)}."


def at_their_better_rates(rows: list[dict], models: dict[str, str]) -> str | None:
    """Each model at its arm of the lowest final mean (``models``: arm name -> model), best
    first, once every seed of every arm has finished; None before (no partial ranking)."""
    finals = {name: final_best(rows, name) for name in models}
    if not finals or any(result is None for result in finals.values()):
        return None
    chosen: dict[str, str] = {}
    for name, model in models.items():
        if model not in chosen or finals[name][0] < finals[chosen[model]][0]:
            chosen[model] = name
    ranked = sorted(chosen.values(), key=lambda name: finals[name][0])
    listed = "; ".join(f"{name} {plus_minus(*finals[name])}" for name in ranked)
    return f"Each model at its better learning rate, the lowest final best perplexity first: {listed}."
