"""`agentrl doctor`: each missing part is named with the command that installs it, and the exit code says so."""

import json
from pathlib import Path

from typer.testing import CliRunner

from agentrl.cli import doctor
from agentrl.cli.main import app


def test_a_missing_docker_daemon_is_named_with_make_setup_docker(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # as on a machine without a daemon
    check = doctor.docker_daemon()
    assert not check.ok and check.found == "no daemon answers" and check.fix.startswith("make setup-docker")
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["Docker"]["ok"] is False and "make setup-docker" in checks["Docker"]["fix"]
    assert checks["Python"]["ok"] and set(checks) >= {"torch", "vLLM", "Chromium", "SWE tasks", "disk", "memory"}


def test_a_missing_model_and_a_failing_check_name_their_fix(monkeypatch, tmp_path):
    monkeypatch.setattr("agentrl.models.fetch.model_dir", lambda name: Path(tmp_path) / name)
    assert doctor.models().fix == "make model-smollm2"

    def broken() -> doctor.Check:
        raise RuntimeError("boom")
    monkeypatch.setattr(doctor, "CHECKS", (broken, doctor.python))
    checks = doctor.run_checks()  # one check that raises does not stop the others
    assert [(c.name, c.ok) for c in checks] == [("broken", False), ("Python", True)] and "boom" in checks[0].found
