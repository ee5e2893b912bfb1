"""Run real vLLM engines for the end-to-end tests, one child process per configuration
(``vllm_kt_tools.support.child``, the protocol the benchmark uses too)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_kt_tools.model_check.compare import (  # noqa: F401 - the tests import them from here
    TIE_GAP,
    differing,
    first_difference,
    greedy_mismatch,
    logprob_drift,
    step_drifts,
)
from vllm_kt_tools.support.child import run_child
from vllm_kt_tools.support.tiny_models import PROMPTS as _PROMPTS
from vllm_kt_tools.support.tiny_models import training_text

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 900
# The share of the GPU each test engine takes (vLLM's gpu_memory_utilization, default 0.9),
# e.g. 0.2, so that a test process fits beside another GPU process (a benchmark's server).
# Engines must not start at the same moment: vLLM 0.32 counts what other processes allocate
# while it profiles against its own budget ("No available memory for the cache blocks");
# VLLM_KT_ENGINE_LOCK (vllm_kt_tools/support/engine_lock.py) makes their starts take turns.
GPU_SHARE_VARIABLE = "VLLM_KT_TEST_GPU_SHARE"

PROMPTS = list(_PROMPTS)  # a list: comparisons add their own long prompt to it

# Measured on vLLM's CPU build, tiny Qwen3-MoE (top-2), every expert on the CPU: without
# deferral the chosen-token logprobs move by <= 0.0005 against plain vLLM; deferring one of
# the two experts moved them by <= 0.01 on an AVX-512 machine, by 0.055 in one CI run (AVX2)
# and by 0.21 on an AMX machine (batches form differently with the machine's timing and
# kernels, so the rounding differs), always with identical tokens. Bound: the largest
# measured (0.21, AMX) plus a margin of 0.09 for batch composition, which changes with
# timing and is not the same from run to run; the GPU test states its own.
DEFERRAL_DRIFT_BOUND = 0.3
# Deferral beside the split (tests/engine/test_engine_e2e.py::test_expert_deferral_with_split):
# which forwards split, and so which CPU expert of a token kt-kernel defers, follows the
# batches, which form with the machine's timing (as above). Measured on the 2-core AMX dev box
# (kt-kernel's AMX BF16 kernels, `pytest -s tests/engine/test_engine_e2e.py -k
# deferral_with_split`, 2026-12-05): 0.41 and 0.12 in two runs; it passed the 0.3 above on the
# AVX-512 box. Bound: twice the larger, for a spread that two runs only begin to show.
DEFERRAL_SPLIT_DRIFT_BOUND = 0.8

# Lines the runtime logs when a feature ran (a test of the feature must see its line, or it
# would pass with the feature silently off).
WHOLE_LAYER_RAN = "kt-hybrid: whole-layer stream ran"  # hybrid/staging/layer.py, once per process
DEFERRAL_RAN = "kt-hybrid: expert deferral ran"  # cpu_backends/kt_kernel/compat.py, once per process
SPLIT_RAN = "kt-hybrid: split ran"  # hybrid/staging/layer.py, the first layer's first split forward
_SPLIT_STAGED = re.compile(r"kt-hybrid: split ran: \S+ staged (\d+) of the (\d+) CPU experts a forward of (\d+) tokens")


def assert_split_ran(log: str, min_tokens: int) -> None:
    """The log shows a real split: a forward of at least ``min_tokens`` staged some of its
    picked CPU experts on the GPU, not none and not all (so this fails where the split is
    off, or fell back to one of the pure paths)."""
    ran = _SPLIT_STAGED.search(log)
    assert ran is not None, f"no '{SPLIT_RAN}' line: the split did not run"
    print(ran.group(0))
    staged, picked, tokens = map(int, ran.groups())
    assert 0 < staged < picked and tokens >= min_tokens, ran.group(0)


_SWAPS = re.compile(r"kt-hybrid: dynamic GPU experts: .* (\d+) layer swaps so far")


def layer_swaps(log: str) -> int:
    """Dynamic GPU experts' layer swaps, as far as the log counted them (the swap log's
    INFO lines come at the 1st, 10th, 100th, ...: hybrid/dynamic_experts.py)."""
    return max((int(m.group(1)) for m in _SWAPS.finditer(log)), default=0)


def install_zero_backend(root: Path) -> str:
    """Make the test backend in kt_testing/plugins discoverable the way a pip-installed plugin
    is: a dist-info directory with an entry point. Returns a PYTHONPATH entry."""
    dist = root / "kt_test_backends-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kt-test-backends\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vllm_kt_plugin.cpu_backends]\nzeros = kt_zero_backend\n")
    return os.pathsep.join([str(root), str(HERE / "plugins")])


# vLLM 0.32 saves an AOT-compiled model on torch >= 2.10 but cannot load it back on torch 2.13
# ("'function' object has no attribute 'finalize_loading'"), so every engine start compiled
# again: 18 s of a tiny model's 60 s start on 2 cores, 48 s cold. Its older compile cache
# loads in 6 s. Only the startup path differs (the MoE layers are one opaque op to the
# compiler either way); the tests that run vLLM's own commands (`vllm serve` against plain
# vLLM, the notebooks) keep its default.
FAST_COMPILE_CACHE = {"VLLM_USE_AOT_COMPILE": "0"}

# vLLM's offline LLM runs its engine core in a second process, which imports vLLM again; the
# comparisons run it in the child itself, which halves a tiny model's start (docs/contributing.md).
# The default, two-process path is what every `vllm serve` test and the offline notebook run.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without KT_* settings, plus ``extra``; ``tests/`` on the
    path, so that a child can import this package (``kt_testing.greedy``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name, value in FAST_COMPILE_CACHE.items():
        env.setdefault(name, value)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    return env


def generate(
    model: Path,
    prompts: list[str],
    *,
    kt: dict[str, str] | None,
    max_tokens: int = 24,
    llm: dict | None = None,
    reference: list | None = None,
    **env: str,
) -> list:
    """Greedy completions from a fresh engine; ``kt=None`` runs plain vLLM (no plugin).
    ``llm``: extra keyword arguments for vllm.LLM (e.g. enforce_eager). ``reference``: the
    completions this run will be compared with; the engine scores their tokens too (see
    ``kt_testing.greedy``), else its own."""
    return generate_logged(model, prompts, kt=kt, max_tokens=max_tokens, llm=llm, reference=reference, **env)[0]


def generate_logged(
    model: Path,
    prompts: list[str],
    *,
    kt: dict[str, str] | None,
    max_tokens: int = 24,
    llm: dict | None = None,
    reference: list | None = None,
    **env: str,
) -> tuple[list, str]:
    """``generate`` and the engine's log."""
    llm_args: dict = {"quantization": "kt-hybrid"} if kt is not None else {}
    if os.environ.get(GPU_SHARE_VARIABLE):  # several test processes on one GPU
        llm_args["gpu_memory_utilization"] = float(os.environ[GPU_SHARE_VARIABLE])
    llm_args.update(llm or {})
    args = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "llm": llm_args}
    if reference is not None:
        args["reference"] = [r["ids"] for r in reference]

    run = run_child(
        "kt_testing.greedy:greedy_completions",
        args,
        env=clean_env(**{**IN_PROCESS_ENGINE, **(kt or {}), **env}),
        timeout_s=ENGINE_TIMEOUT_S,
    )
    if run.result is None:
        raise AssertionError(f"engine failed (exit {run.returncode}):\n{run.log[-6000:]}")
    return list(run.result), run.log


def long_prompt(model: Path, tokens: int) -> str:
    """The first ``tokens`` tokens of the tiny models' training text, as text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer.decode(tokenizer(training_text())["input_ids"][:tokens])


def assert_same_greedy_tokens(got: list, want: list, bound: float = TIE_GAP) -> None:
    """Greedy tokens equal by the rules of ``vllm_kt_tools.model_check.compare``: except at a
    tie of ``want``'s own, past which both engines' logprobs of ``want``'s tokens stay within
    ``bound`` to the end."""
    problem = greedy_mismatch(got, want, bound)
    assert problem is None, problem
