"""`python -m sim serve --port P` (one simulated vLLM pod), `python -m sim fleet ...`, or
`python -m sim kubeapi ...` (a simulated Kubernetes API server)."""

from __future__ import annotations

import sys

from sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
