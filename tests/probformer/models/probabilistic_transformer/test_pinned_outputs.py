"""The PT's outputs are pinned across the declaration refactoring.

tests/data/pt_outputs_bf4904d.safetensors was written by the code of commit bf4904d, the last
commit before factor templates (graphs.factors, CRF(factors=...), the declared Pyro model,
engines compiling templates): three float64 PTs' weights, one padded batch, and their task
logits and label marginals. Today's code, given the same configs and weights, must give the
same numbers to float64 round-off (bit for bit when this file was written; since the kernels'
later rewrites reorder sums and products, within a relative 1e-13). The configs cover both
kernels, async and parallel schedules, μP, a virtual ROOT node, a global variable and
window / causal topologies.
"""

import pytest
import torch
from safetensors.torch import load_file

from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

PINNED = "tests/data/pt_outputs_bf4904d.safetensors"


CONFIGS = {
    "reference": dict(
        vocab_size=40, labels=16, channels=2, rank=4, global_labels=8, gamma=2, iterations=3,
        topology="full | root()", dropout=0.0,
    ),
    "mup_parallel_window": dict(
        vocab_size=40, labels=16, channels=4, rank=4, gamma=1, iterations=3, topology="window(2)",
        schedule="parallel", mup=True, mup_base_width=8, dropout=0.0,
    ),
    "fused_causal": dict(
        vocab_size=40, labels=16, channels=2, rank=4, gamma=3, iterations=2, topology="causal",
        kernel="fused", dropout=0.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_pt_gives_the_outputs_it_gave_before_factor_templates(name):
    torch.set_num_threads(1)
    pinned = load_file(PINNED)
    model = ProbabilisticTransformer(PTConfig(**CONFIGS[name])).double().eval()
    prefix = f"{name}/weights/"
    weights = {key[len(prefix) :]: value for key, value in pinned.items() if key.startswith(prefix)}
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        logits, posterior = model(pinned["tokens"], pinned["mask"])
    torch.testing.assert_close(logits, pinned[f"{name}/logits"], rtol=1e-13, atol=1e-12)
    torch.testing.assert_close(posterior.z, pinned[f"{name}/z"], rtol=1e-13, atol=1e-12)
