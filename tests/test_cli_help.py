"""Every command's `--help`: it shows an example, and loses no word of any option's help (rich markup once ate
bracketed text such as `[ray]`)."""

import re

import pytest
import typer
from typer.testing import CliRunner

from agentrl.cli.main import app

ROOT = typer.main.get_command(app)


def commands(group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(path, command) of every command under `group` (typer's own click: groups are the ones with commands)."""
    out = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            out += commands(command, (*path, name))
        else:
            out.append(((*path, name), command))
    return out


def words(text: str) -> str:
    """`text` with its whitespace normalized, and the line breaks that wrapping puts after hyphens undone."""
    return re.sub(r"\s+", " ", re.sub(r"-\n\s*", "-", text)).strip()


@pytest.mark.parametrize("path,command", commands(ROOT), ids=lambda x: " ".join(x) if isinstance(x, tuple) else "")
def test_help_shows_an_example_and_every_options_words(path, command):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = words(result.output)
    assert f"agentrl {' '.join(path)}" in shown.split("Example:", 1)[-1], f"no example of `agentrl {' '.join(path)}`"
    for param in command.params:
        if getattr(param, "help", None):
            assert words(param.help) in shown, f"--help lost words of {param.name}'s help: {param.help!r}"


def test_scripts_get_plain_json(tmp_path):
    import json

    envs = json.loads(CliRunner().invoke(app, ["envs", "list", "--json"]).stdout)
    assert {"id": "math/arith-v0"}.items() <= next(e for e in envs if e["id"] == "math/arith-v0").items()
    suites = json.loads(CliRunner().invoke(app, ["suites", "--json"]).stdout)
    assert suites and all({"name", "entries"} <= set(s) for s in suites)
