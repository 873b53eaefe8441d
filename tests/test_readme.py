"""The README's example environment runs as written."""

import importlib.util
import re
import sys
from pathlib import Path


def test_readme_example_env_registers_and_checks(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"## Your own environment\n\n```python\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "readme_example.py"
    path.write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("readme_example", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "readme_example", module)
    spec.loader.exec_module(module)  # registers demo/times-v0 and asserts its check passes
    import agentrl

    env = agentrl.make("demo/times-v0")
    env.reset(options={"task": env.tasks[0]})
    assert env.step("<answer>3700</answer>")[1] == 1.0


def test_the_front_page_reads_in_five_minutes():
    """At most 120 lines, no table cell over 200 characters, no dated run history (the results pages keep it)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    cells = [c.strip() for line in readme.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    assert cells and max(map(len, cells)) <= 200, max(cells, key=len)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)  # dates belong to docs/results/
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#]+)", readme):  # every page it links to exists
        assert (Path(__file__).parents[1] / link).exists(), link
