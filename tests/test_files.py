"""`agentrl.files.write_folder`: a folder is replaced whole or not at all, and a killed writer's leftovers go."""

import subprocess
import sys

import pytest

from agentrl.files import write_folder


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
