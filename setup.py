"""Packages for setuptools: every package below each folder that pyproject.toml's package-dir maps (the only
thing pyproject.toml cannot say: `packages.find` does not follow package-dir's mapping). Data folders without an
`__init__.py` (templates, Dockerfiles) are namespace packages, so that setuptools ships their files as package data
rather than warning that they are importable but not listed."""

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup

package_dir = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
packages = [sub for name, folder in package_dir.items()
            for sub in (name, *(f"{name}.{p}" for p in find_namespace_packages(folder, exclude=["*__pycache__*"])))]
setup(packages=sorted(set(packages)))
