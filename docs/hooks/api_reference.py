"""MkDocs hook: one API reference page per public module, generated at build time, so none can be missing.

The pages are `::: module` stubs that mkdocstrings fills in from the source. `agentrl.envs`, `.tools` and
`.trainers` live in top-level folders (pyproject's package-dir), where mkdocstrings would not look: the hook
first lays out `build/api-src/agentrl` as the installed package looks, in symbolic links to the sources.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
from pathlib import Path

from mkdocs.structure.files import File

PACKAGES = ("agentrl", "agentrl.envs", "agentrl.tools", "agentrl.trainers")
ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "build" / "api-src"  # mkdocs.yml points mkdocstrings here


def lay_out_sources() -> None:
    """`build/api-src/agentrl/`: `agentrl/` with `envs/`, `tools/`, `trainers/` inside, as real folders of
    links to the source files (griffe does not follow linked folders)."""
    shutil.rmtree(SOURCE, ignore_errors=True)
    folders = {"agentrl": SOURCE / "agentrl", **{name: SOURCE / "agentrl" / name for name in ("envs", "tools", "trainers")}}
    for folder, target in folders.items():
        for source in (ROOT / folder).rglob("*.py"):
            link = target / source.relative_to(ROOT / folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)


def public_modules() -> list[str]:
    """Every importable module of the packages whose dotted name has no `_`-prefixed part."""
    names = set(PACKAGES)
    for package in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.add(info.name)
    return sorted(names)


def page_path(module: str) -> str:
    return "reference/" + module.replace(".", "/") + ".md"


def on_startup(command, dirty):
    # Before any plugin's on_config: mkdocstrings drops search paths that do not exist when it sets up.
    lay_out_sources()


def on_config(config):
    pages = [{module: page_path(module)} for module in public_modules()]
    config["nav"].append({"API reference": ["reference/index.md", *pages]})
    return config


def on_files(files, config):
    modules = public_modules()
    index = ["# API reference", "", "One page per public module, built from its docstrings.", ""]
    index += [f"- [`{m}`]({page_path(m).removeprefix('reference/')})" for m in modules]
    files.append(File.generated(config, "reference/index.md", content="\n".join(index) + "\n"))
    for module in modules:
        files.append(File.generated(config, page_path(module), content=f"# `{module}`\n\n::: {module}\n"))
    return files
