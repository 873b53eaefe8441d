"""Typed configs from TOML: recipes load; unknown keys, bad types and impossible combinations are errors."""

import dataclasses
import typing
from pathlib import Path

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.cli.jobs import RolloutJob

RECIPES = Path(__file__).parents[1] / "recipes"


def test_cpu_demo_recipe_loads_with_overrides():
    job = load_config(RolloutJob, RECIPES / "cpu_demo.toml", {"n": 8, "rollout": {"sampling": {"temperature": 0.5}}})
    assert job.env == "math/arith-v0" and job.n == 8 and job.env_kwargs == {"max_turns": 4}
    assert job.rollout.sampling.temperature == 0.5 and job.rollout.sampling.max_tokens == 64  # untouched


@pytest.mark.parametrize("data,message", [
    ({"env": "e"}, "model: Field required"),
    ({"env": "e", "model": "m", "rollout": {"sampling": {"max_tokenz": 3}}}, "rollout.sampling.max_tokenz: Unexpected"),
    ({"env": "e", "model": "m", "n": "many"}, "n: Input should be a valid integer"),
    ({"env": "e", "model": "m", "rollout": {"max_total_tokens": 100, "sampling": {"max_tokens": 200}}},
     "must be below max_total_tokens"),
    ({"env": "e", "model": "m", "rollout": {"sampling": {"n": 4}}}, "use group_size"),
])
def test_invalid_configs_name_the_problem(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RolloutJob, data)


@pytest.mark.parametrize("grpo,message", [
    ({"steps": -1}, "steps must be >= 0, got -1"),
    ({"tasks_per_step": 0}, "tasks_per_step must be >= 1, got 0"),
    ({"checkpoint_every": -1}, "checkpoint_every must be >= 0, got -1"),
    ({"epochs": 0, "minibatch_size": 0}, "epochs must be >= 1, got 0; minibatch_size must be >= 1, got 0"),
    ({"lr": 0.0}, "lr and max_grad_norm must be > 0"),
])
def test_rl_counts_that_cannot_run_are_refused_at_load(grpo, message):
    """Each of these once loaded and ran nothing (exit 0), or failed after the model was loaded."""
    from agentrl.trainers.job.recipe import TrainJob

    with pytest.raises(ConfigError, match=message):
        load_config(TrainJob, {"env": "math/arith-v0", "model": "m", "grpo": grpo})


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("env = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(RolloutJob, bad)
    with pytest.raises(ConfigError, match="No recipe"):
        load_config(RolloutJob, tmp_path / "missing.toml")


def test_overrides_reach_list_elements_by_index_and_a_bad_index_names_the_range():
    from agentrl.cli.common import parse_sets
    from agentrl.trainers.job.recipe import TrainJob

    recipe = RECIPES / "cpu_search_r1_train.toml"
    job = load_config(TrainJob, recipe, parse_sets(["sft.1.episodes=16", "sft.0.env_kwargs.train_worlds=2",
                                                    "eval.split.0=train"]))
    first, second = job.sft_stages
    assert (first.episodes, first.env_kwargs, first.config.last_turn_only) == (16384, {"train_worlds": 2}, True)
    assert (second.episodes, second.error_rate, second.config.epochs) == (16, 0.3, 2)
    assert job.eval.split == ["train", "unseen_compositions", "more_hops", "paraphrase"]
    with pytest.raises(ConfigError, match=r"\['2'\] would index a list of 2: use 0 to 1"):
        load_config(TrainJob, recipe, parse_sets(["sft.2.episodes=16"]))


TRAIN = {"env": "math/arith-v0", "model": "m"}


@pytest.mark.parametrize("section,message", [
    ({"grpo": {"steps": "20"}}, r"grpo.steps: Input should be a valid integer, got '20'"),  # no number from a string
    ({"grpo": {"lr": "1e-4"}}, r"grpo.lr: Input should be a valid number, got '1e-4'"),
    ({"grpo": {"rollout": {"seed": 3}}}, r"grpo.rollout.seed is derived from grpo.seed"),
    ({"grpo": {"rollout": {"group_size": 4}}}, r"grpo.rollout.group_size: the group is the method's, set grpo.group_size"),
    ({"eval": {"temperature": 0.5, "rollout": {"sampling": {"temperature": 0.7}}}}, r"set eval.temperature instead"),
    ({"ppo": {"rollout": {"seed": 3}}, "grpo": {}}, r"ppo.rollout.seed is derived from ppo.seed"),
    ({"dpo": {"rollout": {"seed": 3}}}, r"dpo.rollout.seed is derived from dpo.seed"),
    ({"grpo": {"rollout": {"sampling": {"seed": 1}}}}, r"sampling.seed: each turn's sampling seed is derived"),
    ({"grpo": {"kl_kind": "k4"}}, r"kl_kind must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
])
def test_train_job_refuses_strings_for_numbers_and_seeds_it_would_overwrite(section, message):
    from agentrl.trainers.job.recipe import TrainJob

    with pytest.raises(ConfigError, match=message):
        load_config(TrainJob, {**TRAIN, **section})


def test_a_table_that_leaves_a_key_out_gets_what_no_table_gives():
    from agentrl.trainers.job.recipe import TrainJob

    bare, bare_dpo = load_config(TrainJob, TRAIN), load_config(TrainJob, {**TRAIN, "dpo": {}})
    tables = load_config(TrainJob, {**TRAIN, "grpo": {"rollout": {"max_turns": 4}},
                                    "eval": {"rollout": {"sampling": {"max_tokens": 32}}}})
    dpo = load_config(TrainJob, {**TRAIN, "dpo": {"rollout": {"max_turns": 4}}})
    assert bare.grpo.group_size == tables.grpo.group_size == 8
    assert bare_dpo.dpo.group_size == dpo.dpo.group_size == 4
    assert bare.eval.rollout.sampling.temperature == tables.eval.rollout.sampling.temperature == 0.0  # greedy
    assert (tables.grpo.rollout.max_turns, tables.eval.rollout.sampling.max_tokens) == (4, 32)  # and the table's own


def test_eval_rollout_starts_from_the_rl_rollout_greedy_and_keeps_what_it_sets():
    from agentrl.trainers.job.recipe import TrainJob

    rl = {"max_turns": 3, "max_total_tokens": 700, "step_timeout": 9.0,
          "sampling": {"max_tokens": 48, "temperature": 0.9, "stop": ["</answer>"]}}
    inherited = load_config(TrainJob, {**TRAIN, "grpo": {"rollout": rl}}).eval.rollout
    assert load_config(TrainJob, {**TRAIN, "grpo": {"rollout": rl}, "eval": {"n": 5}}).eval.rollout == inherited
    assert (inherited.max_turns, inherited.max_total_tokens, inherited.step_timeout) == (3, 700, 9.0)
    assert (inherited.sampling.max_tokens, inherited.sampling.stop) == (48, ("</answer>",))
    assert (inherited.group_size, inherited.sampling.temperature) == (1, 0.0)  # one greedy episode per task
    own = load_config(TrainJob, {**TRAIN, "grpo": {"rollout": rl},
                                 "eval": {"n": 5, "temperature": 0.5, "rollout": {"max_turns": 6}}})
    assert (own.eval.n, own.eval.rollout.max_turns, own.eval.rollout.sampling.temperature) == (5, 6, 0.5)
    assert (own.eval.rollout.max_total_tokens, own.eval.rollout.sampling.max_tokens) == (700, 48)
    ppo = load_config(TrainJob, {**TRAIN, "ppo": {"rollout": {"max_turns": 2}}})
    assert ppo.eval.rollout.max_turns == 2  # the method's own rollout
    # an --set on the RL rollout reaches the evaluation too, unless the recipe's [eval.rollout] sets the key
    assert load_config(TrainJob, {**TRAIN, "eval": {"rollout": {"max_turns": 6}}},
                       {"grpo": {"rollout": {"max_turns": 2, "env_workers": 3}}}).eval.rollout.env_workers == 3
    with pytest.raises(ConfigError, match=r"eval.rollout.max_turnz"):  # unknown keys still named where they are
        load_config(TrainJob, {**TRAIN, "grpo": {"rollout": {"max_turnz": 2}}})


def test_the_correction_is_on_by_default_with_a_vllm_engine_and_off_in_process():
    from agentrl.trainers.job.recipe import TrainJob
    from agentrl.trainers.losses import CorrectionConfig

    vllm = {**TRAIN, "engine": {"kind": "vllm"}}
    assert load_config(TrainJob, TRAIN).grpo.correction == CorrectionConfig()  # the sampler is the trainer's model
    assert load_config(TrainJob, vllm).grpo.correction == CorrectionConfig(decoupled=True, tis="token")
    assert load_config(TrainJob, {**vllm, "ppo": {}}).ppo.correction == CorrectionConfig(decoupled=True, tis="token")
    assert load_config(TrainJob, vllm, {"grpo": {"loss": "clip_cov"}}).grpo.correction == \
        CorrectionConfig(decoupled=True, mis="token")  # TIS is exact for the advantage-weighted losses only
    off = load_config(TrainJob, {**vllm, "grpo": {"correction": {"decoupled": False}}})
    assert off.grpo.correction == CorrectionConfig()  # a recipe's own table, even an empty one, is kept as written
    assert load_config(TrainJob, {**vllm, "dpo": {}}).dpo == load_config(TrainJob, {**TRAIN, "dpo": {}}).dpo


def test_a_lora_job_with_a_vllm_engine_serves_adapters_of_its_rank():
    from agentrl.trainers.job.recipe import TrainJob

    vllm = {**TRAIN, "engine": {"kind": "vllm"}}
    job = load_config(TrainJob, {**vllm, "lora": {"r": 8}, "grpo": {"max_staleness": 1}})
    assert (job.engine.lora_rank, job.engine.max_loras) == (8, 2)  # a version per weight version in flight
    assert load_config(TrainJob, {**vllm, "lora": {}}).engine.lora_rank == 16  # [lora]'s default r
    assert load_config(TrainJob, {**TRAIN, "lora": {}}).engine.lora_rank is None  # in process: no server
    for data, message in [({**vllm, "engine": {"kind": "vllm", "lora_rank": 8}}, "got no \\[lora\\]"),
                          ({**vllm, "lora": {"r": 16}, "engine": {"kind": "vllm", "lora_rank": 8}}, "got lora.r = 16"),
                          ({**vllm, "lora": {}, "engine": {"kind": "vllm", "lora_rank": 16, "max_loras": 1},
                            "grpo": {"max_staleness": 1}}, "cannot hold the max_staleness"),
                          ({**vllm, "lora": {}, "grpo": {"max_staleness": 1}, "ray": {"sources": 1}},
                           "do not follow yet")]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainJob, data)


def test_strict_types_still_take_toml_arrays_for_tuples_and_integers_for_floats():
    from agentrl.cli.jobs import EvalJob
    from agentrl.trainers.job.recipe import TrainJob

    sampling = {"stop": ["</answer>"], "top_p": 1}
    job = load_config(RolloutJob, {"env": "e", "model": "m", "rollout": {"sampling": sampling}})
    assert job.rollout.sampling.stop == ("</answer>",) and job.rollout.sampling.top_p == 1.0
    # tables with table defaults too (a validator there saw Python lists, which strict mode refused for tuples)
    train = load_config(TrainJob, {**TRAIN, "grpo": {"rollout": {"sampling": sampling}}})
    assert train.grpo.rollout.sampling.stop == train.eval.rollout.sampling.stop == ("</answer>",)
    assert load_config(EvalJob, {"suite": "s", "model": "m", "rollout": {"sampling": sampling}}
                       ).rollout.sampling.stop == ("</answer>",)


def test_eval_job_is_typed_and_refuses_what_cannot_work(tmp_path):
    from agentrl.cli.jobs import EvalJob

    recipe = tmp_path / "eval.toml"
    recipe.write_text('suite = "math/demo-heldout"\nmodel = "m"\nk = [1, 4]\ntemperature = 0.7\n')
    job = load_config(EvalJob, recipe, {"n": 5})
    assert job.k == [1, 4] and job.n == 5 and job.rollout.sampling.temperature == 0.7
    assert job.rollout.sampling.max_tokens == 256  # the rest of the table keeps its defaults
    assert load_config(EvalJob, {"suite": "s", "model": "m"}).rollout.sampling.temperature == 0.0  # greedy
    for data, message in [({"k": [1, 8]}, "pass@8 over greedy samples"), ({"k": [0]}, "positive integers"),
                          ({"rollout": {"group_size": 4}}, "set k instead"), ({"n": "20"}, "valid integer"),
                          ({"rollout": {"sampling": {"temperature": 0.7}}}, "set temperature instead")]:
        with pytest.raises(ConfigError, match=message):
            load_config(EvalJob, {"suite": "s", "model": "m", **data})


def keys(cls, skip=()) -> list[str]:
    """The dotted leaf keys a recipe can set in a config class (its nested tables expanded), less `skip`'s tables."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        table = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if dataclasses.is_dataclass(t)]
        out += [f"{f.name}.{key}" for key in keys(table[0])] if table else [f.name]
    return out


def test_a_job_holds_fewer_than_250_keys_whatever_its_method():
    """A recipe holds one RL method's table (a second is refused), so a job's keys are the shared tables' and that
    method's: fewer than 250 for each (issue 53), the method tables' union aside."""
    from agentrl.trainers.job.recipe import TrainJob
    from agentrl.trainers.methods import METHODS

    per_method = {name: len(keys(TrainJob, skip=[m for m in METHODS if m not in (name, METHODS[name].settings)]))
                  for name in METHODS}
    assert max(per_method.values()) < 250 and min(per_method.values()) > 150, per_method
