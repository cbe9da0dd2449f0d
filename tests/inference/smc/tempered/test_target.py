"""The tempered target (inference.smc.tempered.target): its log joint is the oracle's log
potential."""

import pytest
import torch

import inference
from inference.smc.tempered.target import compile_target
from tests import oracles
from tests.builders import tempered_case as make_case

pytestmark = pytest.mark.usefixtures("one_thread")


def test_target_log_joint_is_the_oracle_log_potential():
    crf, tokens, mask = make_case("global")
    exact = inference.Exact(crf)(tokens, mask)
    target = compile_target(crf, tokens, mask, exact, 1e-6, 1)
    z, h, g = target.sample_proposal(5, torch.Generator().manual_seed(0))
    mine = target.log_gamma(z, h, g)
    for b in range(2):
        for p in range(5):
            row = tokens[b].tolist()
            expected = oracles.log_potential(
                crf, row, mask[b].tolist(), z[b, p].tolist(), h[b, p].tolist(), g[b, p].tolist()
            )
            assert mine[b, p].item() == pytest.approx(expected, abs=1e-9)
