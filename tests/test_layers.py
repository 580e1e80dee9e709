"""The import graph points down: each unit of the EPP imports only units below it
(docs/architecture.md draws the same layers).

A unit is a module of `epp/`, or a whole subpackage (`epp.kvindex`,
`epp.scheduling`, `epp.sources.metrics`, ...), or the plugins. Imports inside a
unit are its own business; imports between units must go down the order below.
On top of that, the simulator stands alone (it plays vLLM, so it shares no code
with the EPP it is tested against), and no unit of the EPP imports a plugin:
plugins are found through their entry points.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A unit may import the units before it, never those after it.
ORDER = (
    "epp._proto",  # generated protobuf code
    "epp",  # the package itself: its version
    "epp.clock",
    "epp.heap",  # the long-lived objects and the garbage collector
    "epp.memory",  # what the process's memory is made of (/debug/memory)
    "epp.lru",  # the indexes' LRU maps, evicted without a leak
    "epp.durations",
    "epp.defaults",
    "epp.errors",
    "epp.logs",
    "epp.promutil",
    "epp.requests",  # what a request is
    "epp.datastore",  # what an endpoint is, and the set of them
    "epp.stalls",  # engines that stopped progressing, from what the EPP sees
    "epp.tokenization",  # prompts as the engines tokenize them
    "epp.kvindex",  # the precise prefix service: index, KV events, lookups
    "epp.approxindex",  # the approximate prefix index
    "epp.ttft",  # the predicted-TTFT model and each pod's prefill ledger
    "epp.sources",  # (the package: its docstring)
    "epp.sources.http_fetch",
    "epp.sources.metrics",  # the metrics scraper: endpoints' model-server metrics
    "epp.sources.static",  # endpoint sets: a file ...
    "epp.sources.kube",  # ... or the Kubernetes API
    "epp.telemetry",  # the EPP's own Prometheus metrics
    "epp.scheduling",  # the plugin framework: interfaces, scheduler, registry
    "epp.flowcontrol",  # flow control: queues, policies' contracts, the controller
    "epp.config",  # EndpointPickerConfig: parse, defaults, build
    "epp.director",  # a request's pick and end
    "epp.completion",  # lean mode's ends, from the access log
    "epp.extproc",  # the ext_proc stream
    "epp.accesslog",
    "epp.admin",  # /metrics, /healthz, /debug
    "epp.reload",  # config reload
    "epp.tls",
    "epp.app",  # the server: builds, starts and stops everything
    "epp.cli",
    "epp.__main__",
    "plugins",
)

# What a plugin may use: the framework and the state it reads. Not the server.
PLUGINS_MAY_IMPORT = frozenset(
    {
        "epp",
        "epp.clock",
        "epp.durations",
        "epp.errors",
        "epp.logs",
        "epp.promutil",
        "epp.requests",
        "epp.datastore",
        "epp.tokenization",
        "epp.kvindex",
        "epp.approxindex",
        "epp.ttft",
        "epp.sources.metrics",
        "epp.scheduling",
        "epp.flowcontrol",
    }
)

_SUBPACKAGE_UNITS = (
    "scheduling",
    "config",
    "kvindex",
    "extproc",
    "tokenization",
    "ttft",
    "flowcontrol",
    "_proto",
)


def unit_of(module: str) -> str | None:
    """The unit a module belongs to; None outside the EPP and its plugins."""
    parts = module.split(".")
    if parts[0] == "plugins" or parts[:2] == ["epp", "plugins"]:
        return "plugins"  # the folder, installed as `epp.plugins`
    if parts[0] != "epp":
        return None
    if len(parts) == 1:
        return "epp"
    if parts[1] in _SUBPACKAGE_UNITS:
        return f"epp.{parts[1]}"
    if parts[1] == "sources" and len(parts) > 2:
        return f"epp.sources.{parts[2]}"
    return f"epp.{parts[1]}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every absolute import in the file, including
    those inside functions and under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:  # `from epp import defaults` imports epp.defaults
                name = f"{node.module}.{alias.name}"
                if is_module(name):
                    yield node.lineno, name


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "_proto" not in p.parts)


def violations() -> list[str]:
    rank = {unit: i for i, unit in enumerate(ORDER)}
    found = []
    for path in sources("epp", "plugins"):
        here = unit_of(module_name(path))
        assert here in rank, f"{path}: unit {here} is not in ORDER"
        for line, module in imports(path):
            there = unit_of(module)
            if there is None or there == here:
                continue
            assert there in rank, f"{path}:{line}: unit {there} is not in ORDER"
            where = f"{path.relative_to(ROOT)}:{line}: {here} imports {module}"
            if rank[there] > rank[here]:
                found.append(f"{where}, a unit above it")
            if here == "plugins" and there not in PLUGINS_MAY_IMPORT:
                found.append(f"{where}, which plugins may not use")
    return found


def test_every_import_between_units_points_down() -> None:
    assert violations() == []


def test_the_simulator_shares_no_code_with_the_epp() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sources("sim")
        for line, module in imports(path)
        if module.split(".")[0] in ("epp", "plugins", "bench")
    ]
    assert found == []


@pytest.mark.parametrize(
    ("module", "unit"),
    [
        ("epp.kvindex.service", "epp.kvindex"),
        ("epp.sources.metrics.scraper", "epp.sources.metrics"),
        ("epp.sources.static", "epp.sources.static"),
        ("epp.director", "epp.director"),
        ("plugins.queue_scorer", "plugins"),
        ("epp.plugins.queue_scorer", "plugins"),
        ("epp", "epp"),
        ("grpc", None),
    ],
)
def test_modules_belong_to_their_units(module: str, unit: str | None) -> None:
    assert unit_of(module) == unit


def test_an_upward_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sees an import that goes up (a datastore importing the director)."""
    fake = tmp_path / "epp"
    (fake / "datastore").mkdir(parents=True)
    (fake / "datastore" / "__init__.py").write_text("from epp.director import Director\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "p.py").write_text("from epp.app import EppApp\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    found = violations()
    assert any("epp.datastore imports epp.director, a unit above it" in v for v in found)
    assert any("plugins imports epp.app, which plugins may not use" in v for v in found)
