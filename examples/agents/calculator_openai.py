"""An arithmetic agent written with the plain `openai` SDK: it calls a calculator tool, then answers.

Nothing here knows about training: the program talks to whatever OpenAI-compatible server `base_url` names. To
train it, point a recipe's `[agent] program` at `examples.agents.calculator_openai:solve` (see
`recipes/cpu_agent_openai_train.toml` and docs/tutorials/train-your-agent.md), or try it by hand against a gateway:

    agentrl serve gateway --model runs/demo/sft_model --tool-parser react &
    python examples/agents/calculator_openai.py "Compute 9 + 14 - 13."

The prompt is the one the CPU demo's model was tuned on (the math env's, ReAct format): a program trained from a
checkpoint should speak to it the way it was taught.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
import sys

import httpx
from openai import AsyncOpenAI

SYSTEM = ("You solve arithmetic problems. Use the calculator tool for any computation, show each step as an equation "
          "like `3 * 4 = 12`, and finish with the answer as a plain integer: Final Answer: 12\nWrite 'Thought: <your "
          "reasoning>', then either 'Action: <tool>[<arguments as a JSON object>]' and stop, or 'Final Answer: <your "
          "answer>' when you are done.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "Numbers with + - * / ** and parentheses, e.g. \"3 * (4 + 5)\"."}},
        "required": ["expression"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.Pow: operator.pow, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The calculator tool: + - * / ** and parentheses over numbers."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / ** and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def run_agent(question: str, base_url: str, max_turns: int = 4) -> str | None:
    """The agent: the model's turns, the calculator's results, until a final answer (or None)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    async with AsyncOpenAI(base_url=base_url, api_key="agentrl") as client:  # closed before the event loop ends
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                found = re.search(r"Final Answer:\s*(.+)", message.content or "")
                return found.group(1).strip() if found else None
            for call in message.tool_calls:
                result = calculate(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


async def solve(task, base_url: str) -> float:
    """agentrl's entry point: one run on `task`, its reward (1 for the right integer)."""
    answer = await run_agent(task.data["question"], base_url)
    return float(answer == task.data["answer"])


if __name__ == "__main__":
    gateway = "http://127.0.0.1:8002"
    session = httpx.post(f"{gateway}/sessions", json={}).json()
    print(asyncio.run(run_agent(sys.argv[1], session["base_url"])))
