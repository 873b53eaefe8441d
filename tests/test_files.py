"""`agentrl.system.files.write_folder`: a folder is replaced whole or not at all, and a killed writer's leftovers go."""

import os
import subprocess
import sys

import pytest

from agentrl.system import files
from agentrl.system.files import write_folder


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "index"
    write_folder(target, lambda d: (d / "a").write_text("1"))
    assert (target / "a").read_text() == "1"

    def fails(d):
        (d / "a").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_folder(target, fails)
    assert (target / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    write_folder(target, lambda d: (d / "b").write_text("2"))
    assert [p.name for p in target.iterdir()] == ["b"]  # replaced, not merged


def test_a_killed_writers_folder_is_removed_by_the_next_writer(tmp_path):
    target = tmp_path / "checkpoint"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f".checkpoint.tmp-{dead.stdout.strip()}"  # a writer SIGKILLed mid-write
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_text("half")
    write_folder(target, lambda d: (d / "model.safetensors").write_text("whole"))
    assert not abandoned.exists() and (target / "model.safetensors").read_text() == "whole"


def test_the_data_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = files._fsync, files.Path.rename
    monkeypatch.setattr(files, "_fsync", lambda p: (events.append(("fsync", p.name)), real_fsync(p)))
    monkeypatch.setattr(files.Path, "rename", lambda p, to: (events.append(("rename", p.name)), real_rename(p, to))[1])

    def write(d):
        (d / "weights").write_text("w")
        (d / "sub").mkdir()
        (d / "sub" / "part").write_text("p")

    write_folder(tmp_path / "ckpt", write)
    renamed = events.index(("rename", f".ckpt.tmp-{os.getpid()}"))
    flushed = {name for kind, name in events[:renamed] if kind == "fsync"}
    assert {"weights", "part", "sub", f".ckpt.tmp-{os.getpid()}"} <= flushed
    assert events[renamed + 1:] == [("fsync", tmp_path.name)]  # the rename itself, in the parent directory
