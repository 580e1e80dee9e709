"""Hypothesis settings shared by the property-based tests (`*_fuzz.py`).

Two profiles, chosen with the HYPOTHESIS_PROFILE environment variable:

- `ci` (the default): derandomized, so every run tries the same examples and a
  failure reproduces exactly; each property's example count is the modest one it
  names (`examples(n)`), which keeps all the properties within about a minute on
  two cores; no example database is written.
- `long`: random examples, 50 times as many, the example database kept under
  `.hypothesis/` so a failure found is replayed first next time. For a fuzzing
  session: `HYPOTHESIS_PROFILE=long pytest tests/epp tests/plugins -k "fuzz or tenant" --timeout=0`
  (pytest-timeout's 120 s per test would cut it short).

Import this module before defining a property: it loads the profile.
"""

from __future__ import annotations

import os
from typing import Final

from hypothesis import HealthCheck, settings

PROFILE: Final = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_SCALE: Final = {"ci": 1, "long": 50}

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    # Timing is not what these tests are about, and a loaded CI machine would make a
    # deadline flaky.
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if PROFILE not in _SCALE:
    raise RuntimeError(f"HYPOTHESIS_PROFILE={PROFILE!r}: expected one of {sorted(_SCALE)}")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A property's example count under the current profile (`n` in CI)."""
    return n * _SCALE[PROFILE]
