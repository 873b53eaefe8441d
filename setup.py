"""Packages for setuptools: every package below each folder that pyproject.toml's package-dir maps (the only
thing pyproject.toml cannot say: `packages.find` does not follow package-dir's mapping)."""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

package_dir = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
packages = [sub for name, folder in package_dir.items()
            for sub in (name, *(f"{name}.{p}" for p in find_packages(folder)))]
setup(packages=sorted(set(packages)))
