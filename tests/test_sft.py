"""SFT on trajectories: the loss covers exactly the masked tokens, or with `last_turn_only` those of the last turn."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainers.sft import SFTConfig, last_turn_only, sft
from agentrl.types import Trajectory, Turn

#                 prompt | turn 1 | observation | turn 2 (its 2nd token a tandem partner's: mask 0)
IDS = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)
MASK = (0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1)


def trajectory() -> Trajectory:
    return Trajectory("t", IDS, MASK, (0.0,) * len(IDS), prompt_len=2,
                      turns=(Turn(2, 5, 8), Turn(8, 11, 11)), reward=1.0)


def test_last_turn_only_keeps_the_mask_of_the_last_turn_and_nothing_else():
    cut = last_turn_only(trajectory())
    assert cut.loss_mask == (0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1)
    assert cut.token_ids == IDS and cut.turns == trajectory().turns


@pytest.mark.parametrize("last_turn", [False, True])
def test_the_first_step_loss_is_the_mean_nll_of_the_trained_tokens(tiny_model_dir, last_turn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([IDS])).logits[0, :-1], -1)
    nll = [-logp[t - 1, IDS[t]].item() for t in range(len(IDS))
           if (last_turn_only(trajectory()) if last_turn else trajectory()).loss_mask[t]]
    history = sft(model, [trajectory()], SFTConfig(epochs=1, lr=0.0, last_turn_only=last_turn))
    assert len(nll) == (2 if last_turn else 5)
    assert history[0]["loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_micro_batches_by_token_budget_give_the_whole_batch_step(tiny_model_dir):
    """Gradient accumulation: a step cut into micro-batches of at most 12 padded tokens (one row each here) has the
    loss and the gradient of the step over the whole batch (left in `.grad`: lr 0 keeps the weights); rows of
    unequal length, so that their shares of the step's tokens differ."""
    short = Trajectory("s", IDS[:6], MASK[:6], (0.0,) * 6, prompt_len=2, turns=(Turn(2, 5, 6),), reward=1.0)
    rows = [trajectory(), short, trajectory()]
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cut = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (whole_row,) = sft(whole, rows, SFTConfig(epochs=1, lr=0.0, batch_size=3))
    (cut_row,) = sft(cut, rows, SFTConfig(epochs=1, lr=0.0, batch_size=3, micro_batch_tokens=12))
    assert cut_row["loss"] == pytest.approx(whole_row["loss"], rel=1e-5)
    assert cut_row["grad_norm"] == pytest.approx(whole_row["grad_norm"], rel=1e-4)
    for (name, a), b in zip(whole.named_parameters(), cut.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name
