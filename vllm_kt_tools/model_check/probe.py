"""Whether plain vLLM runs an architecture at all on this build, its weights aside.

Where plain vLLM rejects the tiny model itself (a tensor name, token or file its loader or
renderer wants: ``run._TINY_MODEL_REJECTED``), the row would stay "not checked". The probe
runs plain vLLM once more on the same tiny config with ``load_format="dummy"`` (vLLM's own
random weights in its own parameters, so no tensor name matters): where that fails too, the
error is this build's, measured, and the row cannot be checked here; where it answers, the
recipe is what is wrong, and the row stays not checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_kt_tools.model_check.engines import ENGINE_TIMEOUT_S, engine_answers, plain_env
from vllm_kt_tools.support.child import run_child

PROBE_TOKENS = 2


def dummy_answers(model: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Runs in the child process (``with_dummy_weights``): plain vLLM's answers with vLLM's dummy weights."""
    return engine_answers(model, prompts, PROBE_TOKENS, "bfloat16", None, load_format="dummy")


def with_dummy_weights(model: Path, prompts: list[list[int]], log_path: Path) -> str | None:
    """The log of plain vLLM failing on ``model``'s config with its own dummy weights, or None
    where it answers (no plugin loaded)."""
    run = run_child(
        "vllm_kt_tools.model_check.probe:dummy_answers",
        {"model": str(model), "prompts": prompts[:1]},
        env=plain_env(),
        timeout_s=ENGINE_TIMEOUT_S,
        log_path=log_path,
    )
    return None if run.result is not None else run.tail(60)
