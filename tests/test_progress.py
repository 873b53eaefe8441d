"""The line `agentrl train` prints for each RL step."""

from agentrl.trainers.progress import progress_line

STEP = {"mean_reward": 0.5, "success": 0.5, "time": {"rollout": 60.0, "train": 200.0}}


def test_a_step_line_shows_entropy_and_kl():
    line = progress_line(3, 8, {**STEP, "entropy": 0.0123, "approx_kl": 0.00042})
    assert line == "step 3/8  reward 0.500  success 0.500  entropy 0.012  kl 0.0004  rollout 60.0s train 200.0s"


def test_a_loss_without_a_kl_estimate_shows_none():
    """A user's policy loss (the new-loss tutorial's) need not report `approx_kl`."""
    line = progress_line(3, 8, {**STEP, "entropy": 0.0123})
    assert line == "step 3/8  reward 0.500  success 0.500  entropy 0.012  rollout 60.0s train 200.0s"


def test_a_step_that_trained_nothing_says_so_instead_of_nan():
    """Every row inert (each group's rewards equal): the loop made no forward pass, so no entropy or KL exists."""
    line = progress_line(4, 8, {**STEP, "skipped_rows_frac": 1.0})
    assert line == ("step 4/8  reward 0.500  success 0.500  no update (every row's advantage 0)  "
                    "rollout 60.0s train 200.0s")
