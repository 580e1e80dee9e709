"""The static endpoints file and the datastore it feeds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec
from epp.sources.static import InvalidEndpointsFile, StaticEndpointSource, parse_endpoints

VALID = """\
endpoints:
- name: sim-0
  address: 127.0.0.1:8001
  metricsUrl: http://127.0.0.1:9001/metrics
  kvEvents: tcp://127.0.0.1:5557
  kvEventsReplay: tcp://127.0.0.1:5558
  labels: {zone: a, gpu: h100}
- name: sim-1
  address: 10.1.2.3:8000
"""


def errors_of(text: str) -> list[str]:
    with pytest.raises(InvalidEndpointsFile) as info:
        parse_endpoints(textwrap.dedent(text), "eps.yaml")
    assert info.value.path == "eps.yaml"
    assert info.value.errors
    for error in info.value.errors:
        assert error in str(info.value)
    return info.value.errors


def one_error(text: str) -> str:
    errors = errors_of(text)
    assert len(errors) == 1, errors
    return errors[0]


def entry(address: str, name: str = "e", extra: str = "") -> str:
    return f"endpoints:\n- name: {name}\n  address: '{address}'\n{extra}"


# ---------------------------------------------------------------------------
# parse_endpoints


def test_valid_file() -> None:
    specs = parse_endpoints(VALID, "eps.yaml")
    assert specs == [
        EndpointSpec(
            name="sim-0",
            address="127.0.0.1:8001",
            metrics_url="http://127.0.0.1:9001/metrics",
            kv_events="tcp://127.0.0.1:5557",
            kv_events_replay="tcp://127.0.0.1:5558",
            labels={"zone": "a", "gpu": "h100"},
        ),
        EndpointSpec(name="sim-1", address="10.1.2.3:8000"),
    ]
    assert specs[0].effective_metrics_url == "http://127.0.0.1:9001/metrics"
    assert specs[1].effective_metrics_url == "http://10.1.2.3:8000/metrics"
    assert dict(specs[1].labels) == {}


def test_empty_endpoint_list() -> None:
    assert parse_endpoints("endpoints: []\n", "eps.yaml") == []


def test_duplicate_name() -> None:
    error = one_error(
        """\
        endpoints:
        - {name: a, address: 10.0.0.1:8000}
        - {name: a, address: 10.0.0.2:8000}
        """
    )
    assert error == "endpoints[1].name: duplicate name 'a'"


def test_duplicate_address() -> None:
    error = one_error(
        """\
        endpoints:
        - {name: a, address: 10.0.0.1:8000}
        - {name: b, address: 10.0.0.1:8000}
        """
    )
    assert error.startswith("endpoints[1].address: 10.0.0.1:8000")
    assert "'a'" in error


def test_empty_name() -> None:
    assert one_error(entry("10.0.0.1:1", name="''")) == "endpoints[0].name: must not be empty"


def test_hostname_instead_of_ip() -> None:
    error = one_error(entry("sim-0.default.svc:8000"))
    assert error.startswith("endpoints[0].address: 'sim-0.default.svc:8000'")
    assert "not a host name" in error


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:http", "10.0.0.1:-1"],
)
def test_bad_port(address: str) -> None:
    error = one_error(entry(address))
    assert error == f"endpoints[0].address: {address!r} must be IP:port"


@pytest.mark.parametrize("address", ["[::1]:8000", "[fd00::5]:1", "10.0.0.1:65535"])
def test_good_addresses(address: str) -> None:
    (spec,) = parse_endpoints(entry(address), "eps.yaml")
    assert spec.address == address


@pytest.mark.parametrize("address", ["::1:8000", "fd00::5:8000", "[::1:8000", "[10.0.0.1]:8000"])
def test_ipv6_needs_brackets_and_ipv4_none(address: str) -> None:
    error = one_error(entry(address))
    assert error.startswith(f"endpoints[0].address: {address!r}")
    assert "brackets" in error


@pytest.mark.parametrize("key", ["kvEvents", "kvEventsReplay"])
def test_kv_events_without_scheme(key: str) -> None:
    error = one_error(entry("10.0.0.1:8000", extra=f"  {key}: 10.0.0.1:5557\n"))
    assert error.startswith(f"endpoints[0].{key}: '10.0.0.1:5557'")
    assert "tcp://" in error


def test_unknown_key() -> None:
    error = one_error(entry("10.0.0.1:8000", extra="  weight: 3\n"))
    assert "unknown field `weight`" in error
    assert "endpoints[0]" in error


def test_missing_address() -> None:
    assert "address" in one_error("endpoints:\n- name: a\n")


def test_label_values_must_be_strings() -> None:
    assert "labels" in one_error(entry("10.0.0.1:8000", extra="  labels: {zone: [1]}\n"))


def test_not_yaml() -> None:
    error = one_error("endpoints: [\n  - name: a\n")
    assert error.startswith("not valid YAML")


@pytest.mark.parametrize("text", ["", "[]", "endpoints: 5", "- name: a"])
def test_wrong_shape(text: str) -> None:
    assert "Expected" in one_error(text)


def test_every_error_is_listed() -> None:
    errors = errors_of(
        """\
        endpoints:
        - {name: a, address: 10.0.0.1:8000}
        - {name: a, address: pod-b:8000}
        - {name: c, address: 10.0.0.1:8000, kvEvents: "10.0.0.3:5557"}
        - {name: d, address: "10.0.0.4:99999"}
        """
    )
    assert [e.split(":", 1)[0] for e in errors] == [
        "endpoints[1].name",
        "endpoints[1].address",
        "endpoints[2].address",
        "endpoints[2].kvEvents",
        "endpoints[3].address",
    ]


# ---------------------------------------------------------------------------
# StaticEndpointSource


def write(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text), encoding="utf-8")


def names(datastore: Datastore) -> list[str]:
    return [e.name for e in datastore.all_endpoints()]


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll `condition` (the source polls the file, so the test polls too) for up to 5 s."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


@contextlib.asynccontextmanager
async def running(source: StaticEndpointSource) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_load(tmp_path: Path) -> None:
    path = tmp_path / "eps.yaml"
    write(path, VALID)
    datastore = Datastore()
    assert not datastore.synced
    StaticEndpointSource(path, datastore).load()
    assert datastore.synced
    assert names(datastore) == ["sim-0", "sim-1"]


def test_load_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "eps.yaml"
    write(path, entry("example.com:80"))
    datastore = Datastore()
    with pytest.raises(InvalidEndpointsFile) as info:
        StaticEndpointSource(path, datastore).load()
    assert info.value.path == str(path)
    assert not datastore.synced
    assert names(datastore) == []


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidEndpointsFile, match="cannot read the file"):
        StaticEndpointSource(tmp_path / "absent.yaml", Datastore()).load()


async def test_run_picks_up_changes_and_keeps_the_last_good_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "eps.yaml"
    write(path, VALID)
    datastore = Datastore()
    source = StaticEndpointSource(path, datastore, poll_interval_s=0.01)
    source.load()
    kept = datastore.get("sim-1")
    assert kept is not None
    datastore.acquire(kept)

    async with running(source):
        # A changed file is applied.
        write(
            path,
            """\
            endpoints:
            - name: sim-1
              address: 10.1.2.3:8000
            - name: sim-2
              address: 10.1.2.4:8000
            """,
        )
        await wait_for(lambda: names(datastore) == ["sim-1", "sim-2"])
        assert datastore.get("sim-1") is kept
        assert kept.in_flight == 1

        # An invalid file is reported once, and the last good set stays.
        with caplog.at_level(logging.ERROR, logger="epp.sources.static"):
            write(path, "endpoints:\n- name: broken\n  address: nowhere\n")
            await wait_for(lambda: any("nowhere" in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.1)  # several more polls
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "keeping the previous 2 endpoints" in errors[0].getMessage()
        assert names(datastore) == ["sim-1", "sim-2"]

        # A deleted file changes nothing either.
        path.unlink()
        await asyncio.sleep(0.05)
        assert names(datastore) == ["sim-1", "sim-2"]

        # A good file again is picked up.
        write(path, "endpoints:\n- name: sim-9\n  address: '[::1]:8009'\n")
        await wait_for(lambda: names(datastore) == ["sim-9"])
    assert datastore.ready_endpoints()[0].address == "[::1]:8009"


async def test_run_picks_up_a_replaced_file(tmp_path: Path) -> None:
    # ConfigMap volumes swap a symlink / rename a new file into place.
    path = tmp_path / "eps.yaml"
    write(path, VALID)
    datastore = Datastore()
    source = StaticEndpointSource(path, datastore, poll_interval_s=0.01)
    source.load()
    async with running(source):
        new = tmp_path / "eps.yaml.new"
        write(new, VALID.replace("sim-1", "sim-X"))
        new.replace(path)
        await wait_for(lambda: names(datastore) == ["sim-0", "sim-X"])


# ---------------------------------------------------------------------------
# Datastore


def spec(name: str, address: str = "", **kwargs: object) -> EndpointSpec:
    index = int(name.rsplit("-", 1)[-1]) if name[-1].isdigit() else 0
    return EndpointSpec(name, address or f"10.0.0.{index + 1}:8000", **kwargs)  # type: ignore[arg-type]


def test_replace_all_keeps_unchanged_and_replaces_changed() -> None:
    datastore = Datastore()
    datastore.replace_all([spec("ep-0"), spec("ep-1"), spec("ep-2", labels={"a": "1"})])
    ep0, ep1, ep2 = datastore.all_endpoints()
    for endpoint in (ep0, ep1, ep2):
        datastore.acquire(endpoint)
    metrics = EndpointMetrics(waiting_requests=4, updated_at=1.0)
    datastore.set_metrics("ep-0", metrics)

    datastore.replace_all(
        [
            spec("ep-0"),  # unchanged
            spec("ep-1", "10.9.9.9:8000"),  # new address
            spec("ep-2", labels={"a": "2"}),  # new labels
            spec("ep-3"),  # new
        ]
    )
    assert datastore.get("ep-0") is ep0
    assert ep0.in_flight == 1
    assert ep0.metrics is metrics
    new1, new2 = datastore.get("ep-1"), datastore.get("ep-2")
    assert new1 is not None
    assert new2 is not None
    assert new1 is not ep1
    assert new1.address == "10.9.9.9:8000"
    assert new1.in_flight == 0
    assert new2 is not ep2
    assert dict(new2.labels) == {"a": "2"}
    assert sorted(names(datastore)) == ["ep-0", "ep-1", "ep-2", "ep-3"]


def test_replace_all_removes_missing() -> None:
    datastore = Datastore()
    datastore.replace_all([spec("ep-0"), spec("ep-1")])
    datastore.replace_all([spec("ep-1")])
    assert names(datastore) == ["ep-1"]
    assert datastore.get("ep-0") is None
    datastore.replace_all([])
    assert datastore.all_endpoints() == ()
    assert datastore.ready_endpoints() == ()
    assert datastore.synced  # an empty pool is a known state


def test_listeners_get_added_and_removed() -> None:
    datastore = Datastore()
    calls: list[tuple[list[str], list[str]]] = []

    def listener(added: list[Endpoint], removed: list[Endpoint]) -> None:
        calls.append(([e.name for e in added], [e.name for e in removed]))

    datastore.add_listener(listener)
    datastore.replace_all([spec("ep-0"), spec("ep-1")])
    datastore.replace_all([spec("ep-0"), spec("ep-1")])  # no change: no call
    datastore.replace_all([spec("ep-1", "10.5.5.5:80"), spec("ep-2")])
    datastore.set_ready("ep-2", False)  # readiness is not membership
    assert calls == [
        (["ep-0", "ep-1"], []),
        (["ep-1", "ep-2"], ["ep-0", "ep-1"]),
    ]


def test_listener_sees_the_new_state() -> None:
    datastore = Datastore()
    seen: list[list[str]] = []
    datastore.add_listener(lambda added, removed: seen.append(names(datastore)))
    datastore.replace_all([spec("ep-0")])
    assert seen == [["ep-0"]]


def test_ready_endpoints_exclude_not_ready() -> None:
    datastore = Datastore()
    datastore.replace_all([spec("ep-0"), spec("ep-1"), spec("ep-2")])
    assert [e.name for e in datastore.ready_endpoints()] == ["ep-0", "ep-1", "ep-2"]
    datastore.set_ready("ep-1", False)
    assert [e.name for e in datastore.ready_endpoints()] == ["ep-0", "ep-2"]
    assert len(datastore.all_endpoints()) == 3
    # Readiness survives a reload with the same spec.
    datastore.replace_all([spec("ep-0"), spec("ep-1"), spec("ep-2")])
    assert [e.name for e in datastore.ready_endpoints()] == ["ep-0", "ep-2"]
    datastore.set_ready("ep-1", True)
    assert [e.name for e in datastore.ready_endpoints()] == ["ep-0", "ep-1", "ep-2"]
    datastore.set_ready("nope", False)  # unknown: ignored
    assert len(datastore.ready_endpoints()) == 3


def test_acquire_release_never_negative() -> None:
    datastore = Datastore()
    datastore.replace_all([spec("ep-0")])
    (endpoint,) = datastore.all_endpoints()
    datastore.release(endpoint)
    assert endpoint.in_flight == 0
    datastore.acquire(endpoint)
    datastore.acquire(endpoint)
    assert endpoint.in_flight == 2
    for _ in range(5):
        datastore.release(endpoint)
    assert endpoint.in_flight == 0


def test_release_of_a_removed_endpoint() -> None:
    datastore = Datastore()
    datastore.replace_all([spec("ep-0")])
    (endpoint,) = datastore.all_endpoints()
    datastore.acquire(endpoint)
    datastore.replace_all([])
    datastore.release(endpoint)
    assert endpoint.in_flight == 0


def test_set_metrics_of_unknown_endpoint_is_ignored() -> None:
    datastore = Datastore()
    datastore.set_metrics("ghost", EndpointMetrics(waiting_requests=1))
    assert datastore.get("ghost") is None


def test_metrics_age() -> None:
    assert EndpointMetrics().age(now=100.0) == float("inf")
    assert EndpointMetrics(updated_at=90.0).age(now=100.0) == 10.0
