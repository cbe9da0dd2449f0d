"""The structure study's runs (benchmarks/structure.py): the results file, the config folder
(configs/structure/<name>.toml), the UAS runs (locality priors, seeds, the shared form,
the tuned series) and the ACT ponder-cost sweep, in the order the study runs and reports
them."""

from __future__ import annotations

from pathlib import Path

OUT = Path("docs/benchmarks/structure.json")
CONFIGS = Path("configs/structure")
PRIORS = ("full-root", "window1-root", "window2-root", "window3-root", "span-root")
UAS_RUNS = [f"{task}-{prior}" for task in ("mlm", "pos") for prior in PRIORS]
UAS_RUNS += ["mlm-star-root"]  # a ring of neighbours and a relay node that carries context
UAS_RUNS += ["mlm-full-root-seed1", "mlm-window1-root-seed1", "mlm-star-root-seed1"]  # one seed's noise
# the shared ternary form's learned distance prior (a bias per distance group and channel)
UAS_RUNS += ["mlm-shared-root", "mlm-shared-root-seed1", "mlm-shared16-root"]
# the tuned series: μP and the PTB sweep's best PT lr (3e-2), against its own full-root baseline
TUNED = ("full-root", "full-root-seed1", "window1-root", "window1-root-seed1", "window2-root", "window3-root")
TUNED += ("star-root", "shared-root")
UAS_RUNS += [f"mlm-tuned-{prior}" for prior in TUNED]
ACT_RUNS = ["act-tau-0", "act-tau-1e-3", "act-tau-1e-2", "act-tau-1e-1", "act-tau-3e-1"]
