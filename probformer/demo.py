"""``make demo``: the oracles agree on a real sentence, then a small Probabilistic
Transformer learns masked-word prediction on a slice of the Penn Treebank."""

from __future__ import annotations

import math
import time

import torch

import graphs
import inference
import probformer as pf
from probformer import data


def oracles_on_a_sentence(sentence: list[str]) -> None:
    torch.manual_seed(0)
    vocab = data.Vocabulary.build([sentence])
    tokens = torch.tensor([vocab.encode(sentence)])
    crf = graphs.CRF(vocab_size=len(vocab), labels=3, channels=1, rank=2, topology="window(2)").double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(1.5)
        exact = inference.Exact(crf).marginals(tokens)
        mean_field = inference.MeanField(crf, iterations=30, schedule="sequential")(tokens)
    gibbs = inference.Gibbs(crf, num_samples=2000, num_warmup=300).sample(tokens)
    print(f"sentence: {' '.join(sentence)!r}  (CRF: d=3 labels, window(2) heads)")
    print(f"  exact log Z               {exact.log_partition.item():9.4f}   (Pyro enumeration)")
    print(
        f"  mean-field ELBO           {mean_field.elbo.item():9.4f}   (<= log Z; KL = "
        f"{(exact.log_partition - mean_field.elbo).item():.4f})"
    )
    error = (gibbs.marginals.z - exact.z.detach()).abs().max().item()
    print(f"  Gibbs |q(Z) - exact| max  {error:9.4f}   (NumPyro, R-hat {gibbs.rhat:.3f})")


def train_small_pt(seconds: float = 60.0) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    train = [s for s in data.ptb_sentences("train") if len(s) <= 30][:6000]
    valid = [s for s in data.ptb_sentences("valid") if len(s) <= 30][:400]
    vocab = data.Vocabulary.build(train)
    config = pf.PTConfig(vocab_size=len(vocab), labels=64, channels=4, rank=16, iterations=3, dropout=0.1)
    model = pf.ProbabilisticTransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def validation_perplexity() -> float:
        model.eval()
        total, count = 0.0, 0
        g = torch.Generator().manual_seed(313)
        with torch.no_grad():
            for tokens, mask in data.batches(valid, vocab, 64, 30):
                inputs, targets = data.mask_tokens(tokens, mask, len(vocab), generator=g)
                logits, _ = model(inputs, mask)
                loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="sum")
                total, count = total + loss.item(), count + (targets != -100).sum().item()
        model.train()
        return math.exp(total / count)

    params = sum(p.numel() for p in model.parameters())
    print(
        f"\nProbabilistic Transformer d=64 C=4 r=16 T=3 ({params / 1e6:.2f}M parameters), PTB slice of "
        f"{len(train)} sentences, vocabulary {len(vocab)}"
    )
    print(f"  validation masked-token perplexity before training: {validation_perplexity():8.1f}")
    start, steps, seen = time.time(), 0, 0
    while time.time() - start < seconds:
        for tokens, mask in data.batches(train, vocab, 32, 30, shuffle=True, generator=generator):
            inputs, targets = data.mask_tokens(tokens, mask, len(vocab), generator=generator)
            logits, _ = model(inputs, mask)
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            steps, seen = steps + 1, seen + int(mask.sum())
            if time.time() - start > seconds:
                break
    elapsed = time.time() - start
    print(f"  trained {steps} steps in {elapsed:.0f} s ({seen / elapsed:.0f} tokens/s)")
    print(f"  validation masked-token perplexity after training:  {validation_perplexity():8.1f}")


def main(seconds: float = 60.0) -> int:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    oracles_on_a_sentence(data.ptb_sentences("valid")[7][:6])
    train_small_pt(seconds)
    return 0
