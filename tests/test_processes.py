"""The kill-and-resume tests' children never fork a process that holds JAX's threads."""

import os
import warnings

from tests.processes import fork_context


def test_children_start_without_forking_a_process_that_imported_jax():
    import jax.numpy as jnp

    assert float(jnp.ones(3).sum()) == 3.0  # JAX imported and its threads running here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        child = fork_context().Process(target=os.getpid)
        child.start()
        child.join(timeout=120)
    assert child.exitcode == 0
    assert [str(w.message) for w in caught if "fork" in str(w.message)] == []
    with warnings.catch_warnings(record=True) as caught:  # the control: forking here does warn
        warnings.simplefilter("always")
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    assert any("fork" in str(w.message) for w in caught)
