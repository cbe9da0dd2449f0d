"""The structure study's markdown tables (docs/benchmarks.md) from its results
(docs/benchmarks/structure.json): the gold heads' offsets, the UAS runs against their
series' full-root baseline, and the ACT sweep with N(t) by UPOS tag and by training
frequency (``benchmarks/structure.py --report`` prints them)."""

from __future__ import annotations

from benchmarks.structure_runs import ACT_RUNS, UAS_RUNS


def report(results: dict) -> str:
    """The markdown tables of docs/benchmarks.md from the results."""
    runs, gold, lines = results.get("runs", {}), results.get("gold"), []
    if gold:
        lines += [
            f"Gold heads on EWT dev ({gold['words']:,} words): ROOT {gold['root']:.3f}, previous word "
            f"{gold['previous_word']:.3f}, next word {gold['next_word']:.3f}, either neighbour "
            f"{gold['adjacent_either_side']:.3f}"
            + (
                f"; positional rules: next word else (last word) previous word {gold['next_else_previous']:.3f}, "
                f"next word else ROOT {gold['next_else_root']:.3f}"
                if "next_else_previous" in gold
                else ""
            )
            + "; ceiling of a topology reaching distance <= k or ROOT: "
            + ", ".join(f"{name} {value:.3f}" for name, value in gold["ceiling"].items()),
            "",
        ]

    def base_of(name: str) -> float | None:  # each series against its own full-root seed-0 run
        base = "mlm-tuned-full-root" if name.startswith("mlm-tuned-") else "mlm-full-root"
        return runs.get(base, {}).get("valid", {}).get("perplexity")

    if "unigram_mlm" in results:
        unigram = results["unigram_mlm"]
        lines += [
            f"Context-free reference: the training unigram (add-one) on the same {unigram['tokens']:,} masked "
            f"words has masked perplexity {unigram['perplexity']:,.1f}.",
            "",
        ]
    lines += [
        "| run | topology / prior | task metric | vs its series' full-root | UAS best channel | UAS mean | "
        "best channel's heads: ROOT / relay / previous / next / farther | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in UAS_RUNS:
        row = runs.get(name)
        if row is None:
            continue
        valid, uas = row["valid"], row["uas"]
        prior = row["topology"].replace("|", "\\|") + (
            " + span (learned: " + ", ".join(f"{s:.1f}" for s in row["learned_spans"]) + ")"
            if "learned_spans" in row
            else " + learned distance bias (shared form)"
            if "shared" in name
            else ""
        )
        if "perplexity" in valid:
            metric = f"perplexity {valid['perplexity']:,.1f}"
            base = base_of(name)
            versus = f"{100 * (valid['perplexity'] / base - 1):+.1f}%" if base else "—"
        else:
            metric, versus = f"UPOS {valid['accuracy']:.3f}", "—"
        destinations = row["head_destinations"]
        if isinstance(destinations, list):  # the first runs' record: ROOT was their only virtual node
            destinations = {"per_channel": [{**d, "other_virtual": 0.0} for d in destinations]}
        scores = destinations.get("uas_root_only", uas["per_channel"])
        best = max(range(len(scores)), key=lambda c: scores[c])
        heads = destinations["per_channel"][best]
        kinds = ("root", "other_virtual", "previous_word", "next_word", "farther")
        where = " / ".join(f"{heads[k]:.2f}" for k in kinds)
        lines.append(
            f"| {name} | {prior} | {metric} | {versus} | {max(scores):.3f} | {sum(scores) / len(scores):.3f} | "
            f"{where} | "
            f"{row['tokens_per_second']:,.0f} |"
        )
    if any(name in runs for name in UAS_RUNS):
        anyone = next(runs[name]["uas"] for name in UAS_RUNS if name in runs)
        lines += [
            "",
            f"Baselines on the same words: next word {anyone['right_neighbour_baseline']:.3f}, "
            f"previous word {anyone['left_neighbour_baseline']:.3f}.",
        ]
    act = [runs[name] for name in ACT_RUNS if name in runs]
    if act:
        lines += [
            "",
            "| tau | UPOS accuracy | mean N | sd | min | max | share not at the mode | mean ponder N + R | "
            "eta² of N by UPOS | sd of N + R | eta² of N + R by UPOS | first halting weight: mean, sd | tokens/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in act:
            d = row["depth"]
            lines.append(
                f"| {row['ponder_cost']:g} | {row['valid']['accuracy']:.3f} | {d['iterations_mean']:.3f} | "
                f"{d['iterations_sd']:.3f} | {d['iterations_min']:.0f} | {d['iterations_max']:.0f} | "
                f"{d['share_not_at_mode']:.4f} | {d['ponder_mean']:.3f} | {d['eta_squared_upos']:.3f} | "
                f"{d['ponder_sd']:.3f} | {d['ponder_eta_squared_upos']:.3f} | "
                + (
                    f"{d['first_weight_mean']:.3f}, {d['first_weight_sd']:.3f} | "
                    if "first_weight_mean" in d
                    else "— | "
                )
                + f"{row['tokens_per_second']:,.0f} |"
            )
        for key, title in (("by_upos", "UPOS"), ("by_train_frequency", "training count of the word")):
            groups = list(act[0]["depth"][key])
            lines += [
                "",
                f"| mean N (mean N + R) by {title} (words) | "
                + " | ".join(f"tau {row['ponder_cost']:g}" for row in act)
                + " |",
                "|---|" + "---|" * len(act),
            ]
            for group in groups:
                words = act[0]["depth"][key][group]["words"]
                cells = " | ".join(
                    f"{row['depth'][key][group]['iterations']:.2f} ({row['depth'][key][group]['ponder']:.3f})"
                    for row in act
                )
                lines.append(f"| {group} ({words:,}) | {cells} |")
    return "\n".join(lines)
