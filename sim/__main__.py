"""`python -m sim serve --port P` (one simulated vLLM pod) or `python -m sim fleet ...`."""

from __future__ import annotations

import sys

from sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
