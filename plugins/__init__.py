"""The built-in plugins, one small module each, registered by type name through
the `epp.plugins` entry-point group (see pyproject.toml)."""
