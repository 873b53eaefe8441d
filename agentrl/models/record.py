"""The build record of a model folder: what made it and the sha256 of every file, so that a complete build is
not redone and a changed or truncated file is found (`agentrl model init`, `agentrl model fetch`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

BUILD_FILE = "agentrl_build.json"


def sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks (weights are hundreds of MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each file of the build (weights, tokenizer, configs, template), by name."""
    return {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != BUILD_FILE}


def write_record(folder: Path, record: dict) -> None:
    """`record` plus the hashes of the folder's files, as the folder's build record."""
    (folder / BUILD_FILE).write_text(json.dumps({**record, "files": file_hashes(folder)}, indent=2) + "\n")


def changed_files(folder: Path, record: dict) -> list[str] | None:
    """None if `folder` holds a complete build made from `record`; otherwise what differs (no build record,
    another recipe, or the names of files that are missing or changed)."""
    try:
        found = json.loads((folder / BUILD_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return [BUILD_FILE]
    if any(found.get(k) != v for k, v in record.items()) or not found.get("files"):
        return [f"{BUILD_FILE} (another build)"]
    # Files added to the folder later (e.g. by a user) don't matter; changed or missing build files do.
    return [name for name, digest in found["files"].items()
            if not (folder / name).is_file() or sha256(folder / name) != digest] or None
