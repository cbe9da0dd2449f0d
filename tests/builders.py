"""CRFs that tests in more than one folder build the same way."""

import torch

import graphs


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
