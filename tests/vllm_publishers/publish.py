"""Publishes KV events with vLLM's own code, for the EPP's tests against real vLLM.

Run by the vLLM venv's interpreter (`.venv-vllm-code/bin/python`) with
PYTHONPATH set to the Python sources extracted from a released vLLM wheel
(`tests/vllm_publishers/setup.py` downloads and extracts them). Nothing of vLLM is
re-implemented here: the engine's KV-cache manager (`KVCacheManager`, its
`BlockPool`) caches a `Request` built with vLLM's block hasher
(`get_request_block_hasher`, NONE_HASH from `init_none_hash`, the hash functions
of `vllm.utils.hashing`) and emits the events; vLLM's `ZmqEventPublisher` sends
them in a `KVEventBatch`, as the scheduler does after each step.

One process hosts several "engines" (a KV-cache manager and a publisher each), so
vLLM is imported once (half a minute) for a whole test session. What an engine
process would hold in its environment or module globals is set per engine before
each of its steps: PYTHONHASHSEED (read by `init_none_hash`),
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (read when an event's hashes are converted)
and `kv_cache_utils.NONE_HASH` (the value `init_none_hash` gave that engine).

Protocol: one JSON object a line on stdin, one JSON reply a line on the original
stdout (vLLM's own output goes to stderr). Every reply has "ok"; errors carry
"error" and the traceback. Commands ("op"):

- engine: id, algo, seed ("default": PYTHONHASHSEED unset, whatever this vLLM
  does then; "random": a fresh random PYTHONHASHSEED; anything else: that value),
  int_hashes, pub and replay (TCP ports), num_blocks.
- request: engine, id, tokens, cache_salt, lora ({name, id}) and free: one
  scheduler step that admits the prompt (cache lookup, allocation, caching of its
  full blocks), optionally frees it, and publishes the step's events.
- reset: the engine's prefix cache reset (AllBlocksCleared), published.
- close: the publisher shut down. quit: every publisher shut down, exit.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import secrets
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

BLOCK_SIZE = 16

# vLLM is imported lazily and typed as Any: the project's own venv (where ruff and
# mypy run) has no vLLM, and this script must not need stubs for it.
_vllm: dict[str, Any] = {}


def vllm(module: str) -> Any:
    if module not in _vllm:
        _vllm[module] = importlib.import_module(module)
    return _vllm[module]


def supported(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `fn` accepts: constructors' signatures differ between
    vLLM versions (e.g. KVCacheManager's scheduler_block_size, from 0.2x on)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def version() -> str:
    return str(getattr(vllm("vllm.version"), "__version__", "?"))


def jsonable(value: Any) -> Any:
    """Event fields for the reply: bytes as hex, tuples as lists."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


class Engine:
    """What one vLLM engine process holds for prefix caching and KV events."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        kvu = vllm("vllm.v1.core.kv_cache_utils")
        hashing = vllm("vllm.utils.hashing")
        torch = vllm("torch")
        iface = vllm("vllm.v1.kv_cache_interface")
        manager_mod = vllm("vllm.v1.core.kv_cache_manager")
        events = vllm("vllm.distributed.kv_events")

        self.id: str = cmd["id"]
        self.algo: str = cmd["algo"]
        seed = cmd.get("seed", "default")
        self.env: dict[str, str | None] = {
            "PYTHONHASHSEED": None
            if seed == "default"
            else (str(secrets.randbits(63)) if seed == "random" else str(seed)),
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if cmd.get("int_hashes", True) else "0",
        }
        self._apply_env()
        self.hash_fn = hashing.get_hash_fn_by_name(self.algo)
        # As EngineCore does at start-up, once per process: a fresh NONE_HASH.
        kvu.init_none_hash(self.hash_fn)
        self.none_hash: bytes = kvu.NONE_HASH
        self.block_hasher = kvu.get_request_block_hasher(BLOCK_SIZE, self.hash_fn)

        # One full-attention KV-cache group of BLOCK_SIZE-token blocks, as a plain
        # decoder model has; the tensors are never allocated (the scheduler side
        # only counts blocks).
        spec = iface.FullAttentionSpec(
            **supported(
                iface.FullAttentionSpec,
                block_size=BLOCK_SIZE,
                num_kv_heads=1,
                head_size=8,
                dtype=torch.float16,
            )
        )
        config = iface.KVCacheConfig(
            **supported(
                iface.KVCacheConfig,
                num_blocks=int(cmd.get("num_blocks", 64)),
                kv_cache_tensors=[],
                kv_cache_groups=[iface.KVCacheGroupSpec(["model.layers.0.attn"], spec)],
            )
        )
        self.manager = manager_mod.KVCacheManager(
            **supported(
                manager_mod.KVCacheManager.__init__,
                kv_cache_config=config,
                max_model_len=8192,
                hash_block_size=BLOCK_SIZE,
                scheduler_block_size=BLOCK_SIZE,
                enable_caching=True,
                enable_kv_cache_events=True,
            )
        )
        # vLLM binds when the endpoint has a wildcard ("tcp://*:5557", its docs'
        # example) and connects otherwise; the EPP connects, so bind.
        self.publisher = events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"tcp://*:{int(cmd['pub'])}",
            replay_endpoint=f"tcp://*:{int(cmd['replay'])}" if cmd.get("replay") else None,
        )
        self.block_ids: dict[str, list[int]] = {}
        self.batches = 0

    def _apply_env(self) -> None:
        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def activate(self) -> None:
        """This engine's process state, before one of its steps."""
        self._apply_env()
        vllm("vllm.v1.core.kv_cache_utils").NONE_HASH = self.none_hash

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "algo": self.algo,
            "pythonhashseed": self.env["PYTHONHASHSEED"],
            "none_hash": self.none_hash.hex(),
            "int_hashes": self.env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "1",
        }

    def request(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.activate()
        request_mod = vllm("vllm.v1.request")
        sampling = vllm("vllm.sampling_params")
        lora = cmd.get("lora")
        lora_request = (
            vllm("vllm.lora.request").LoRARequest(lora["name"], int(lora["id"]), "/adapters/x")
            if lora
            else None
        )
        tokens = [int(t) for t in cmd["tokens"]]
        req = request_mod.Request(
            **supported(
                request_mod.Request.__init__,
                request_id=cmd["id"],
                prompt_token_ids=tokens,
                sampling_params=sampling.SamplingParams(max_tokens=1),
                pooling_params=None,
                lora_request=lora_request,
                cache_salt=cmd.get("cache_salt"),
                block_hasher=self.block_hasher,
                arrival_time=time.time(),
            )
        )
        # The scheduler's admission of a waiting request: the prefix-cache lookup,
        # then slots for the uncached tokens (which caches the prompt's full blocks).
        found = self.manager.get_computed_blocks(req)
        computed, num_computed = found[0], found[1]
        allocated = self.manager.allocate_slots(
            req,
            len(tokens) - num_computed,
            **supported(
                self.manager.allocate_slots,
                num_new_computed_tokens=num_computed,
                new_computed_blocks=computed,
            ),
        )
        if allocated is None:
            raise RuntimeError("the KV cache has no room for the request")
        self.block_ids[cmd["id"]] = list(self.manager.get_block_ids(cmd["id"])[0])
        if cmd.get("free", True):
            self.manager.free(req)
        reply = self.publish()
        reply["block_hashes"] = [h.hex() for h in req.block_hashes]
        reply["cached_tokens"] = num_computed
        return reply

    def reset(self) -> dict[str, Any]:
        self.activate()
        if not self.manager.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: blocks still in use")
        return self.publish()

    def publish(self) -> dict[str, Any]:
        """The scheduler's end of step: take the KV-cache manager's events and
        publish them as one batch."""
        events_mod = vllm("vllm.distributed.kv_events")
        events = self.manager.take_events()
        if events:
            self.publisher.publish(events_mod.KVEventBatch(ts=time.time(), events=events))
            self.batches += 1
        return {
            "events": [
                {"type": type(e).__name__}
                | {f: jsonable(getattr(e, f)) for f in e.__struct_fields__ if f != "token_ids"}
                for e in events
            ],
            "batches": self.batches,
        }

    def close(self) -> None:
        self.publisher.shutdown()


def serve(commands: TextIO, replies: TextIO) -> None:
    engines: dict[str, Engine] = {}

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ok": True, "ready": True, "vllm": version(), "pid": os.getpid()})
    for line in commands:
        if not line.strip():
            continue
        cmd: dict[str, Any] = {}
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "engine":
                engine = Engine(cmd)
                engines[engine.id] = engine
                reply({"ok": True, **engine.describe()})
            elif op == "request":
                reply({"ok": True, **engines[cmd["engine"]].request(cmd)})
            elif op == "reset":
                reply({"ok": True, **engines[cmd["engine"]].reset()})
            elif op == "close":
                engines.pop(cmd["engine"]).close()
                reply({"ok": True})
            elif op == "quit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            reply({"ok": False, "error": repr(exc), "traceback": traceback.format_exc()})
    for engine in engines.values():
        engine.close()
    reply({"ok": True, "bye": True})


def main() -> None:
    # The replies keep the real stdout; whatever vLLM prints goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
