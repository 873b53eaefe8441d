"""The arithmetic agent of `calculator_openai.py`, written with the OpenAI Agents SDK (`openai-agents`), plus a
checker sub-agent: a second model call with its own prompt, so that one session records two segments.

Nothing here knows about training: the SDK talks to whatever OpenAI-compatible server `base_url` names. To train
it, point a recipe's `[agent] program` at `examples.agents.calculator_agents_sdk:solve` (with `tool_parser =
"react"`), or try it by hand against a gateway:

    agentrl serve gateway --model runs/demo/sft_model --tool-parser react &
    python examples/agents/calculator_agents_sdk.py "Compute 9 + 14 - 13."

Why the checker runs after the solver rather than as the solver's tool (`checker.as_tool(...)`): the CPU demo's
model was tuned on the math env's prompt with one tool, the calculator. A second tool would change the system
prompt the solver sees and invite calls the model was never taught. Run afterwards, on the solver's answer, the
checker leaves the solver's prompt and behaviour as in the plain example (the SDK's own tool schema aside: it adds
`title`, `additionalProperties: false` and `"strict": true` to the calculator's).

Why the checker's verdict does not feed the reward: the reward is the verifiable one, the answer against the gold
integer. The checker is sampled from the same policy, so a reward that trusted its "Correct" would teach the policy
to say "Correct", not to check. Its segment is still trained, with the session's reward, like any other segment.
"""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import dataclass

import httpx
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

try:  # the plain example's prompt and calculator, imported as a module or run as a script from its folder
    from examples.agents.calculator_openai import SYSTEM, calculate
except ImportError:
    from calculator_openai import SYSTEM, calculate

set_tracing_disabled(True)  # the SDK would otherwise export traces to api.openai.com

CHECKER = ("You check the answers to arithmetic problems. Reply 'Correct' if the answer is right, else 'Wrong: "
           "<the right answer>'.")


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "3 * (4 + 5)".
    """
    return calculate(expression)


@dataclass(frozen=True)
class Outcome:
    """What one run produced: the solver's final answer (None without one) and the checker's reply."""

    answer: str | None
    verdict: str | None = None


def agents_for(client: AsyncOpenAI) -> tuple[Agent, Agent]:
    """The solver and the checker, both served by `client`'s server (the gateway names any model "policy")."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    solver = Agent(name="solver", instructions=SYSTEM, tools=[calculator], model=model)
    checker = Agent(name="checker", instructions=CHECKER, model=model)
    return solver, checker


async def run_agent(question: str, base_url: str, max_turns: int = 4) -> Outcome:
    """The solver until its final answer (at most `max_turns` model calls), then the checker on that answer."""
    async with AsyncOpenAI(base_url=base_url, api_key="agentrl") as client:  # closed before the event loop ends
        solver, checker = agents_for(client)
        try:
            result = await Runner.run(solver, question, max_turns=max_turns)
        except MaxTurnsExceeded:
            return Outcome(None)
        found = re.search(r"Final Answer:\s*(.+)", str(result.final_output or ""))
        if not found:
            return Outcome(None)
        answer = found.group(1).strip()
        check = await Runner.run(checker, f"Problem: {question}\nAnswer: {answer}", max_turns=1)
    return Outcome(answer, str(check.final_output))


async def solve(task, base_url: str) -> float:
    """agentrl's entry point: one run on `task`, its reward (1 for the right integer; the checker's verdict aside)."""
    outcome = await run_agent(task.data["question"], base_url)
    return float(outcome.answer == task.data["answer"])


if __name__ == "__main__":
    gateway = "http://127.0.0.1:8002"
    session = httpx.post(f"{gateway}/sessions", json={}).json()
    print(asyncio.run(run_agent(sys.argv[1], session["base_url"])))
