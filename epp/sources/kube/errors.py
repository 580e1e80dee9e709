"""What can go wrong talking to the Kubernetes API, in words an operator can act on.

The official client raises `ApiException` for HTTP errors (with the API server's
`Status` object as the body), urllib3 errors for transport failures, and plain
`OSError`s underneath. `classify` turns each into one `KubeError` whose message
says what was being done, to what, and what to change: a 403 names the missing
RBAC verb and resource, an unreachable server names the address.
"""

from __future__ import annotations

import json
from typing import Final

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

# `KubeError.reason`, the `reason` label of epp_kubernetes_errors_total.
UNREACHABLE: Final = "unreachable"
TIMEOUT: Final = "timeout"
FORBIDDEN: Final = "forbidden"
UNAUTHORIZED: Final = "unauthorized"
NOT_FOUND: Final = "not_found"
EXPIRED: Final = "expired"
SERVER_ERROR: Final = "server_error"
BAD_RESPONSE: Final = "bad_response"


class KubeError(Exception):
    """A failed list or watch; `message` is the whole explanation."""

    def __init__(self, reason: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status


class Expired(KubeError):
    """410 Gone: the resourceVersion to resume from is older than the server keeps;
    the cure is a fresh list, not a retry."""


def _status_message(body: object) -> str | None:
    """The `message` of a Kubernetes `Status` body, if the body is one."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body:
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return body.strip()[:500] or None
    if isinstance(status, dict):
        message = status.get("message")
        if isinstance(message, str) and message:
            return message
    return None


def classify(
    exc: BaseException,
    *,
    verb: str,
    resource: str,
    group: str,
    namespace: str,
    server: str,
) -> KubeError:
    """The `KubeError` for `exc`, raised while doing `verb` (list, watch) on
    `resource` (pods, inferencepools) of API group `group` ("" for core) in
    `namespace` at `server`."""
    what = f"{verb} {resource} in namespace {namespace!r}"
    if isinstance(exc, KubeError):
        return exc
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        detail = _status_message(exc.body) or str(exc.reason or "").strip()
        if status == 403:
            group_text = f'API group "{group}"' if group else 'the core API group ("")'
            return KubeError(
                FORBIDDEN,
                f"forbidden: cannot {what}: the EPP's service account lacks RBAC verb"
                f" {verb!r} on resource {resource!r} of {group_text}; grant it in the Role"
                f" bound to that service account (the Helm chart's Role has get, list and"
                f" watch). The API server said: {detail}",
                status,
            )
        if status == 401:
            return KubeError(
                UNAUTHORIZED,
                f"unauthorized: cannot {what}: the API server at {server} did not accept the"
                f" credentials (expired token? wrong kubeconfig?): {detail}",
                status,
            )
        if status == 404:
            return KubeError(
                NOT_FOUND,
                f"not found: cannot {what}: {detail}. If the resource is a custom resource,"
                f" is its CustomResourceDefinition installed ({resource}.{group or 'core'})?",
                status,
            )
        if status == 410:
            return Expired(EXPIRED, f"{what}: resourceVersion expired: {detail}", status)
        if status == 0:
            # The client's own wrapper for TLS failures.
            return KubeError(UNREACHABLE, f"cannot {what}: {server}: {detail}")
        if status == 429 or status >= 500:
            return KubeError(
                SERVER_ERROR, f"cannot {what}: the API server answered {status}: {detail}", status
            )
        return KubeError(BAD_RESPONSE, f"cannot {what}: HTTP {status}: {detail}", status)
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return KubeError(
            TIMEOUT,
            f"cannot {what}: no data from the API server at {server} within the read timeout"
            " (the connection is presumed dead)",
        )
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        return classify(
            exc.reason,
            verb=verb,
            resource=resource,
            group=group,
            namespace=namespace,
            server=server,
        )
    if isinstance(exc, urllib3.exceptions.NewConnectionError | ConnectionError):
        return KubeError(
            UNREACHABLE, f"cannot {what}: the API server at {server} is unreachable: {exc}"
        )
    if isinstance(exc, urllib3.exceptions.ProtocolError | urllib3.exceptions.HTTPError | OSError):
        return KubeError(UNREACHABLE, f"cannot {what}: the connection to {server} failed: {exc}")
    if isinstance(exc, ValueError):
        return KubeError(BAD_RESPONSE, f"cannot {what}: unreadable answer from {server}: {exc}")
    if isinstance(exc, ConfigException):
        return KubeError(UNAUTHORIZED, f"cannot {what}: client credentials: {exc}")
    return KubeError(BAD_RESPONSE, f"cannot {what}: {type(exc).__name__}: {exc}")
