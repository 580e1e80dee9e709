"""A prefix-cache-aware Endpoint Picker (EPP) for Envoy's External Processing filter."""

__version__ = "0.1.0"
