"""Config reload: the EndpointPickerConfig file (`--config`) is watched and a valid
new version replaces the running scheduling config without a restart.

On Kubernetes the file is a ConfigMap volume: the kubelet writes a new version
into a fresh directory and swaps the `..data` symlink, so the path's target
changes inode and mtime at once. The file is polled (mtime, size, inode, like the
endpoints file): it works on every filesystem and never sees half a swap.

A changed file is read off the event loop, then validated and built completely
(`load_config`: every error listed, nothing built unless all is valid). Then:
- invalid: logged with every error, `epp_config_reloads_total{result="rejected"}`,
  `epp_config_last_reload_successful` 0; the running config keeps serving;
- valid: `Director.swap_config` makes it the config of new requests in one
  assignment. Requests in flight keep the config that picked them: their
  post-response plugins run with it, and open streams are never touched. The new
  config's services (metrics scraping, KV-event subscribers, tokenizer
  loading) start at once; the old config's stop when the last request holding it
  ends (or after `drain_timeout_s`, so a request that never ends cannot keep them
  forever). Until then both run: two scrapers, two KV-event subscriptions per pod,
  for the length of the longest request in flight.

A new config is a fresh build: its plugins start with empty state (an
approximate prefix index learns again; a precise one re-subscribes and replays
each engine's buffer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from epp import defaults, heap
from epp.config import InvalidConfig, SchedulingConfig
from epp.datastore import Datastore, MembershipListener
from epp.director import Director
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BuiltConfig:
    """A config with what it owns besides its plugins: the registry its plugins'
    metrics are in and the datastore listeners they added while being built."""

    config: SchedulingConfig
    registry: CollectorRegistry
    listeners: tuple[MembershipListener, ...] = ()
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def build_tracked(
    datastore: Datastore, build: Callable[[CollectorRegistry], SchedulingConfig]
) -> BuiltConfig:
    """Build a config with a fresh metrics registry, noting the datastore listeners
    its plugins add (so they can be removed with it). A failed build leaves no
    listener behind."""
    registry = CollectorRegistry()
    before = datastore.listeners()

    def added() -> tuple[MembershipListener, ...]:
        return tuple(
            listener
            for listener in datastore.listeners()
            if not any(listener is old for old in before)
        )

    try:
        config = build(registry)
    except BaseException:
        for listener in added():
            datastore.remove_listener(listener)
        raise
    return BuiltConfig(config, registry, added())


def _drop_listeners(datastore: Datastore, built: BuiltConfig) -> None:
    for listener in built.listeners:
        datastore.remove_listener(listener)


async def _logged(name: str, run: Callable[[], Awaitable[None]]) -> None:
    """Run a service; if it dies, say so (it is not restarted: a service that
    wants to survive errors handles them itself)."""
    try:
        await run()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("service %s stopped with an error", name)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class ConfigRuntime:
    """Runs the configs in use: the director's current one and retired ones that
    requests still hold."""

    def __init__(
        self,
        director: Director,
        datastore: Datastore,
        telemetry: Telemetry,
        current: BuiltConfig,
        drain_timeout_s: float = defaults.CONFIG_DRAIN_TIMEOUT.seconds,
    ) -> None:
        self.director = director
        self.datastore = datastore
        self.telemetry = telemetry
        self.current = current
        self.drain_timeout_s = drain_timeout_s
        self._draining: dict[BuiltConfig, asyncio.Task[None]] = {}
        telemetry.plugin_metrics.registry = current.registry

    def start(self) -> None:
        """Start the current config's background tasks."""
        self._start_tasks(self.current)

    def _start_tasks(self, built: BuiltConfig) -> None:
        for name, service in built.config.services.items():
            built.tasks.append(asyncio.create_task(_logged(name, service.run), name=name))

    def discard(self, built: BuiltConfig) -> None:
        """Drop a config that was built but will not run (its listeners go)."""
        _drop_listeners(self.datastore, built)

    def swap(self, new: BuiltConfig) -> None:
        """Make `new` the config of new requests; retire the current one."""
        old = self.current
        # Tasks first: a request picked by the new config may need its sources.
        self._start_tasks(new)
        self.director.swap_config(new.config)
        self.current = new
        self.telemetry.plugin_metrics.registry = new.registry
        for warning in new.config.warnings:
            log.warning("config: %s", warning)
        self._draining[old] = asyncio.create_task(self._retire(old), name="config-drain")
        self.telemetry.configs_draining.set(len(self._draining))

    async def _retire(self, old: BuiltConfig) -> None:
        try:
            users = self.director.users(old.config)
            if users:
                log.info(
                    "config: the previous config stops when its %d request(s) in flight end",
                    users,
                )
                try:
                    async with asyncio.timeout(self.drain_timeout_s):
                        await self.director.wait_idle(old.config)
                except TimeoutError:
                    log.warning(
                        "config: %d request(s) still hold the previous config after %.0fs;"
                        " stopping its background tasks anyway",
                        self.director.users(old.config),
                        self.drain_timeout_s,
                    )
            _drop_listeners(self.datastore, old)
            await _cancel(old.tasks)
        finally:
            self._draining.pop(old, None)
            self.telemetry.configs_draining.set(len(self._draining))
            # Once this coroutine has returned and let go of `old`: its objects
            # were frozen if it was the config `epp serve` started with.
            asyncio.get_running_loop().call_soon(heap.collect_retired)

    async def stop(self) -> None:
        drains = list(self._draining.values())
        await _cancel(drains)
        for built in [self.current, *self._draining]:
            await _cancel(built.tasks)


Signature = tuple[int, int, int]


def file_signature(path: str | Path) -> Signature | None:
    """(mtime, size, inode) of the file `path` leads to; None if it cannot be read.
    Taken before the file is read, so a change during the read is seen next time."""
    try:
        st = os.stat(path)  # follows the ConfigMap's symlinks to the current version
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class ConfigReloader:
    """Polls the config file; a changed, valid file is swapped in."""

    def __init__(
        self,
        path: str | Path,
        build: Callable[[str], BuiltConfig],
        runtime: ConfigRuntime,
        telemetry: Telemetry,
        poll_interval_s: float = defaults.CONFIG_RELOAD_INTERVAL.seconds,
    ) -> None:
        """`build(text)` validates and builds a config, raising `InvalidConfig`."""
        self.path = Path(path)
        self.build = build
        self.runtime = runtime
        self.telemetry = telemetry
        self.poll_interval_s = poll_interval_s
        self._signature = file_signature(self.path)
        self._text: str | None = None

    def loaded(self, text: str, signature: Signature | None) -> None:
        """The running config was built from `text`, read from the file when it had
        `signature` (unchanged content is not rebuilt: a touch, or a ConfigMap
        re-synced with the same data)."""
        self._text = text
        self._signature = signature

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.check()

    async def check(self) -> bool:
        """Look at the file once; True if a new config was applied."""
        signature = file_signature(self.path)
        if signature is None or signature == self._signature:
            return False
        self._signature = signature
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            self._rejected(f"{self.path}: cannot read the file: {exc}")
            return False
        if text == self._text:
            self.telemetry.config_reloads.labels("unchanged").inc()
            return False
        try:
            built = self.build(text)
        except InvalidConfig as exc:
            self._rejected(str(exc))
            return False
        self._text = text
        self.runtime.swap(built)
        self.telemetry.config_reloads.labels("applied").inc()
        self.telemetry.config_last_reload_successful.set(1)
        self.telemetry.config_last_reload_success_time.set_to_current_time()
        config = built.config
        profiles = ", ".join(config.scheduler.profiles)
        log.info(
            "config: reloaded %s: %d plugins, profiles %s; new requests use it",
            self.path,
            len(config.plugins),
            profiles,
        )
        return True

    def _rejected(self, why: str) -> None:
        # Reported once per version of the file (the signature moved on).
        self.telemetry.config_reloads.labels("rejected").inc()
        self.telemetry.config_last_reload_successful.set(0)
        log.error("config: %s\nconfig: the running config keeps serving", why)
