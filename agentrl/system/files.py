"""Folders written whole: a checkpoint, a saved model, a search index.

`write_folder(path, write)` has `write` fill a new folder beside `path`, then renames it into place, so that a
process killed while writing leaves the folder that was there before (or none), never half of one. A directory
cannot be renamed over a non-empty one, so the old folder is moved aside first and deleted after. The new and
old folders are named after the writing process (`.NAME.tmp-PID`, `.NAME.old-PID`): two processes writing the
same path each write their own, and what a killed process left behind is removed by the next writer.

The new folder's files are flushed to disk before the rename, and the parent directory after it: otherwise a
machine that loses power can keep the rename but not the data (zero-length files under the new name).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable


def write_folder(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(folder)` into a new, empty folder, then renamed to `path` (replacing any old one); returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(path)
    tmp, old = (path.with_name(f".{path.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_tree(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _fsync_tree(folder: Path) -> None:
    """Every file and directory under `folder`, and `folder` itself, flushed to disk."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_abandoned(path: Path) -> None:
    """The new and old folders of `path` that writers which no longer run left behind."""
    for folder in path.parent.glob(f".{path.name}.*-*"):
        match = re.fullmatch(rf"\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)", folder.name)
        if match and not _running(int(match[1])):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
