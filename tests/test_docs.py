"""The documentation's promises: every public module, class, function and method has a docstring (the API
reference is built from them), and every page of the API reference exists."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _hook():
    """The docs build's hook: it lists the public modules the API reference has a page for."""
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "docs" / "hooks" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


public_modules = _hook().public_modules


def undocumented(module_name: str) -> list[str]:
    """Public objects defined in the module without a docstring (a method may inherit its base's)."""
    module = importlib.import_module(module_name)
    missing = [] if module.__doc__ else [module_name]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isfunction(obj) and not obj.__doc__:
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            if not obj.__dict__.get("__doc__"):
                missing.append(f"{module_name}.{name}")
            for attr, member in vars(obj).items():
                function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if attr.startswith("_") or not inspect.isfunction(function) or function.__name__ == "<lambda>":
                    continue  # a lambda is a field's default value, not a method
                if not inspect.getdoc(getattr(obj, attr)):
                    missing.append(f"{module_name}.{name}.{attr}")
    return missing


def test_every_public_object_has_a_docstring() -> None:
    missing = [name for module in public_modules() for name in undocumented(module)]
    assert not missing, f"{len(missing)} public objects have no docstring:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_docstring(tmp_path, monkeypatch) -> None:
    (tmp_path / "docless.py").write_text('"""A module."""\n\ndef f():\n    pass\n\n\nclass C:\n    """C."""\n\n'
                                         '    def m(self):\n        pass\n')
    monkeypatch.syspath_prepend(tmp_path)
    assert undocumented("docless") == ["docless.f", "docless.C.m"]
