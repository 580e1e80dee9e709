"""`python -m bench.gcpause`: how long one full garbage collection stalls the EPP
with its prefix indexes full.

CPython's cyclic garbage collector runs on the thread that runs the event loop, so
while it works the EPP answers nobody: every request arriving meanwhile waits. A
young collection (generation 0 or 1) looks only at recent objects; a full one
(generation 2) walks every container the collector tracks, however old, and comes
whenever enough objects have survived the younger ones (in CPython 3.11, when those
that survived since the last full one outnumber a quarter of the long-lived ones).
Its cost is what the long-lived state makes the
collector walk: an index that keeps its entries in tracked containers (an
`OrderedDict` per endpoint, say) is walked entry by entry, every time.

Three states, each built in a fresh interpreter, then `gc.collect()` timed
`--repeats` times (median and max) with the count of objects the collector tracks,
each twice: as `epp serve` runs (`frozen`: what the EPP had built when it started
put out of the collector's sight by `epp.heap.freeze`, before the
index fills) and without that (`unfrozen`):

- `empty`: the EPP's modules imported and a datastore of the pods, nothing indexed;
- `approximate`: the approximate prefix index (the default profile's) full: each pod
  holding `--blocks-per-pod` blocks (31,250, `lruCapacityPerServer`'s default), from
  2,000-token prompts (125 blocks of 16 tokens, at 4 characters a token) of which
  the first 40 blocks, a system prompt, are shared by groups of 8, recorded as the
  `approx-prefix-cache-producer` records a routed prompt (its blocks with a window
  of half the capacity, and the prompt's end);
- `precise`: the precise index holding `--precise-entries` (block, pod) entries over
  the pods, filled through the KV-event ingestion (`bench.pick`'s fill).

Nothing is timed but the collections: a figure is a stall the EPP's event loop
would see, on this host.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.pick import fleet_sizes
from bench.provenance import emit, provenance

ROOT = Path(__file__).resolve().parent.parent
STATES = ("empty", "approximate", "precise")
BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
PROMPT_BLOCKS = 125
SHARED_BLOCKS = 40
GROUP = 8


def _endpoints(pods: int) -> list[Any]:
    from epp.datastore import Datastore, EndpointSpec

    datastore = Datastore()
    datastore.replace_all(EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(pods))
    return list(datastore.all_endpoints())


def fill_approximate(pods: int, blocks_per_pod: int) -> Any:
    """The approximate index with every pod's LRU full (see the module docstring)."""
    from epp.approxindex import ApproxPrefixIndex, PromptBlocks, chain_seed

    rng = random.Random(7)
    endpoints = _endpoints(pods)
    index = ApproxPrefixIndex()
    seed = chain_seed("model", None)
    block_chars = BLOCK_TOKENS * CHARS_PER_TOKEN
    # Enough prompts that every pod's LRU fills and starts evicting.
    prompts = (-(-blocks_per_pod // PROMPT_BLOCKS) + GROUP) * pods
    system = ""
    for n in range(prompts):
        if n % GROUP == 0:
            system = rng.randbytes(SHARED_BLOCKS * block_chars // 2).hex()
        rest = rng.randbytes((PROMPT_BLOCKS - SHARED_BLOCKS) * block_chars // 2).hex()
        blocks = PromptBlocks(system + rest, block_chars, seed, 0)
        # A group's prompts go to consecutive pods: its system prompt is shared.
        index.add(endpoints[n % pods], blocks.all(), blocks_per_pod, blocks_per_pod // 2)
        index.mark_end(blocks)
    return index


def measure_state(
    state: str, pods: int, frozen: bool, blocks_per_pod: int, entries: int, repeats: int
) -> Any:
    """Build `state` and time full collections (run in its own interpreter)."""
    import epp.app  # noqa: F401  (every module the EPP loads, as a running one has)
    from epp import heap

    held: Any = _endpoints(pods)
    if frozen:
        heap.freeze()
    size = 0
    if state == "empty":
        pass
    elif state == "approximate":
        held = fill_approximate(pods, blocks_per_pod)
        size = held.size
    else:
        from bench.pick import fill_precise_index

        held = fill_precise_index(entries, 1, pods)
        size = held[0].stats.entries
    gc.collect()
    stalls = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        stalls.append(time.perf_counter() - start)
    return {
        "state": state,
        "pods": pods,
        "frozen": frozen,
        "entries": size,
        # Those a collection walks; the frozen ones it does not.
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
        "full_collection_ms": {
            "median": statistics.median(stalls) * 1e3,
            "max": max(stalls) * 1e3,
            "repeats": repeats,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gcpause",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pods",
        type=fleet_sizes,
        default=[16, 64],
        metavar="N[,N...]",
        help="fleet sizes, comma-separated (default: 16,64)",
    )
    parser.add_argument("--blocks-per-pod", type=int, default=31_250)
    parser.add_argument("--precise-entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--states", default=",".join(STATES), help=f"of {', '.join(STATES)} (default: all)"
    )
    parser.add_argument(
        "--variants",
        default="unfrozen,frozen",
        help="unfrozen, frozen or both (default: both; unfrozen alone measures code from"
        " before epp.heap.freeze)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        state, pods, frozen = args.worker.split(",")
        result = measure_state(
            state,
            int(pods),
            frozen == "frozen",
            args.blocks_per_pod,
            args.precise_entries,
            args.repeats,
        )
        print(json.dumps(result))
        return 0
    states = [s for s in args.states.split(",") if s]
    unknown = [s for s in states if s not in STATES]
    if unknown or not states:
        parser.error(f"--states: expected some of {', '.join(STATES)}, got {args.states!r}")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in ("unfrozen", "frozen") for v in variants):
        parser.error(f"--variants: expected unfrozen, frozen or both, got {args.variants!r}")
    if args.blocks_per_pod < 1 or args.repeats < 1:
        parser.error("--blocks-per-pod and --repeats must be 1 or more")
    command = "python -m bench.gcpause " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = []
    for pods in args.pods:
        for state in states:
            for frozen in variants:
                print(f"{state}, {pods} pods, {frozen} ...", file=sys.stderr, flush=True)
                done = subprocess.run(
                    [sys.executable, "-m", "bench.gcpause",
                     "--worker", f"{state},{pods},{frozen}",
                     "--blocks-per-pod", str(args.blocks_per_pod),
                     "--precise-entries", str(args.precise_entries),
                     "--repeats", str(args.repeats)],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )  # fmt: skip
                result = json.loads(done.stdout)
                stall = result["full_collection_ms"]
                print(
                    f"  {result['entries']:,} entries, {result['tracked_objects']:,} tracked"
                    f" objects: a full collection {stall['median']:.1f} ms"
                    f" (max {stall['max']:.1f})",
                    file=sys.stderr,
                )
                results.append(result)
    emit({"results": results, **provenance(command)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
