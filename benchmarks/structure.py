"""Structure that means something. Two studies on UD English-EWT, every run one
epoch of EWT train (392 steps of 32 sentences), seed 0, configs in configs/structure/:

- UAS: do locality priors (``window(k) | root()`` topologies, a learned adaptive span)
  make the PT's argmax heads beat the right-neighbour baseline on EWT dev, at no more
  than +2% masked perplexity? MLM-trained (``mlm-*``) and UPOS-trained (``pos-*``) PTs.
  Beside the library's UAS (``evaluate --task uas``) each run records where its argmax
  heads go (ROOT, previous word, next word, farther), and the study records what the
  gold trees allow: the share of gold heads at each offset and the ceiling of a
  topology that only reaches distance k (or ROOT).
- ACT (``act-tau-*``): UPOS tagging with ``halting = "act"`` over at most 6 iterations,
  ponder cost tau on a log grid; per run the tagging accuracy and, on EWT dev, the
  per-token number of iterations N(t): mean, sd, min, max, share off the mode, and its
  mean by UPOS tag and by training-frequency bucket of the word.

    PROBFORMER_EWT=/path/to/ud-english-ewt .venv/bin/python benchmarks/structure.py
    .venv/bin/python benchmarks/structure.py --only mlm-full-root,mlm-window1-root
    .venv/bin/python benchmarks/structure.py --report

Resumable: a run already in docs/benchmarks/structure.json is skipped (``--rerun`` to
redo it); the file is rewritten after every run. Runs go to runs/structure/<config>.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch

OUT = Path("docs/benchmarks/structure.json")
CONFIGS = Path("configs/structure")
PRIORS = ("full-root", "window1-root", "window2-root", "window3-root", "span-root")
UAS_RUNS = [f"{task}-{prior}" for task in ("mlm", "pos") for prior in PRIORS]
UAS_RUNS += ["mlm-star-root"]  # a ring of neighbours and a relay node that carries context
UAS_RUNS += ["mlm-full-root-seed1", "mlm-window1-root-seed1", "mlm-star-root-seed1"]  # one seed's noise
# the shared ternary form's learned distance prior (a bias per distance group and channel)
UAS_RUNS += ["mlm-shared-root", "mlm-shared-root-seed1", "mlm-shared16-root"]
# the tuned series: μP and the PTB sweep's best PT lr (3e-2), against its own full-root baseline
TUNED = ("full-root", "full-root-seed1", "window1-root", "window1-root-seed1", "window2-root", "window3-root")
TUNED += ("star-root", "shared-root")
UAS_RUNS += [f"mlm-tuned-{prior}" for prior in TUNED]
ACT_RUNS = ["act-tau-0", "act-tau-1e-3", "act-tau-1e-2", "act-tau-1e-1", "act-tau-3e-1"]
FREQUENCY_BUCKETS = [(0, 0), (1, 9), (10, 99), (100, 999), (1000, 10**9)]  # training counts of the word


def gold_offsets(trees) -> dict:
    """What the gold trees allow: the share of words whose head is ROOT, the previous word,
    the next word, and the ceiling of a topology reaching only distance <= k (or ROOT)."""
    words = root = previous = following = last_to_previous = last_to_root = 0
    within = Counter()
    for tree in trees:
        for position, head in enumerate(tree.heads, start=1):
            words += 1
            root += head == 0
            previous += head == position - 1 and head > 0
            following += head == position + 1
            if head > 0:
                within[abs(head - position)] += 1
        if tree.heads:  # the last word has no next word: the positional rules' fallbacks
            last = len(tree.heads)
            # (a one-word sentence's only head is ROOT)
            last_to_previous += tree.heads[-1] == (last - 1 if last > 1 else 0)
            last_to_root += tree.heads[-1] == 0
    ceiling = {f"window({k}) | root()": (root + sum(within[d] for d in range(1, k + 1))) / words for k in (1, 2, 3)}
    return {
        "words": words,
        "root": root / words,
        "previous_word": previous / words,
        "next_word": following / words,
        "adjacent_either_side": (previous + following) / words,
        # positional rules, no learning: every word's head is the next word, and the last
        # word's (which has none) the previous word (ROOT in a one-word sentence), or ROOT. A
        # window(k) topology without a root arc for the last word leaves it only leftward heads:
        # the first rule is what such a model's "next word" channel scores, so it is the
        # baseline a learned channel must beat
        "next_else_previous": (following + last_to_previous) / words,
        "next_else_root": (following + last_to_root) / words,
        "ceiling": ceiling,
    }


@torch.no_grad()
def unigram_mlm(run: Path) -> dict:
    """Masked perplexity of a context-free model on exactly the trainer's validation masks
    (``evaluate_model``, fixed mask seed): every masked word predicted by its training
    unigram frequency (add-one). What an MLM at this budget must beat to use context."""
    from probformer.training import run_config
    from probformer.training.corpus import prepare_corpus
    from probformer.training.evaluate import load_any
    from probformer.training.validation import evaluate_model

    _, vocabulary = load_any(run)
    config = run_config.load(CONFIGS / "mlm-full-root.toml")
    corpus = prepare_corpus(config.data, vocabulary)
    counts = torch.ones(len(vocabulary))
    for ids, _ in corpus.train:
        counts += torch.bincount(torch.tensor(ids), minlength=len(vocabulary))

    class Unigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.log_probabilities = torch.nn.Parameter((counts / counts.sum()).log())

        def forward(self, tokens, mask):
            return self.log_probabilities.expand(*tokens.shape, -1), None

    return evaluate_model(Unigram(), corpus.valid, "mlm", len(vocabulary))


@torch.no_grad()
def head_destinations(model, vocabulary, trees, batch_size: int = 32) -> dict:
    """Per channel, where the argmax head of each word goes: ROOT, another virtual node (a
    Star relay), the previous word, the next word, farther (shares of the words). The UAS
    itself is ``evaluate --task uas``'s (which counts only the ROOT node as root; rows
    written before that fix carry their own ``uas_root_only``)."""
    model.eval()
    virtual = model.crf.topology.virtual
    root = virtual.index("root") if "root" in virtual else None
    kinds_names = ("root", "other_virtual", "previous_word", "next_word", "farther")
    counts = torch.zeros(model.crf.channels, len(kinds_names))
    for start in range(0, len(trees), batch_size):
        chunk = trees[start : start + batch_size]
        n = max(len(t.words) for t in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        gold = torch.full((len(chunk), n), -1, dtype=torch.long)
        for row, tree in enumerate(chunk):
            tokens[row, : len(tree.words)] = torch.tensor(vocabulary.encode(tree.words))
            gold[row, : len(tree.words)] = torch.tensor(tree.heads)
        mask = gold >= 0
        choice = model(tokens, mask)[1].h[:, :, :n, :].argmax(-1)  # [B, C, n], node index
        offset = choice - torch.arange(n)
        to_root = choice == (n + root if root is not None else -1)
        token = choice < n  # choice = i + 1 may be the first virtual node at the batch's last position
        kinds = [to_root, ~token & ~to_root, offset == -1, token & (offset == 1), token & (offset.abs() > 1)]
        counts += (torch.stack(kinds, -1) & mask[:, None, :, None]).sum((0, 2)).float()
    shares = counts / counts.sum(-1, keepdim=True)
    return {"per_channel": [dict(zip(kinds_names, row.tolist())) for row in shares]}


@torch.no_grad()
def depth_by_token(model, vocabulary, trees, train_counts: Counter, batch_size: int = 32) -> dict:
    """ACT's per-token iterations N(t) on ``trees``: spread, and means by UPOS tag and by
    the word's training frequency."""
    model.eval()
    updates, ponder, first, tags, frequencies = [], [], [], [], []
    for start in range(0, len(trees), batch_size):
        chunk = trees[start : start + batch_size]
        n = max(len(t.words) for t in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.bool)
        for row, tree in enumerate(chunk):
            tokens[row, : len(tree.words)] = torch.tensor(vocabulary.encode(tree.words))
            mask[row, : len(tree.words)] = True
            tags.extend(tree.upos)
            frequencies.extend(train_counts[w] for w in tree.words)
        halting = model(tokens, mask)[1].halting
        updates.append(halting["updates"][:, :n][mask])
        ponder.append(halting["ponder"][:, :n][mask])
        first.append(halting["weights"][0][:, :n][mask])  # w_1: p_1, or 1 where a token halts at once
    steps, ponder, first = torch.cat(updates), torch.cat(ponder), torch.cat(first)
    mode = int(steps.mode().values)
    by_tag = {}
    for tag in sorted(set(tags)):
        chosen = torch.tensor([t == tag for t in tags])
        by_tag[tag] = {
            "words": int(chosen.sum()),
            "iterations": float(steps[chosen].mean()),
            "ponder": float(ponder[chosen].mean()),
        }
    by_frequency = {}
    frequency = torch.tensor(frequencies)
    for low, high in FREQUENCY_BUCKETS:
        chosen = (frequency >= low) & (frequency <= high)
        if chosen.any():
            name = f"{low}-{high}" if high < 10**9 else f">={low}"
            by_frequency[name] = {
                "words": int(chosen.sum()),
                "iterations": float(steps[chosen].mean()),
                "ponder": float(ponder[chosen].mean()),
            }
    return {
        "words": int(steps.numel()),
        "iterations_mean": float(steps.mean()),
        "iterations_sd": float(steps.std()),
        "iterations_min": float(steps.min()),
        "iterations_max": float(steps.max()),
        "iterations_mode": mode,
        "share_not_at_mode": float((steps != mode).float().mean()),
        "ponder_mean": float(ponder.mean()),
        "ponder_sd": float(ponder.std()),
        "first_weight_mean": float(first.mean()),
        "first_weight_sd": float(first.std()),
        "first_weight_min": float(first.min()),
        "first_weight_max": float(first.max()),
        # the share of the variance of N(t) between UPOS tags (correlation ratio eta^2; 0 when N is constant)
        "eta_squared_upos": _between_share(steps, tags),
        "ponder_eta_squared_upos": _between_share(ponder, tags),
        "by_upos": by_tag,
        "by_train_frequency": by_frequency,
    }


def _between_share(values: torch.Tensor, groups: list[str]) -> float:
    total = float(((values - values.mean()) ** 2).sum())
    if total == 0:
        return 0.0
    between = 0.0
    for group in set(groups):
        chosen = torch.tensor([g == group for g in groups])
        between += int(chosen.sum()) * float(values[chosen].mean() - values.mean()) ** 2
    return between / total


def run_one(name: str, steps: int = 0) -> dict:
    from probformer.training import run_config
    from probformer.training.trainer import train

    config = run_config.load(CONFIGS / f"{name}.toml")
    if steps:  # --smoke: a short check of the script, never recorded
        import dataclasses

        config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))
    run = Path("runs/structure") / name
    if run.exists():
        import shutil

        shutil.rmtree(run)
    started = time.time()
    summary = train(config, run, progress=False)
    row = {**summary, "command": f"probformer train --config {CONFIGS}/{name}.toml"}
    row.update(analyse(name, run))
    row["wall_seconds"] = time.time() - started
    return row


def analyse(name: str, run: Path, uas: bool = True) -> dict:
    """What a trained run's heads or halting did on EWT dev (``uas=False``: not the
    library's UAS again)."""
    from probformer.training import data, run_config
    from probformer.training.evaluate import evaluate, load_any

    config = run_config.load(CONFIGS / f"{name}.toml")
    row = {"topology": config.model["topology"]}
    model, vocabulary = load_any(run)
    dev = data.read_conllu(data.ewt_path("dev"))
    if name.startswith("act-"):
        train_counts = Counter(w for tree in data.read_conllu(data.ewt_path("train")) for w in tree.words)
        row["depth"] = depth_by_token(model, vocabulary, dev, train_counts)
        row["ponder_cost"] = config.model["ponder_cost"]
    else:
        if uas:
            row["uas"] = evaluate(run, "uas", "ewt")
        row["head_destinations"] = head_destinations(model, vocabulary, dev)
        if model.mean_field.span is not None:
            row["learned_spans"] = model.mean_field.spans().tolist()
    return row


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated config names (default: every run)")
    parser.add_argument("--rerun", action="store_true", help="redo runs already in the results")
    parser.add_argument("--report", action="store_true", help="print the markdown tables and exit")
    parser.add_argument("--reanalyse", action="store_true", help="redo the analysis of finished runs, no training")
    parser.add_argument("--smoke", type=int, default=0, help="a check of the script: N steps, results to /tmp")
    args = parser.parse_args()
    out = Path("/tmp/structure-smoke.json") if args.smoke else OUT
    results = json.loads(out.read_text()) if out.is_file() and not args.smoke else {}
    if args.report:
        print(report(results))
        return
    torch.set_num_threads(1)
    from probformer.training import data

    results["gold"] = gold_offsets(data.read_conllu(data.ewt_path("dev")))  # cheap, and new rules land
    names = args.only.split(",") if args.only else UAS_RUNS + ACT_RUNS
    if args.reanalyse:
        for name in names:
            if name in results.get("runs", {}):
                results["runs"][name].update(analyse(name, Path("runs/structure") / name, uas=False))
                out.write_text(json.dumps(results, indent=1))
        return
    if "unigram_mlm" not in results and (Path("runs/structure/mlm-full-root") / "model").is_dir():
        results["unigram_mlm"] = unigram_mlm(Path("runs/structure/mlm-full-root"))
    for name in names:
        if name in results.get("runs", {}) and not args.rerun:
            continue
        row = run_one(name, args.smoke)
        row["code"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        results.setdefault("runs", {})[name] = row
        print(json.dumps({k: v for k, v in row.items() if k not in ("depth", "head_destinations")}), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
