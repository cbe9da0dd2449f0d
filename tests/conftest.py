import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Oversubscribed threads on 2 shared cores have made runs 50x slower.
torch.set_num_threads(1)

settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,  # CI sees the same examples every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")
