"""Every message, field and enum value we define in protos/ matches Envoy's.

Our definitions are found by walking from the services we speak (ext_proc, and
the access log of lean mode) through every file they depend on.

Envoy's published definitions come from PyPI `xds-protos`, which defines the same
protobuf full names as our generated code, so it runs in its own interpreter
(`EPP_XDS_PYTHON`, a virtualenv `make test` creates) and sends back a JSON dump of
the descriptors we ask for.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor

from epp._proto.envoy.service.accesslog.v3 import als_pb2
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2

# The files at the roots of the walk: one per service we speak.
SERVICE_FILES = (external_processor_pb2.DESCRIPTOR, als_pb2.DESCRIPTOR)

# Runs under the xds-protos interpreter: dumps the named messages and enums.
_DUMP_SCRIPT = r"""
import json, sys
from google.protobuf import descriptor_pool
# Importing the services registers everything they use.
import envoy.service.ext_proc.v3.external_processor_pb2
import envoy.service.accesslog.v3.als_pb2

pool = descriptor_pool.Default()
out = {"messages": {}, "enums": {}, "services": {}}
names = json.load(sys.stdin)
for name in names["messages"]:
    d = pool.FindMessageTypeByName(name)
    out["messages"][name] = {
        f.name: {
            "number": f.number,
            "type": f.type,
            "repeated": f.is_repeated,
            "type_name": (f.message_type or f.enum_type).full_name
            if (f.message_type or f.enum_type) else None,
            "oneof": f.containing_oneof.name if f.containing_oneof else None,
        }
        for f in d.fields
    }
for name in names["enums"]:
    e = pool.FindEnumTypeByName(name)
    out["enums"][name] = {v.name: v.number for v in e.values}
for name in names["services"]:
    s = pool.FindServiceByName(name)
    out["services"][name] = {
        m.name: [m.input_type.full_name, m.output_type.full_name,
                 m.client_streaming, m.server_streaming]
        for m in s.methods
    }
json.dump(out, sys.stdout)
"""


def _walk(file: FileDescriptor, seen: set[str], out: dict[str, Any]) -> None:
    if file.name in seen or file.name.startswith("google/"):
        return
    seen.add(file.name)

    def message(d: Descriptor) -> None:
        if d.GetOptions().map_entry:
            return
        out["messages"][d.full_name] = {
            f.name: {
                "number": f.number,
                "type": f.type,
                "repeated": f.is_repeated,
                "type_name": (f.message_type or f.enum_type).full_name
                if (f.message_type or f.enum_type)
                else None,
                "oneof": f.containing_oneof.name if f.containing_oneof else None,
            }
            for f in d.fields
        }
        for nested in d.nested_types:
            message(nested)
        for e in d.enum_types:
            enum(e)

    def enum(e: EnumDescriptor) -> None:
        out["enums"][e.full_name] = {v.name: v.number for v in e.values}

    for d in file.message_types_by_name.values():
        message(d)
    for e in file.enum_types_by_name.values():
        enum(e)
    for s in file.services_by_name.values():
        out["services"][s.full_name] = {
            m.name: [
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            ]
            for m in s.methods
        }
    for dependency in file.dependencies:
        _walk(dependency, seen, out)


def _ours() -> dict[str, Any]:
    out: dict[str, Any] = {"messages": {}, "enums": {}, "services": {}}
    seen: set[str] = set()
    for file in SERVICE_FILES:
        _walk(file, seen, out)
    return out


@pytest.fixture(scope="module")
def published() -> dict[str, Any]:
    python = os.environ.get("EPP_XDS_PYTHON")
    if not python:
        pytest.skip("EPP_XDS_PYTHON is not set: run through `make test`, which provides xds-protos")
    ours = _ours()
    query = {kind: sorted(ours[kind]) for kind in ("messages", "enums", "services")}
    done = subprocess.run(
        [python, "-c", _DUMP_SCRIPT],
        input=json.dumps(query),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_we_define_the_messages_the_protocol_needs() -> None:
    ours = _ours()
    for name in (
        "envoy.service.ext_proc.v3.ProcessingRequest",
        "envoy.service.ext_proc.v3.ProcessingResponse",
        "envoy.service.ext_proc.v3.ImmediateResponse",
        "envoy.config.core.v3.HeaderValue",
    ):
        assert name in ours["messages"]
    assert ours["services"]["envoy.service.ext_proc.v3.ExternalProcessor"]["Process"] == [
        "envoy.service.ext_proc.v3.ProcessingRequest",
        "envoy.service.ext_proc.v3.ProcessingResponse",
        True,
        True,
    ]


def test_every_field_matches_envoy(published: dict[str, Any]) -> None:
    ours = _ours()
    mismatches = []
    for name, fields in ours["messages"].items():
        theirs = published["messages"][name]
        for field, spec in fields.items():
            if field not in theirs:
                mismatches.append(f"{name}.{field}: not in Envoy's definition")
            elif theirs[field] != spec:
                mismatches.append(f"{name}.{field}: ours {spec}, Envoy's {theirs[field]}")
    assert not mismatches, "\n".join(mismatches)


def test_every_enum_value_matches_envoy(published: dict[str, Any]) -> None:
    ours = _ours()
    mismatches = [
        f"{name}.{value}: ours {number}, Envoy's {published['enums'][name].get(value)}"
        for name, values in ours["enums"].items()
        for value, number in values.items()
        if published["enums"][name].get(value) != number
    ]
    assert not mismatches, "\n".join(mismatches)


def test_service_matches_envoy(published: dict[str, Any]) -> None:
    assert published["services"] == _ours()["services"]


def test_a_dropped_field_would_be_caught(published: dict[str, Any]) -> None:
    # The comparison is not vacuous: Envoy's message has fields we left out, and ours
    # all exist there.
    ours = _ours()["messages"]["envoy.service.ext_proc.v3.ProcessingRequest"]
    theirs = published["messages"]["envoy.service.ext_proc.v3.ProcessingRequest"]
    assert set(ours) < set(theirs)


def test_we_define_the_access_log_messages_lean_mode_needs() -> None:
    ours = _ours()
    assert ours["services"]["envoy.service.accesslog.v3.AccessLogService"] == {
        "StreamAccessLogs": [
            "envoy.service.accesslog.v3.StreamAccessLogsMessage",
            "envoy.service.accesslog.v3.StreamAccessLogsResponse",
            True,
            False,
        ]
    }
    messages = ours["messages"]
    assert set(messages["envoy.service.accesslog.v3.StreamAccessLogsMessage"]) == {
        "identifier",
        "http_logs",
    }
    assert "request_id" in messages["envoy.data.accesslog.v3.HTTPRequestProperties"]
    assert "response_code" in messages["envoy.data.accesslog.v3.HTTPResponseProperties"]
    assert "access_log_type" in messages["envoy.data.accesslog.v3.AccessLogCommon"]
    assert "envoy.config.core.v3.Node" in messages


def test_the_access_log_check_is_not_vacuous(published: dict[str, Any]) -> None:
    # Our trimmed access-log messages are strict subsets of Envoy's, and each was
    # compared (it is in what the xds-protos interpreter sent back).
    ours = _ours()["messages"]
    for name in (
        "envoy.service.accesslog.v3.StreamAccessLogsMessage",
        "envoy.data.accesslog.v3.AccessLogCommon",
        "envoy.data.accesslog.v3.HTTPAccessLogEntry",
        "envoy.data.accesslog.v3.HTTPRequestProperties",
        "envoy.data.accesslog.v3.HTTPResponseProperties",
    ):
        assert set(ours[name]) < set(published["messages"][name]), name
