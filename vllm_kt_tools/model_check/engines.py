"""The two sides of the model check: plain vLLM and ``vllm serve --quantization kt-hybrid``.

Both answer the same prompts, given as token ids, one request at a time (so both engines
see the same batches), greedily, with the top two logprobs of every step; then each scores
a reference continuation of every prompt (teacher forcing: vLLM's prompt logprobs), as
``tests/kt_testing/greedy.py`` does for the end-to-end tests: plain vLLM its own tokens,
kt-hybrid plain vLLM's. An answer is ``{"ids", "top2", "top2_ids", "forced_ids", "forced"}``.

Plain vLLM runs in one child process (plugin not loaded: ``VLLM_PLUGINS=""``, or only the
fixes of vLLM's CPU build a recipe names, e.g. ``kt_cpu_router``) with the
engines in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its dtypes share one
start-up, and kt-hybrid's float32 run (the torch backend) follows there once the plugin is
registered; kt-hybrid in bf16 runs through the real ``vllm serve`` and the OpenAI client.
All run eager (``--enforce-eager``): nothing is compiled per architecture, on both sides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_kt_tools.support.child import run_child
from vllm_kt_tools.support.server import VLLMServer

MAX_MODEL_LEN = 256
SERVED_NAME = "tiny"
ENGINE_TIMEOUT_S = 900
# The same engine arguments on both sides (vllm.LLM keyword -> vllm serve flag).
ENGINE_ARGS: Mapping[str, Any] = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "seed": 0}


def _steps(top: Sequence[Mapping[int, float]]) -> tuple[list[list[float]], list[list[int]]]:
    """Top-two logprobs and token ids of every step, best first."""
    ranked = [sorted(step.items(), key=lambda item: -item[1])[:2] for step in top]
    return [[lp for _, lp in step] for step in ranked], [[t for t, _ in step] for step in ranked]


def engine_answers(
    model: str, prompts: list[list[int]], max_tokens: int, dtype: str, reference: list[list[int]] | None, **llm: Any
) -> list[dict[str, Any]]:
    """One in-process engine's answers, each reference continuation (default: its own)
    scored by the same engine."""
    from vllm import LLM, SamplingParams  # deferred: the child process only
    from vllm.inputs import TokensPrompt

    from vllm_kt_tools.support.engine_lock import stop_engine

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine = LLM(model=model, dtype=dtype, **ENGINE_ARGS, **llm)
    results = []
    for prompt in prompts:
        (output,) = engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = output.outputs[0]
        top = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        top2, top2_ids = _steps(top)
        results.append({"ids": list(completion.token_ids), "top2": top2, "top2_ids": top2_ids})
    continuations = reference or [r["ids"] for r in results]
    for prompt, result, continuation in zip(prompts, results, continuations, strict=True):
        (output,) = engine.generate([TokensPrompt(prompt_token_ids=prompt + continuation)], scoring, use_tqdm=False)
        scored = output.prompt_logprobs[len(prompt) :]
        result["forced_ids"] = list(continuation)
        result["forced"] = [step[t].logprob for step, t in zip(scored, continuation, strict=True)]
    stop_engine(engine)
    return results


def in_process_answers(
    model: str, prompts: list[list[int]], max_tokens: int, dtypes: list[str], kt_float32: dict[str, str] | None
) -> dict[str, Any]:
    """Runs in the child process (``in_process``): plain vLLM's answers per dtype, its
    plugin not loaded (``VLLM_PLUGINS=""``); then, with ``kt_float32`` (KT_* settings), the
    plugin registered and kt-hybrid's float32 answers scoring plain vLLM's float32 tokens
    (an error there is returned, not raised: plain vLLM's answers stand). Plain vLLM failing
    in float32 after bf16 answered is returned too (``float32_error``): its bf16 check stands."""
    from vllm_kt_plugin.hybrid.vllm_compat import ask_for_amx_tiles

    ask_for_amx_tiles()  # the engine runs in this process; eager vLLM does not ask (AMX CPUs die of SIGILL)
    answers: dict[str, Any] = {}
    for dtype in dtypes:
        if dtype == "float32" and "bfloat16" in answers:
            try:  # plain vLLM may run bf16 only (e.g. bf16-only attention kernels): measured, not fatal
                answers[dtype] = engine_answers(model, prompts, max_tokens, dtype, None)
            except Exception as error:  # noqa: BLE001 - the caller records it as the float32 reason
                answers["float32_error"] = f"{type(error).__name__}: {error}".splitlines()[0][:400]
            continue
        answers[dtype] = engine_answers(model, prompts, max_tokens, dtype, None)
    if kt_float32 is not None and "float32" in answers:
        import vllm_kt_plugin

        os.environ.update(kt_float32)
        vllm_kt_plugin.register()  # what vLLM's plugin loader would have called
        reference = [r["ids"] for r in answers["float32"]]
        try:
            answers["kt_float32"] = engine_answers(
                model, prompts, max_tokens, "float32", reference, quantization="kt-hybrid"
            )
        except Exception as error:  # noqa: BLE001 - reported with the log's tail by the caller
            answers["kt_float32_error"] = f"{type(error).__name__}: {error}"[:2000]
    return answers


def missing_plugins(plugins: Sequence[str]) -> list[str]:
    """The names in ``plugins`` that no installed package offers as a ``vllm.general_plugins``
    entry point (vLLM would skip them silently)."""
    from importlib.metadata import entry_points

    offered = {point.name for point in entry_points(group="vllm.general_plugins")}
    return [name for name in plugins if name not in offered]


def plain_env(plugins: Sequence[str] = ()) -> dict[str, str]:
    """A plain-vLLM child's environment: no KT_* setting, only ``plugins`` loaded, its engines
    in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one start-up for all of them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    env.update({"VLLM_PLUGINS": ",".join(plugins), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def in_process(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtypes: list[str],
    kt_float32: dict[str, str] | None,
    log_path: Path,
    plugins: Sequence[str] = (),
) -> dict:
    """``in_process_answers`` in a child process whose engines run in it
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one start-up for all of them), plain vLLM with only
    ``plugins`` loaded; EngineFailed with the log's tail where plain vLLM fails."""
    missing = missing_plugins(plugins)
    if missing:
        raise RuntimeError(
            f"the entry point(s) {', '.join(missing)} of vllm.general_plugins are not installed: "
            "reinstall the package (pip install -e . --no-deps)"
        )
    run = run_child(
        "vllm_kt_tools.model_check.engines:in_process_answers",
        {"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "dtypes": dtypes, "kt_float32": kt_float32},
        env=plain_env(plugins),
        timeout_s=ENGINE_TIMEOUT_S,
        log_path=log_path,
    )
    if run.result is None:
        raise EngineFailed("plain vLLM", run.tail(60))
    return dict(run.result)


class EngineFailed(RuntimeError):
    """An engine did not start or answer; ``log`` is its log's tail."""

    def __init__(self, who: str, log: str) -> None:
        super().__init__(f"{who} failed:\n{log}")
        self.who = who
        self.log = log


def serve_args(dtype: str, kt: bool) -> list[str]:
    args = ["--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--seed", str(ENGINE_ARGS["seed"]), "--enforce-eager"]
    return args + (["--quantization", "kt-hybrid"] if kt else [])


def _answer(client: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    choice = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    top = [{int(k.split(":", 1)[1]): v for k, v in step.items()} for step in choice.logprobs.top_logprobs]
    top2, top2_ids = _steps(top)
    return {"ids": list(choice.model_extra["token_ids"]), "top2": top2, "top2_ids": top2_ids}


def _score(client: Any, prompt: list[int], continuation: list[int]) -> list[float]:
    choice = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt + continuation,
        max_tokens=1,
        temperature=0.0,
        extra_body={"prompt_logprobs": 0},
    ).choices[0]
    scored = choice.model_extra["prompt_logprobs"][len(prompt) :]
    return [float(step[str(t)]["logprob"]) for step, t in zip(scored, continuation, strict=True)]


def served(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    kt: Mapping[str, str],
    reference: list[dict[str, Any]],
    log_path: Path,
) -> list[dict[str, Any]]:
    """kt-hybrid's answers through ``vllm serve`` (``kt``: its KT_* settings), each prompt's
    reference continuation scored by the same server."""
    from openai import OpenAI

    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    env.update(kt)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    server = VLLMServer(model, serve_args(dtype, kt=True), env=env, log_path=log_path)
    try:
        server.start()
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", timeout=300)
        results = [_answer(client, prompt, max_tokens) for prompt in prompts]
        for prompt, result, ref in zip(prompts, results, reference, strict=True):
            result["forced_ids"] = list(ref["ids"])
            result["forced"] = _score(client, prompt, ref["ids"])
    except Exception as error:  # noqa: BLE001 - any failure: the server's log says why
        raise EngineFailed("vllm serve --quantization kt-hybrid", f"{error}\n{server.log_tail(60)}") from error
    finally:
        server.stop()
    return results
