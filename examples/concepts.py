"""The CRF <-> transformer correspondence on a 3-token sentence (docs/concepts.md).

Run: .venv/bin/python examples/concepts.py
"""

import torch

import graphs
import inference

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
words = ["the", "cat", "sat"]
tokens = torch.tensor([[0, 1, 2]])

# 1. Declare: d = 2 labels per token, C = 1 channel, rank 2, every token may head every other.
crf = graphs.CRF(vocab_size=3, labels=2, channels=1, rank=2, topology="full", gamma=1)
print("factor graph arcs (dependent -> possible head):", sorted(crf.topology.graph(3).edges))
print("ternary table [C, n, n, d, d]:", tuple(crf.ternary_table(3).shape), "(-inf on the diagonal)")

# 2. The exact answer, by enumerating the Pyro model.
exact = inference.Exact(crf).marginals(tokens)
print(f"exact log Z = {exact.log_partition.item():.4f}")
print("exact head marginals q(H_i = j):\n", exact.h[0, 0].detach())

# 3. One mean-field iteration, written out as a transformer layer.
with torch.no_grad():
    hidden = crf.unary[tokens[0]].softmax(-1)  # q(Z_i): the token states
    groups = crf.distance_groups(3)  # relative position of each (i, j): 4 groups for gamma = 1
    U, V = crf.ternary_u[:, 0], crf.ternary_v[:, 0]  # per group [d, r]: query and key projections
    queries = torch.einsum("id,kdr->kir", hidden, U)
    keys = torch.einsum("jd,kdr->kjr", hidden, V)
    scores = torch.stack(
        [torch.stack([queries[groups[i, j], i] @ keys[groups[i, j], j] for j in range(3)]) for i in range(3)]
    )
    scores.fill_diagonal_(-float("inf"))  # no self-arcs
    attention = scores.softmax(-1)  # the head update IS attention
    print("attention = q(H_i = j) after one head update:\n", attention)
    messages = torch.zeros(3, 2)
    for i in range(3):
        for j in range(3):
            if i != j:
                k_ij, k_ji = groups[i, j], groups[j, i]
                messages[i] += attention[i, j] * (U[k_ij] @ keys[k_ij, j])  # values = keys; output = U^T
                messages[i] += attention[j, i] * (V[k_ji] @ queries[k_ji, j])  # transposed attention
    logits = crf.unary[tokens[0]] + messages  # residual: the input (unary) is injected every layer
    print("label logits after one layer:\n", logits)

    engine = inference.MeanField(crf, iterations=1)(tokens)
    print("inference.MeanField(iterations=1).logits equal:", torch.allclose(engine.logits[0], logits, atol=1e-6))

    converged = inference.MeanField(crf, iterations=50, schedule="sequential")(tokens)
    print(f"mean-field ELBO after 50 sweeps = {converged.elbo.item():.4f} <= log Z = {exact.log_partition.item():.4f}")
