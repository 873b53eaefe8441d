"""The layer rule of DESIGN.md ("Layers"), read from every module's imports (lazy ones inside functions too).

Lower layers never import higher ones, in the order of `LAYER` (docs/architecture.md and DESIGN.md state it as `order()`
writes it). The core never imports a particular environment (`agentrl.envs`) or a trainer; env families use only the
env API, the tools and the types.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: the folders that make up the `agentrl` namespace (containers/ is data)
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = {package: folder for package, folder in PACKAGE_DIR.items() if package != "agentrl.containers"}
# The layer of each part of the namespace (longest prefix wins), lowest first.
LAYER = {
    "agentrl.types": 0, "agentrl.config": 0, "agentrl.system": 0,
    "agentrl.tools": 1,
    "agentrl.renderer": 2, "agentrl.models": 2,
    "agentrl.policy": 3,
    "agentrl": 4, "agentrl.env": 4,  # `agentrl` itself is the public face of the env API
    "agentrl.rollout": 5,
    "agentrl.eval": 6, "agentrl.gateway": 6,
    "agentrl.envs": 7,  # above the core: the core imports no particular env
    "agentrl.trainers": 8,
    "agentrl.cli": 9,
}
ENVS_MAY_IMPORT = {"agentrl", "agentrl.types", "agentrl.config", "agentrl.system", "agentrl.tools", "agentrl.env",
                   "agentrl.envs"}


def part(module: str) -> str:
    """The key of `LAYER` that `module` belongs to."""
    return max((p for p in LAYER if module == p or module.startswith(p + ".")), key=len)


def modules() -> dict[str, Path]:
    """Every module of the namespace, by dotted name."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((package, *parts)).removesuffix(".__init__")] = path
    return found


def imported(source: str, module: str) -> set[str]:
    """The `agentrl` modules that `source` (the text of `module`) imports, anywhere in the file; `from a import b`
    counts as `a.b` (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = module.rsplit(".", node.level)[0] if node.level else ""  # relative: from the importing package
            frm = ".".join(filter(None, (base, node.module)))
            names |= {f"{frm}.{a.name}" for a in node.names}
    return {n for n in names if n == "agentrl" or n.startswith("agentrl.")}


def forbidden(module: str, target: str) -> str | None:
    """Why `module` may not import `target`, or None if it may."""
    src, dst = part(module), part(target)
    if src == "agentrl.envs" and dst not in ENVS_MAY_IMPORT:
        return f"env families use only the env API, the tools and the types, not {dst}"
    if LAYER[dst] > LAYER[src]:
        return f"{src} (layer {LAYER[src]}) is below {dst} (layer {LAYER[dst]})"
    return None


def edges() -> list[str]:
    """Every forbidden import edge of the tree, as 'module -> target: why'."""
    bad = []
    for module, path in sorted(modules().items()):
        for target in sorted(imported(path.read_text(), module)):
            if why := forbidden(module, target):
                bad.append(f"{module} -> {target}: {why}")
    return bad


def order() -> str:
    """`LAYER` as the docs state it: `types/config/system → tools → ...`, the parts of one layer joined by `/`."""
    layers: dict[int, list[str]] = {}
    for name, layer in LAYER.items():
        if name != "agentrl":  # the package itself is the env API's public face, named `env`
            layers.setdefault(layer, []).append(name.removeprefix("agentrl."))
    return " → ".join("/".join(names) for _, names in sorted(layers.items()))


def test_the_docs_state_the_layers_in_this_order() -> None:
    """The architecture page and DESIGN.md (a file of the project kept beside the repository, `../shared/`, where one
    is) say the order `LAYER` holds, in the same words; the parts of one layer may be joined by `/` or `, `
    (DESIGN.md, read-only here, writes `renderer, models`)."""
    docs = [ROOT / "docs" / "architecture.md"] + [path for path in (ROOT.parent / "shared" / "DESIGN.md",) if path.exists()]
    for doc in docs:
        text = " ".join(doc.read_text().split()).replace(", ", "/")  # line breaks as spaces, one way to join parts
        assert order() in text, f"{doc.name} does not state the layer order as `{order()}`"


def test_no_module_imports_a_higher_layer() -> None:
    assert edges() == []


def test_every_module_has_a_layer() -> None:
    found = modules()
    assert len(found) > 100  # the walk found the tree
    assert all(part(m) for m in found)  # max() of no candidates would have raised


@pytest.mark.parametrize(("module", "source", "why"), [
    ("agentrl.policy.parity", "from agentrl.trainers.batch import token_logprobs", "agentrl.policy (layer 3) is below"),
    ("agentrl.models.tiny", "def f():\n    from agentrl.envs.search.env import _world", "below agentrl.envs"),
    ("agentrl.rollout.engine", "import agentrl.cli.jobs", "below agentrl.cli"),
    ("agentrl.tools.parsers", "from agentrl import make", "agentrl.tools (layer 1) is below agentrl (layer 4)"),
    ("agentrl.policy.router", "from agentrl import rollout", "agentrl.policy (layer 3) is below agentrl.rollout"),
    ("agentrl.envs.math.env", "from agentrl.rollout.engine import RolloutEngine", "not agentrl.rollout"),
    ("agentrl.env.adapters.skyrl_env", "from ...envs.math import ArithmeticEnv", "below agentrl.envs"),
])
def test_a_forbidden_edge_is_named(module: str, source: str, why: str) -> None:
    [target] = imported(source, module)
    assert why in (forbidden(module, target) or ""), target


def test_allowed_edges_pass() -> None:
    assert forbidden("agentrl.trainers.methods.grpo", "agentrl.envs") is None  # trainers use anything below the CLI
    assert forbidden("agentrl.envs.search.env", "agentrl.tools.parsers") is None
    assert forbidden("agentrl.policy.hf", "agentrl.models.tokenizer") is None
    assert forbidden("agentrl.cli.main", "agentrl.trainers.job.pipeline") is None
