"""Tokenizers from the Hugging Face Hub, with the real Hub client and no network: a
Hub cache laid out as the client lays it out (the Qwen2.5 tokenizer of the test data
under made-up model ids), offline mode, an unreachable Hub, and a small local
server speaking the Hub's file API for the download path itself."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from aiohttp import web

from epp.tokenization import models
from epp.tokenization.hub import TOKENIZER_FILES, HubFetchError, fetch_tokenizer
from epp.tokenization.models import (
    LoraAdapter,
    Resolution,
    TokenizerRegistry,
    TokenizerSource,
    TokenizerStatus,
)
from tests.testdata import hub_cache, qwen_dir

COMMIT = "1" * 40
PER_MODEL = TokenizerSource("*", hugging_face="*")


@pytest.fixture(autouse=True)
def _no_real_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test forgets, it never reaches the real Hub (the client builds its
    URLs from these two, read from HF_ENDPOINT at import)."""
    nowhere = "http://127.0.0.1:9"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", nowhere)
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        nowhere + "/{repo_id}/resolve/{revision}/{filename}",
    )


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """What HF_HUB_OFFLINE=1 sets when the client is imported (the environment is
    read once; test_offline_mode_from_the_environment_makes_misses_final sets the
    variable itself)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@contextlib.asynccontextmanager
async def fetching(registry: TokenizerRegistry) -> AsyncIterator[TokenizerRegistry]:
    """The registry's on-demand fetcher running, as the service runs it."""
    task = asyncio.create_task(registry.fetch_on_demand())
    try:
        yield registry
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        registry.close()


async def settled(registry: TokenizerRegistry, model: str, timeout_s: float = 20.0) -> Resolution:
    """`model`'s resolution once its tokenizer is no longer loading."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        resolution = registry.resolve(model)
        if resolution.reason != "loading":
            return resolution
        assert asyncio.get_running_loop().time() < deadline, registry.describe()
        await asyncio.sleep(0.02)


# -- per-model tokenizers (huggingFace: "*") ---------------------------------------------


@pytest.mark.usefixtures("offline")
async def test_a_models_tokenizer_is_fetched_when_a_request_first_names_it(
    tmp_path: Path,
) -> None:
    hub_cache(tmp_path, "Org/Name")
    registry = TokenizerRegistry([PER_MODEL], cache_dir=str(tmp_path))
    # Nothing is fetched before a request names the model, nor without the fetcher.
    assert registry.describe() == {
        "*": "per model from the Hugging Face Hub (0 of at most 8 models)"
    }
    assert registry.resolve("Org/Name").reason == "loading"
    assert registry.describe()["Org/Name"] == "pending"
    await registry.load()  # the configured tokenizers: none to load here
    assert registry.resolve("Org/Name").reason == "loading"
    async with fetching(registry):
        resolution = await settled(registry, "Org/Name")
        assert resolution.tokenizer is not None
        assert resolution.tokenizer.name == "Org/Name"
        ids = resolution.tokenizer.encode_now("Hello, world", False)
        assert len(ids) > 0
        assert registry.describe() == {
            "*": "per model from the Hugging Face Hub (1 of at most 8 models)",
            "Org/Name": "ready",
        }
        assert registry.resolve("Org/Name").tokenizer is resolution.tokenizer


@pytest.mark.usefixtures("offline")
async def test_a_model_not_in_the_cache_fails_clearly_and_nothing_else_breaks(
    tmp_path: Path,
) -> None:
    hub_cache(tmp_path, "Org/Name")
    registry = TokenizerRegistry([PER_MODEL], cache_dir=str(tmp_path))
    async with fetching(registry):
        absent = await settled(registry, "Org/Absent")
        assert absent.tokenizer is None
        assert absent.reason == "failed"
        error = registry.describe()["Org/Absent"]
        assert error.startswith("failed: Org/Absent: not in the cache (offline)")
        # Offline, the cache will not change by itself: no retry.
        await asyncio.sleep(0.1)
        assert registry.describe()["Org/Absent"] == error
        present = await settled(registry, "Org/Name")
        assert present.tokenizer is not None
        # A name that is no Hub id fails the same way, without a download.
        bad = await settled(registry, "../etc/passwd")
        assert bad.reason == "failed"
        assert "is not a Hub model id" in registry.describe()["../etc/passwd"]


@pytest.mark.usefixtures("offline")
async def test_at_most_max_models_are_fetched(tmp_path: Path) -> None:
    for name in ("Org/A", "Org/B", "Org/C"):
        hub_cache(tmp_path, name)
    registry = TokenizerRegistry([PER_MODEL], cache_dir=str(tmp_path), max_models=2)
    async with fetching(registry):
        # A request without a model takes no place.
        assert registry.resolve("").reason == "no-tokenizer"
        assert registry.resolve("Org/A").reason == "loading"
        assert registry.resolve("Org/B").reason == "loading"
        # The third model is not fetched, not now and not later: its requests get no
        # precise score, and the reason says why.
        assert registry.resolve("Org/C") == Resolution(None, None, "model-limit")
        assert (await settled(registry, "Org/A")).tokenizer is not None
        assert (await settled(registry, "Org/B")).tokenizer is not None
        assert registry.resolve("Org/C").reason == "model-limit"
        for i in range(100):  # a flood of names queues nothing
            assert registry.resolve(f"bogus/{i}").reason == "model-limit"
        assert set(registry.describe()) == {"*", "Org/A", "Org/B"}
        assert registry.describe()["*"].endswith("(2 of at most 2 models)")
        assert registry._wanted.empty()


@pytest.mark.usefixtures("offline")
async def test_an_explicit_entry_wins_over_the_hub(tmp_path: Path) -> None:
    hub_cache(tmp_path / "hub", "Org/Name")
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(qwen_dir() / "tokenizer.json", local / "tokenizer.json")
    registry = TokenizerRegistry(
        [TokenizerSource("Org/Name", path=str(local)), PER_MODEL], cache_dir=str(tmp_path / "hub")
    )
    async with fetching(registry):
        await registry.load()
        resolution = registry.resolve("Org/Name")
        assert resolution.tokenizer is not None
        assert resolution.tokenizer.name == "local"  # the directory's, not the Hub's
        assert registry.describe() == {
            "Org/Name": "ready",
            "*": "per model from the Hugging Face Hub (0 of at most 8 models)",
        }
        assert registry._wanted.empty()


@pytest.mark.usefixtures("offline")
async def test_an_adapter_uses_its_base_models_hub_tokenizer(tmp_path: Path) -> None:
    hub_cache(tmp_path, "Org/Base")
    registry = TokenizerRegistry(
        [PER_MODEL], [LoraAdapter("my-lora", "Org/Base")], cache_dir=str(tmp_path)
    )
    async with fetching(registry):
        resolution = await settled(registry, "my-lora")
        assert resolution.adapter == LoraAdapter("my-lora", "Org/Base")
        assert resolution.tokenizer is not None
        assert resolution.tokenizer.name == "Org/Base"
        # The base model was fetched (once), never the adapter's name.
        assert set(registry.describe()) == {"*", "Org/Base"}
        assert registry.resolve("Org/Base").tokenizer is resolution.tokenizer


async def test_a_failed_fetch_is_retried_with_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub cannot be reached (no server where `_no_real_hub` points it) and the
    cache is empty: failed, retried; once the files are there (a volume filled
    meanwhile), the retry loads them."""
    monkeypatch.setattr(models, "HUB_RETRY_S", (0.2,))
    registry = TokenizerRegistry([PER_MODEL], cache_dir=str(tmp_path))
    async with fetching(registry):
        failed = await settled(registry, "Org/Late")
        assert failed.reason == "failed"
        assert "the Hub cannot be reached" in registry.describe()["Org/Late"]
        hub_cache(tmp_path, "Org/Late")
        deadline = asyncio.get_running_loop().time() + 20
        while registry.resolve("Org/Late").tokenizer is None:
            assert asyncio.get_running_loop().time() < deadline, registry.describe()
            await asyncio.sleep(0.05)
        assert registry.describe()["Org/Late"] == "ready"


async def test_configured_hub_tokenizers_share_what_is_loaded(
    tmp_path: Path, offline: None
) -> None:
    hub_cache(tmp_path, "Org/Name")
    registry = TokenizerRegistry(
        [
            TokenizerSource("a", hugging_face="Org/Name"),
            TokenizerSource("b", hugging_face="Org/Name"),
        ],
        cache_dir=str(tmp_path),
    )
    try:
        await registry.load()
        a, b = registry.resolve("a").tokenizer, registry.resolve("b").tokenizer
        assert a is not None
        assert a is b
        a.encode_now("one two three", False)
        assert registry.tokens_encoded() == a.tokens_encoded  # counted once
    finally:
        registry.close()
    assert registry._entries["a"].status is TokenizerStatus.READY


# -- the Hub client's own settings -------------------------------------------------------


DOWNLOAD = """
from epp.tokenization.hub import HubFetchError, fetch_tokenizer
print(fetch_tokenizer("Org/Name"))
try:
    fetch_tokenizer("Org/Missing")
except HubFetchError as exc:
    print("retryable" if exc.retryable else "final", exc)
"""


# The Hub's own command line (`hf`), as a user fills a cache for offline use.
HF_CLI = "import sys; from huggingface_hub.cli.hf import main; sys.exit(main())"


async def run_python(script: str, env: dict[str, str], *args: str) -> list[str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    return out.decode().splitlines()


async def test_offline_mode_from_the_environment_makes_misses_final(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE (read by the Hub client) counts as offline even when the
    scorer's huggingFaceOffline is false: a miss is not retried. HF_HUB_CACHE says
    where the cache is."""
    snapshot = hub_cache(tmp_path / "cache", "Org/Name")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "home"),
    }
    env.pop("HF_ENDPOINT", None)
    lines = await run_python(DOWNLOAD, env)
    assert Path(lines[0]) == snapshot
    assert lines[1].startswith("final Org/Missing: not in the cache (offline)")


# -- the download path, against a local server speaking the Hub's API ---------------------


class FakeHub:
    """The Hub endpoints `snapshot_download` uses for a model: repo info, the file
    tree, and each file's HEAD and GET under /resolve/. Serves the Qwen2.5 tokenizer
    as every repository in `repos`, and logs the files downloaded."""

    def __init__(self, repos: set[str]) -> None:
        self.repos = repos
        self.files = {
            name: (qwen_dir() / name).read_bytes()
            for name in ("tokenizer.json", "tokenizer_config.json")
        }
        self.files["special_tokens_map.json"] = b"{}"
        # Not a tokenizer file: must not be downloaded.
        self.files["model.safetensors"] = b"\0" * 1024
        self.downloads: list[str] = []
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self.info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}", self.tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{file}", self.resolve)
        self.runner = web.AppRunner(app)

    def _repo(self, request: web.Request) -> str:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            raise web.HTTPNotFound(
                headers={"X-Error-Code": "RepoNotFound"}, text='{"error": "Repository not found"}'
            )
        return repo

    @staticmethod
    def _etag(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    async def info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        siblings = [{"rfilename": name} for name in self.files]
        return web.json_response({"id": repo, "sha": COMMIT, "siblings": siblings})

    async def tree(self, request: web.Request) -> web.Response:
        self._repo(request)
        return web.json_response(
            [
                {"type": "file", "path": name, "size": len(data), "oid": self._etag(data)}
                for name, data in self.files.items()
            ]
        )

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self._repo(request)
        name = request.match_info["file"]
        data = self.files.get(name)
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{self._etag(data)}"',
            "Content-Length": str(len(data)),
        }
        if request.method == "HEAD":
            return web.Response(headers=headers)
        self.downloads.append(name)
        return web.Response(body=data, headers=headers)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"


def hub_env(endpoint: str, cache: Path, home: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    return env


async def test_the_tokenizer_files_are_downloaded_into_the_cache(tmp_path: Path) -> None:
    """The real download path, pointed at a local server with HF_ENDPOINT (read by
    the Hub client, as every other HF_* variable): only the tokenizer's files are
    downloaded, into the cache HF_HUB_CACHE names, which then serves offline."""
    hub = FakeHub({"Org/Name"})
    endpoint = await hub.start()
    try:
        lines = await run_python(DOWNLOAD, hub_env(endpoint, tmp_path / "cache", tmp_path))
    finally:
        await hub.runner.cleanup()
    snapshot = tmp_path / "cache" / "models--Org--Name" / "snapshots" / COMMIT
    assert Path(lines[0]) == snapshot
    assert sorted(hub.downloads) == [  # no weights
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (snapshot / "tokenizer.json").read_bytes() == hub.files["tokenizer.json"]
    # A repository the Hub does not have: worth retrying (it may appear, or access
    # be granted).
    assert lines[1].startswith("retryable Org/Missing: ")
    # The cache now serves offline, with no server at all.
    assert fetch_tokenizer("Org/Name", cache_dir=tmp_path / "cache", offline=True) == snapshot


async def test_a_cache_filled_with_hf_download_serves_offline(tmp_path: Path) -> None:
    """The command docs/precise-prefix.md gives (`hf download` of the five tokenizer
    file names) fills a cache that works offline. Fewer names do not: the client
    remembers the repository's file list and refuses an incomplete snapshot."""
    hub = FakeHub({"Org/Name"})
    endpoint = await hub.start()
    try:
        for cache, names in (("full", TOKENIZER_FILES), ("partial", TOKENIZER_FILES[:2])):
            env = hub_env(endpoint, tmp_path / cache, tmp_path / "home")
            await run_python(HF_CLI, env, "download", "Org/Name", *names, "--quiet")
    finally:
        await hub.runner.cleanup()
    snapshot = fetch_tokenizer("Org/Name", cache_dir=tmp_path / "full", offline=True)
    assert snapshot == tmp_path / "full" / "models--Org--Name" / "snapshots" / COMMIT
    with pytest.raises(HubFetchError, match="incomplete") as caught:
        fetch_tokenizer("Org/Name", cache_dir=tmp_path / "partial", offline=True)
    assert "not in the cache (offline)" in str(caught.value)
    assert caught.value.retryable is False


def test_a_repository_without_tokenizer_json_is_a_final_error(tmp_path: Path) -> None:
    snapshot = hub_cache(tmp_path, "Org/Weights")
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(HubFetchError, match=r"no tokenizer\.json") as caught:
        fetch_tokenizer("Org/Weights", cache_dir=tmp_path, offline=True)
    assert caught.value.retryable is False
