"""Envoy's External Processing protocol: the server, the per-request state machine,
and the message helpers."""
