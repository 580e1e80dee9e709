"""The EPP's long-lived objects and the garbage collector.

CPython's cyclic collector runs on the thread that runs the event loop: a full
collection stalls every request for as long as it walks the containers it tracks.
Those of a started EPP (its modules, gRPC, the Kubernetes client, the config and
its services) live as long as the process or the config, yet every full collection
walked them all again, about 57,000 objects (docs/performance.md, "Garbage
collection"). `freeze` moves them to a generation no collection visits; what comes
later is collected as usual.

The price: the collector never frees a reference cycle that holds a frozen object,
even once nothing else reaches it. A config replaced by a reload is such garbage
(a service and the task running it refer to each other), so when one is retired,
`collect_retired` thaws everything, collects, and freezes what is still alive.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect, then put every object alive out of the collector's sight (`epp
    serve` once started: nothing it built is garbage yet)."""
    gc.collect()
    gc.freeze()


def collect_retired() -> None:
    """Long-lived objects were let go (a retired config): collect them, frozen
    ones included, and freeze again what is still alive. Without a freeze there is
    nothing to do: the collector finds them on its own."""
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze()
