import pytest
import torch


@pytest.fixture
def one_thread():
    """One thread and a forked RNG for the test (``pytestmark = pytest.mark.usefixtures
    ("one_thread")``): its draws leave the global generator as they found it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def keep_global_rng():
    """Torch's global RNG given back as it was, for tests that seed it
    (``pytestmark = pytest.mark.usefixtures("keep_global_rng")``): tests which run later and
    draw from it (tests/inference/smc/filter/) see what they saw without them."""
    with torch.random.fork_rng():
        yield
