"""Child processes for the tests that kill a training run mid-way.

They fork from a fork server, never from the test process: the test process may have
imported JAX (NumPyro's Gibbs oracle), whose threads make ``os.fork()`` of it unsafe
(JAX warns that the child may deadlock). The server is a fresh interpreter that imports
the trainer once (no JAX), so each child still starts in a fraction of a second."""

import multiprocessing

PRELOAD = ["probformer.training.trainer", "probformer.training.crash_points"]


def fork_context():
    """A ``multiprocessing`` context whose children fork from a JAX-free server."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
