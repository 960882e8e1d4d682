"""An example reward for code RL, written as a user would write one: the completion is a Python
program, and it earns 1.0 when the data row's tests pass against it.

The model-written program never runs in the reward's own process: ``run_untrusted`` runs it in a
confined child of its own (no network, no file of the actor or of this worker, its own pid
namespace, a time and memory limit), so it cannot write this worker's reply, change this
function or outlive its time limit. Run it with the reward sandbox on as well
(docs/recipes.md, "Rewards that run model-written code")::

    specrl run task=dataset task.path=problems.jsonl task.numeric_answers=false \\
        task.reward=examples/code_reward.py:score task.reward_sandbox=true

where each row holds the problem as ``prompt`` and, as ``tests``, Python statements (``assert
add(2, 3) == 5``) run after the completion's code.
"""

from __future__ import annotations

import re

from actors.rewards import run_untrusted

FENCED = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
TIMEOUT_S = 5.0
MEMORY_BYTES = 512 << 20


def program(completion: str) -> str:
    """The completion's code: its last fenced block, else the whole text."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def score(prompt: str, completion: str, row: dict) -> dict[str, float]:
    code = program(completion)
    try:
        compile(code, "<completion>", "exec")  # parsed, never run here
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return {"passed": 0.0, "compiles": 0.0}
    result = run_untrusted(
        code + "\n\n" + str(row.get("tests", "")), timeout_s=TIMEOUT_S, memory_bytes=MEMORY_BYTES
    )
    return {"passed": float(result.ok), "compiles": 1.0}
