"""``python -m benchmarks.reliability``: run the benchmark, write docs/reliability.md."""

import sys

from benchmarks.reliability import main

sys.exit(main())
