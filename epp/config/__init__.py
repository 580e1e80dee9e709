"""The EndpointPickerConfig file: loading it in three steps.

The file has GIE's shape (see docs/architecture.md, "The config file"):

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: max-score-picker          # registered name or package.module:Class
      name: picker                    # optional, defaults to the type
      parameters: {maxNumOfEndpoints: 2}
    schedulingProfiles:
    - name: default
      plugins:
      - {pluginRef: picker}
      - {pluginRef: some-scorer, weight: 2}
    saturationDetector: {pluginRef: utilization-detector}   # optional (GIE)
    dataLayer:                                              # optional (GIE)
      sources:
      - pluginRef: metrics-data-source
        extractors: [{pluginRef: core-metrics-extractor}]
    inferenceObjectives:                                    # optional (this EPP)
    - {name: batch, priority: -1}
    featureGates: [flowControl]                             # optional (llm-d)
    flowControl: {defaultRequestTTL: 60s, ...}              # optional (llm-d)

`inferenceObjectives` plays the part of GIE's InferenceObjective resources: a
request's `x-gateway-inference-objective` header names one, and its `priority`
(default 0) is the request's; an unknown objective, or none, is priority 0. A
negative priority is sheddable: while the saturation detector says the pool is
saturated, such requests get a 429. With the `flowControl` feature gate on,
requests wait in priority bands instead and are dispatched as capacity frees
(epp/config/flowcontrol.py reads the section; docs/flow-control.md). What a
file may leave out, and what is used instead, is listed in `epp.config.defaults`.

`load_config` runs three steps, each with its own module:

1. `parse`: YAML text -> `ValidatedConfig` (document.py). Strict: every key, value,
   plugin type, parameter and reference is checked.
2. `defaults`: `ValidatedConfig` -> `CompleteConfig`. Every default is filled in,
   in that one place.
3. `build`: `CompleteConfig` -> `SchedulingConfig`. Plugins are built through
   their classes and the scheduler assembled.

Each step collects every error it can find, each with its path in the file, and
stops only then; `load_config` adds each error's line. So `epp validate` shows all
the errors it can at once, and nothing is returned unless the whole file is
valid: a broken file never yields a half-configured scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from epp.clock import SYSTEM_CLOCK, Clock
from epp.config.build import BuildResources, ObserveFactory, SchedulingConfig, build, no_observe
from epp.config.defaults import DEFAULT_CONFIG, complete
from epp.config.errors import ConfigError, InvalidConfig, Rejected, format_path
from epp.config.parse import read_yaml, validate
from epp.datastore import Datastore
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry

__all__ = [
    "DEFAULT_CONFIG",
    "ConfigError",
    "InvalidConfig",
    "ObserveFactory",
    "SchedulingConfig",
    "format_path",
    "load_config",
    "load_config_file",
]


def load_config(
    text: str,
    registry: PluginRegistry,
    *,
    source: str = "<config>",
    datastore: Datastore | None = None,
    metrics: CollectorRegistry | None = None,
    observe: ObserveFactory = no_observe,
    settings: ServerSettings | None = None,
    clock: Clock = SYSTEM_CLOCK,
    seed: int | None = None,
) -> SchedulingConfig:
    """Validate `text` and build its scheduling configuration, or raise
    `InvalidConfig` listing every error found. `clock` is the time the built
    plugins and services decide by (a simulation passes its virtual clock);
    `seed` seeds every plugin that draws at random and has no seed of its own."""
    document = read_yaml(text, source)
    resources = BuildResources(
        datastore=datastore if datastore is not None else Datastore(),
        metrics=metrics if metrics is not None else CollectorRegistry(),
        observe=observe,
        settings=settings if settings is not None else ServerSettings(),
        clock=clock,
        seed=seed,
    )
    try:
        validated = validate(document.data, registry)
        completed = complete(validated, registry)
        return build(completed, resources)
    except Rejected as exc:
        raise InvalidConfig(source, document.with_lines(exc.errors)) from None


def load_config_file(path: str | Path, registry: PluginRegistry, **kwargs: Any) -> SchedulingConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(str(path), [ConfigError((), f"cannot read the file: {exc}")]) from None
    return load_config(text, registry, source=str(path), **kwargs)
