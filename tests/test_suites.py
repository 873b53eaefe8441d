"""Evaluation suites: registered like envs, or read from TOML; bad definitions fail with the key named."""

import pytest

from agentrl.config import ConfigError
from agentrl.env.registry import make
from agentrl.env.suites import Suite, SuiteEntry, get_suite, register_suite, suites


def test_builtin_suites_name_real_envs_and_splits():
    known = suites()
    assert {"math/heldout", "search/heldout", "code/heldout"} <= set(known)
    for suite in known.values():
        for entry in suite.entries:
            env = make(entry.env, split=entry.split, **entry.env_kwargs)
            assert len(env.tasks) >= entry.n_tasks, entry.name


def test_suite_from_toml(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('name = "my/heldout"\nversion = 2\n'
                    '[[entries]]\nenv = "search/r1-v0"\nsplit = "more_hops"\nn_tasks = 10\nenv_kwargs = { topk = 1 }\n'
                    '[[entries]]\nenv = "math/arith-v0"\nsplit = "heldout"\n')
    suite = get_suite(str(path))
    assert suite == Suite("my/heldout", (SuiteEntry("search/r1-v0", "more_hops", 10, {"topk": 1}),
                                         SuiteEntry("math/arith-v0", "heldout")), version=2)
    assert [e.name for e in suite.entries] == ["search/r1-v0:more_hops", "math/arith-v0:heldout"]


@pytest.mark.parametrize("body, problem", [
    ('name = "x"\nentries = []\n', "no entries"),
    ('name = "x"\n[[entries]]\nenv = "a"\nsplit = "b"\nn_task = 3\n', "n_task"),
    ('name = "x"\n[[entries]]\nenv = "a"\nsplit = "b"\nn_tasks = 0\n', "n_tasks must be >= 1"),
    ('name = "x"\n[[entries]]\nenv = "a"\nsplit = "b"\n[[entries]]\nenv = "a"\nsplit = "b"\n', "twice"),
])
def test_bad_suite_files_name_the_problem(tmp_path, body, problem):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=problem):
        get_suite(str(path))


def test_registration_and_lookup_errors():
    suite = Suite("test/tiny", (SuiteEntry("math/arith-v0", "heldout", 3),))
    register_suite(suite)
    register_suite(suite)  # the same definition again is fine
    assert get_suite("test/tiny") is suite
    with pytest.raises(ValueError, match="already registered"):
        register_suite(Suite("test/tiny", (SuiteEntry("math/arith-v0", "heldout", 4),)))
    with pytest.raises(KeyError, match="Did you mean 'search/heldout'"):
        get_suite("search/heldot")


def test_suite_recipes_load():
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[1] / "recipes").glob("*suite*.toml"))
    assert recipes
    for path in recipes:
        suite = get_suite(str(path))
        for entry in suite.entries:
            assert len(make(entry.env, split=entry.split, **entry.env_kwargs).tasks) >= entry.n_tasks
