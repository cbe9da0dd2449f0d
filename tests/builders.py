"""CRFs, batches, run configs, folders and kernel inputs that more than one test file builds the same way."""

import json
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import graphs
from inference.mean_field.kernels.head_kernels import HeadStructure


def shared_crf(labels=3, channels=2, rank=2, gamma=1, topology="full", global_labels=0, seed=0, bias_std=1.0):
    """A float64 CRF in the shared ternary form, seeded, with its per-group bias drawn from
    N(0, bias_std) (it starts at zero, which would hide the bias from a test)."""
    torch.manual_seed(seed)
    crf = graphs.CRF(
        vocab_size=7,
        labels=labels,
        channels=channels,
        rank=rank,
        gamma=gamma,
        topology=topology,
        global_labels=global_labels,
        ternary_form="shared",
    ).double()
    with torch.no_grad():
        crf.shared_bias.normal_(0.0, bias_std)
    return crf


def head_kernel_problem(kernel: str, topology="full | root()", n=40, seed=0):
    """A padded batch's head structure and bfloat16-valued projections (scores up to ~430)
    for one head kernel, seeded."""
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=4, topology=topology, gamma=2)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 2 :] = False
    structure = HeadStructure(
        n=n,
        gamma=crf.gamma,
        nodes=crf.node_mask(mask),
        token_arcs=crf.topology.mask(n)[:n, :n],
        arcs=crf.arc_mask(mask),
        band=crf.topology.band,
    )
    groups = 1 if kernel == "shared" else crf.num_groups
    N = structure.nodes.shape[1]
    # scores up to ~430: projections of norm ~sqrt(430 / scale) per head, in bfloat16 numbers
    projections = [(6.0 * torch.randn(2, N, groups, 2, 4)).bfloat16().float() for _ in range(4)]
    return structure, projections


# A probformer run config for the trainer and the CLI: a tiny PT on PTB-like data, a few steps.
TINY_PT_RUN = """
[model]
kind = "probabilistic_transformer"
labels = 16
channels = 2
rank = 4
iterations = 2
dropout = {dropout}
mup = true

[data]
source = "{source}"
task = "{task}"
train_sentences = 96
valid_sentences = 24
max_length = {max_length}
vocabulary = 400

[train]
batch_size = 8
lr = 3e-3
warmup_steps = 2
steps = {steps}
checkpoint_every = 2
eval_every = 4
eval_sentences = 8
log_every = 1
threads = 1
"""


# Every model kind, tiny, for the laws over every kind: the laws do not depend on size.
VOCAB = 12
SMALL = dict(vocab_size=VOCAB, width=8, heads=2, ffn_width=16, dropout=0.0)
TINY_CONFIGS = {  # every kind, tiny: the law does not depend on size
    # rank 6 over 4 labels: computed at the label rank (projections.at_label_rank)
    "probabilistic_transformer": dict(vocab_size=VOCAB, labels=4, channels=2, rank=6, iterations=2),
    "particle_transformer": dict(layers=3, resample_every=1, resampling="copy", **SMALL),
    "transformer": dict(layers=2, **SMALL),
    "swarmformer": dict(layers=2, clusters=2, **SMALL),
    "folded_context": dict(segment=3, **SMALL),
}


@contextmanager
def unwritable(folder):
    """``folder``, created and made unwritable: read-only permissions, or (for root, whom
    permissions do not stop) the immutable attribute; skips where neither works."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    immutable = False
    try:
        try:
            (folder / ".probe").touch()
        except OSError:
            pass
        else:  # root: permissions do not apply
            (folder / ".probe").unlink()
            chattr = shutil.which("chattr")
            immutable = (
                bool(chattr) and subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode == 0
            )
            if not immutable:
                pytest.skip("cannot make a folder unwritable here (root, no chattr +i)")
        yield folder
    finally:
        if immutable:
            subprocess.run([shutil.which("chattr"), "-i", str(folder)], check=True)
        folder.chmod(0o755)


class FirstLastAgree(graphs.Factor):
    """A user factor: weight w when the first and the last real token share a label."""

    def __init__(self, weight=0.7):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(float(weight)))

    def log_potential(self, z, tokens, mask):
        last = mask.long().sum(1) - 1
        same = z[:, 0] == z.gather(1, last[:, None])[:, 0]
        return self.weight * same.to(self.weight.dtype)


def lgssm(dim, seed=0, steps=30):
    g = torch.Generator().manual_seed(seed)
    A = 0.9 * torch.eye(dim, dtype=torch.float64) + 0.05 * torch.randn(dim, dim, generator=g, dtype=torch.float64)
    Q = 0.5 * torch.eye(dim, dtype=torch.float64)
    H = torch.eye(dim, dtype=torch.float64) + 0.1 * torch.randn(dim, dim, generator=g, dtype=torch.float64)
    R = 0.3 * torch.eye(dim, dtype=torch.float64)
    m0, P0 = torch.zeros(dim, dtype=torch.float64), torch.eye(dim, dtype=torch.float64)
    x, ys = torch.randn(dim, generator=g, dtype=torch.float64), []
    for _ in range(steps):
        x = A @ x + Q.sqrt() @ torch.randn(dim, generator=g, dtype=torch.float64)
        ys.append(H @ x + R.sqrt() @ torch.randn(dim, generator=g, dtype=torch.float64))
    return torch.stack(ys), A, Q, H, R, m0, P0


class ParityBonus(graphs.Factor):
    """A user factor: a bonus when the first two labels agree (the sampler reads its
    log_potential alone; MeanField, the proposal, its expectation)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.7))

    def log_potential(self, z, tokens, mask):
        return self.weight * (z[:, 0] == z[:, 1]).to(self.weight.dtype)

    def expected_log_potential(self, q, tokens, mask):  # for the mean-field proposal only
        return self.weight * (q[:, 0] * q[:, 1]).sum(-1)


def tempered_case(kind: str):
    torch.manual_seed(3)
    factors, topology, global_labels = [], "full", 0
    if kind == "global":
        global_labels = 2
    elif kind == "pairwise":
        factors = [graphs.factors.Pairwise(3, "chain()")]
    elif kind == "user":
        factors = [ParityBonus()]
    elif kind == "virtual":
        topology = "full | root()"
    crf = graphs.CRF(
        vocab_size=9,
        labels=3,
        channels=2,
        rank=2,
        gamma=1,
        topology=topology,
        global_labels=global_labels,
        factors=factors,
    ).double()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    return crf, tokens, mask


def grouped_crf():
    return graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2)


def engine_options_crf(**overrides):
    torch.manual_seed(overrides.pop("seed", 0))
    options = dict(vocab_size=20, labels=6, channels=2, rank=3, global_labels=4, topology="window(3)")
    options.update(overrides)
    return graphs.CRF(**options)


def engine_options_batch(seed=0, size=3, length=7):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 20, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.bool)
    mask[1, length - 3 :] = False
    return tokens, mask


def padded_token_batch(size=3, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (size, length), generator=generator)
    lengths = torch.randint(1, length + 1, (size,), generator=generator)
    lengths[0] = length
    return tokens, torch.arange(length)[None] < lengths[:, None]


def head_structure_of(crf, mask, with_topology: bool = False):
    """The kernels' view of a batch, built from the CRF's own masks (no input checks, so
    whole padded sentences get through); ``with_topology``: the topology too (where a
    kernel reads its data, such as a segment length), beside its table. A topology whose rows
    have token arcs of their own length gets each row's table (``[B, n, n]``)."""
    n = mask.shape[1]
    arcs = crf.arc_mask(mask)
    token_arcs = arcs[:, :n, :n] if crf.topology.row_tokens else crf.topology.mask(n, mask.device)[:n, :n]
    return HeadStructure(
        n=n,
        gamma=crf.gamma,
        cuts=crf.distance_cuts,
        groups=crf.distance_groups(n, mask.device),
        arcs=arcs,
        nodes=crf.node_mask(mask),
        token_arcs=token_arcs,
        band=crf.topology.band,
        topology=crf.topology if with_topology else None,
    )


def flex_batch(topology, gamma, n, channels=2, seed=0, device="cpu"):
    """A structure with a full row, a padded suffix and a padded position that is not a
    suffix, and random projections ``[B, N, K, C, r]`` (peaked: near-uniform attention hides bugs)."""
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=channels, rank=3, topology=topology, gamma=gamma)
    mask = torch.ones(3, n, dtype=torch.bool, device=device)
    mask[1, max(1, n // 2) :] = False
    mask[2, n // 3] = n == 1
    structure = head_structure_of(crf, mask)
    N = structure.nodes.shape[1]
    projections = [3 * torch.randn(3, N, crf.num_groups, channels, 3, dtype=torch.float64) for _ in range(4)]
    return structure, [p.to(device) for p in projections]


def assert_grads_close(mine, true, rtol, atol):
    for tensor, expected in zip(mine, true):
        if tensor is None:
            continue
        got = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        want = expected.grad if expected.grad is not None else torch.zeros_like(got)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def assert_outputs_close(results, expected, rtol, atol):
    for result, true in zip(results, expected):
        torch.testing.assert_close(result, true, rtol=rtol, atol=atol)


def weighted_loss(results, names, weights, outputs):
    """A random linear function of the outputs named in ``outputs`` (their gradients then test
    every one of them alone and together)."""
    return sum((x * w).sum() for name, x, w in zip(names, results, weights) if name in outputs)


def write_tiny_run_config(tmp_path, name="run.toml", dropout=0.1, source="ptb", task="mlm", max_length=90, steps=8):
    """``TINY_PT_RUN`` written to ``tmp_path / name`` with these values filled in."""
    path = tmp_path / name
    path.write_text(TINY_PT_RUN.format(dropout=dropout, source=source, task=task, max_length=max_length, steps=steps))
    return path


def train_losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def last_is_head(n: int):
    """A topology as a function of the length n (``graphs.topology.from_callable``): every token
    may choose the sentence's last token, which chooses the first; arcs that move with n."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, n - 1) for i in range(n - 1))
    if n > 1:
        graph.add_edge(n - 1, 0)
    return graph
