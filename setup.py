"""Which packages the distribution holds; everything else is in pyproject.toml.

The built-in plugins live in the top-level plugins/ folder, one module each, where
a newcomer looks for them; they install as `epp.plugins`, so the wheel puts only
`epp` into site-packages. The simulator and the benchmark (sim/, bench/) are tools
of a checkout (`python -m sim`, `python -m bench`) and are not installed.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["epp", "epp.*"]), "epp.plugins"],
    package_dir={"epp.plugins": "plugins"},
)
