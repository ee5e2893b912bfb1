"""Check architectures and write the run's JSON.

Per architecture: write its tiny model (``checkpoint``); plain vLLM answers in bf16 (and
float32 where the recipe runs it); ``vllm serve --quantization kt-hybrid`` with half of
every MoE layer's experts on the CPU answers in bf16 with the default CPU backend
(kt-kernel BF16, or the backend the plugin picks for layers kt-kernel cannot compute), and
in float32 with the torch backend. The verdict:

- served: bf16 greedy tokens equal plain vLLM's by ``compare``'s rules with the chosen-token
  logprob drift within BF16_DRIFT_BOUND, and float32 tokens equal with drift within
  FLOAT32_DRIFT_BOUND (where plain vLLM runs float32);
- refused at config time: kt-hybrid's server stopped with its one-line config error;
- cannot be checked here: plain vLLM itself fails on this machine's vLLM build (its error; where
  it rejected the tiny model itself, the error of plain vLLM with its own dummy weights: ``probe``);
- failed: anything else (a bug to fix).

Plain vLLM loads no plugin, or only the fixes of vLLM's CPU build its recipe names
(``Recipe.reference_plugins``; the result says so under ``reference``).
"""

from __future__ import annotations

import json
import platform
import re
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vllm_kt_tools.model_check import compare, engines, probe
from vllm_kt_tools.model_check.checkpoint import checkpoint_dir, weights_of
from vllm_kt_tools.model_check.recipes import (
    CONFIG_MODEL_TYPES,
    DRAFT_OF,
    NUM_EXPERTS,
    RECIPES,
    REFERENCE_PLUGINS,
    TAKES_ROW_OF,
    Recipe,
)
from vllm_kt_tools.support.tiny_models import PROMPTS, training_text
from vllm_kt_tools.support.vllm_internals import model_class

SERVED, REFUSED, CANNOT_CHECK, FAILED, NO_RECIPE = (
    "served",
    "refused at config time",
    "cannot be checked here",
    "failed",
    "no recipe",
)
MAX_TOKENS = 16
LONG_PROMPT_TOKENS = 100
# Splitting a layer's experts rounds each side's partial sum to bf16 before the two are added
# (plain vLLM rounds the whole sum once). `python3 benchmarks/checks/split_drift.py` on the tiny
# HunYuan-V1 (2-core AVX-512 box, kt-kernel avx512_bf16, 2026-12-07): every expert on vLLM's side
# 0.0, half on kt-kernel 0.0733, half on the torch backend 0.0732, all on kt-kernel 0.0227; float32
# with the split 3.9e-7. The same with either CPU backend and absent without a split: the split's
# rounding, not a kernel. Bound: 0.0733 plus a margin of 0.027; a missing or misweighted expert
# drifts more than 1 nat.
BF16_DRIFT_BOUND = 0.1
HALF_ON_CPU = {"KT_NUM_GPU_EXPERTS": str(NUM_EXPERTS // 2)}
# The plugin's log lines the verdict reads (hybrid/moe_method.py).
_CPU_SIDE = re.compile(r"kt-hybrid: each MoE layer keeps (.*?); GPU side: \S+, CPU side: (\S+) (\S+)")
# (an in-process engine gets the line inside pydantic's ValidationError, whose " [type=..." tail is vLLM's)
_CONFIG_ERROR = re.compile(r"(--quantization='kt-hybrid' is invalid \(.*?)(?: \[type=|$)", re.M)


def prompt_ids(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return ids + [tokenizer(training_text())["input_ids"][:LONG_PROMPT_TOKENS]]


_EXCEPTION = re.compile(r"^(?:\[rank\d+\]: |\(\w+ pid=\d+\) )?(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$")


_FRAME = re.compile(r'File ".*?/site-packages/(\S+?)", line (\d+)')


def last_error_line(log: str) -> str:
    """Why an engine failed: the last exception line of its log (an assertion with no
    message: with the assert statement before it)."""
    # the API server's "Engine core initialization failed" only points at the engine's own error
    lines = [line.strip() for line in log.splitlines() if line.strip() and "initialization failed" not in line]
    lines = [re.sub(r"^\(\w+ pid=\d+\) ERROR \S+ \S+ \[\S+\] ", "", line) for line in lines]
    missing = [line for line in lines if "ModuleNotFoundError: " in line]
    if missing and "failed to be inspected" in log:  # vLLM inspects the model class in a subprocess
        return f"importing the model class: {missing[-1].split('ModuleNotFoundError: ', 1)[1]}"[:600]
    for index in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION.match(lines[index])
        if match:
            error = match.group(1)
            context = [line.split(": ", 1)[-1].strip() for line in lines[max(0, index - 3) : index]]
            statement = next((c for c in reversed(context) if c.startswith("assert ")), None)
            if error == "AssertionError" and statement:
                error += f" ({statement})"
            if "ValidationError" in error and index + 1 < len(lines):
                error += f": {lines[index + 1]}"  # pydantic puts the reason on the next line
            frames = [m for line in lines[:index] if (m := _FRAME.search(line))]
            where = f" ({frames[-1].group(1)}:{frames[-1].group(2)})" if frames else ""
            return (error + where)[:600]
    return (lines or ["(no log)"])[-1][:600]


def _comparison(got: list, want: list, bound: float, exact: bool, log: str) -> dict[str, Any]:
    problem = None
    broken = compare.non_finite(want) + compare.non_finite(got)
    if broken:
        problem = f"{broken} logprobs are NaN or infinite (plain vLLM's: {compare.non_finite(want)}): nothing compared"
    if problem is None and exact and [g["ids"] for g in got] != [w["ids"] for w in want]:
        problem = f"{compare.differing(got, want)} of {len(got)} completions differ (float32 must be exact)"
    problem = problem or compare.greedy_mismatch(got, want)
    drift = compare.logprob_drift(got, want)
    if problem is None and drift > bound:
        problem = f"chosen-token logprob drift {drift:.3g} above the bound {bound:g}"
    placement = _CPU_SIDE.search(log)
    if placement is None:  # equal tokens from a model with no MoE layer, or one kt-hybrid left alone, check nothing
        problem = "kt-hybrid logged no MoE layer placement: no experts were computed on the CPU"
    return {
        "backend": f"{placement.group(2)} {placement.group(3)}" if placement else None,
        "placement": placement.group(1) if placement else None,
        "first_tokens": [[g["ids"][0], w["ids"][0]] for g, w in zip(got, want, strict=True)],
        "tokens_compared": sum(len(w["ids"]) for w in want),
        "differing": compare.differing(got, want),
        "drift": drift,
        "bound": bound,
        "problem": problem,
    }


def check(architecture: str, models: Path, logs: Path) -> dict[str, Any]:
    """One architecture's verdict and what it rests on."""
    start = time.monotonic()
    result: dict[str, Any] = {"architecture": architecture}
    try:
        result.update(_check(architecture, models, logs))
    except Exception:  # noqa: BLE001 - the harness itself failed on this architecture: say where
        result.update(status=FAILED, reason=traceback.format_exc(limit=3).strip().splitlines()[-1][:600])
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


# Plain vLLM rejecting the tiny model itself (its config lacks a field vLLM reads, a weight
# vLLM looks for is not in it or one it holds is not vLLM's, a size its kernels do not take, a
# processor file (an image processor's, an audio feature extractor's) or special token vLLM loads
# at start is missing): the recipe's fault, not something this vLLM build cannot run.
_TINY_MODEL_REJECTED = re.compile(
    r"plain vLLM fails here: (AttributeError: '\w+Config' object has no attribute|KeyError: '|ValueError: The `"
    r"|ValueError: Unsupported head_dim|OSError: Can't load image processor"
    r"|OSError: Can't load feature extractor"
    r"|ValueError: \w+ tokenizer is missing special tokens|ValueError: There is no module or parameter named)"
)


def plain_failure_status(reason: str) -> str:
    """CANNOT_CHECK where plain vLLM cannot run the architecture here; NO_RECIPE where it
    rejected our tiny model (``_TINY_MODEL_REJECTED``): the row is then not checked yet."""
    return NO_RECIPE if _TINY_MODEL_REJECTED.match(reason) else CANNOT_CHECK


def refuses_this_platform(architecture: str) -> str | None:
    """The NotImplementedError vLLM's model class raises on construction where this build
    ships only a stub of it (e.g. DeepSeek-V4's CPU MTP draft), or None. The class is built
    with no config: a real model class fails otherwise (ignored) before allocating anything."""
    from vllm_kt_tools.support.vllm_internals import registry_models

    if registry_models()[architecture][0] == "transformers":
        return None
    try:
        model_class(architecture)(vllm_config=None, prefix="")
    except NotImplementedError as error:
        return f"NotImplementedError: {error}"[:400]
    except Exception:  # noqa: BLE001 - a real model class rejecting no config: not a stub
        return None
    return None


def plain_failure_reason(recipe: Recipe, error: str) -> str:
    """The row's reason for plain vLLM's ``error``; a recipe saving the released tensor names
    (``Recipe.released_names``) makes vLLM's loader missing one of them this build's, not the recipe's."""
    if recipe.released_names and error.startswith(("KeyError: ", "ValueError: There is no module or parameter named")):
        return f"plain vLLM fails here on the released checkpoint's tensor names: {error}"
    return f"plain vLLM fails here: {error}"


def import_failure(architecture: str) -> str | None:
    """Why vLLM's registry cannot import this architecture's model class on this build
    (e.g. a module that imports torchvision, or one with GPU-only implementations), or None."""
    try:
        model_class(architecture)
    except Exception as error:  # noqa: BLE001 - whatever stops the import is the reason
        return f"{type(error).__name__}: {error}"[:400]
    return None


def config_class(model_type: str) -> str | None:
    """The config class transformers or vLLM's config registry ships for ``model_type``, or None."""
    from transformers import AutoConfig

    from vllm_kt_tools.support.vllm_internals import config_registry

    try:
        return f"transformers' {type(AutoConfig.for_model(model_type)).__name__}"
    except ValueError:  # "Unrecognized model identifier": not in transformers' CONFIG_MAPPING
        pass
    try:
        return f"vLLM's {config_registry()[model_type].__name__}"
    except KeyError:
        return None


def unbuildable(architecture: str) -> str | None:
    """Why no tiny model of ``architecture`` can be written here (checkpoint.py draws the weights
    with transformers' model class of it), or None where transformers ships that class."""
    import transformers

    from vllm_kt_tools.support.vllm_internals import registry_models

    if registry_models()[architecture][0] == "transformers" or hasattr(transformers, architecture):
        return None  # vLLM's Transformers backend (any transformers model), or a class to write it
    reason = f"transformers {transformers.__version__} ships no `{architecture}` model class to write its weights"
    model_type = CONFIG_MODEL_TYPES.get(architecture)
    if model_type is not None:
        found = config_class(model_type)
        reason += (
            f" (its config class: {found})"
            if found
            else f", nor a config class for its model_type '{model_type}' (neither does vLLM's config registry)"
        )
    return reason


def follows(architecture: str) -> str | None:
    """The base whose row a draft or wrapper with no recipe of its own takes or follows
    (``TAKES_ROW_OF``, ``DRAFT_OF``), or None: no tiny model of it is written, it runs only
    with its base (where transformers ships no class of it, none could be)."""
    return (TAKES_ROW_OF.get(architecture) or DRAFT_OF.get(architecture) or (None,))[0]


def _engine_failure(dtype: str, log: str) -> dict[str, Any]:
    """A kt-hybrid engine that did not answer: refused at config time (its one line), or failed."""
    refusal = _CONFIG_ERROR.search(log)
    if refusal is not None:
        return {"status": REFUSED, "reason": refusal.group(1)[:600]}
    return {"status": FAILED, "reason": f"kt-hybrid {dtype}: {last_error_line(log)}"}


def reference(recipe: Recipe) -> str | None:
    """What the reference is where it is more than plain vLLM (the fixes it loads, and why)."""
    if not recipe.reference_plugins:
        return None
    why = "; ".join(REFERENCE_PLUGINS[name] for name in recipe.reference_plugins)
    return f"plain vLLM with {', '.join(recipe.reference_plugins)} ({why})"


def _check(architecture: str, models: Path, logs: Path) -> dict[str, Any]:
    recipe = RECIPES.get(architecture)
    if recipe is None:
        failure = import_failure(architecture)
        if failure is not None:
            return {"status": CANNOT_CHECK, "reason": f"vLLM's model class does not import here: {failure}"}
        stub = refuses_this_platform(architecture)
        if stub is not None:
            return {"status": CANNOT_CHECK, "reason": f"vLLM's model class refuses this platform: {stub}"}
        base = follows(architecture)
        if base is not None:  # its module imports here: the table gives it its base's row (supported_models.rows)
            return {"status": NO_RECIPE, "reason": f"no tiny model of its own: its row follows `{base}`'s"}
        reason = unbuildable(architecture)
        if reason is not None:
            return {"status": CANNOT_CHECK, "reason": f"no tiny model can be written: {reason}"}
        return {"status": NO_RECIPE, "reason": "no tiny model of it yet (model_check/recipes.py)"}
    model = checkpoint_dir(architecture, models)
    prompts = prompt_ids(model)
    dtypes = ["bfloat16", "float32"] if recipe.float32 else ["bfloat16"]
    out: dict[str, Any] = {"weights": weights_of(model), "float32": None if recipe.float32 else recipe.notes}
    if recipe.reference_plugins:
        out["reference"] = reference(recipe)
    kt_float32 = {**HALF_ON_CPU, "KT_BACKEND": "torch"} if recipe.float32 else None
    plain_log = logs / f"{architecture}-plain.log"
    try:
        plain = engines.in_process(model, prompts, MAX_TOKENS, dtypes, kt_float32, plain_log, recipe.reference_plugins)
    except engines.EngineFailed as failed:
        reason = plain_failure_reason(recipe, last_error_line(failed.log))
        # (a reference needing our fixes of vLLM's CPU build is not probed: the probe loads none)
        if plain_failure_status(reason) == NO_RECIPE and not recipe.reference_plugins:
            # the tiny model rejected: does plain vLLM run the architecture at all, names aside?
            dummy = probe.with_dummy_weights(model, prompts, logs / f"{architecture}-plain-dummy.log")
            error = last_error_line(dummy) if dummy is not None else None
            if error is not None and plain_failure_status(f"plain vLLM fails here: {error}") == CANNOT_CHECK:
                out["tiny_model_rejected"] = reason
                reason = f"plain vLLM fails here with vLLM's own dummy weights: {error}"
        return {**out, "status": plain_failure_status(reason), "reason": reason}
    checks = {}
    log = logs / f"{architecture}-kt-bfloat16.log"
    try:
        got = engines.served(model, prompts, MAX_TOKENS, "bfloat16", HALF_ON_CPU, plain["bfloat16"], log)
    except engines.EngineFailed as failed:
        return {**out, **_engine_failure("bfloat16", failed.log)}
    checks["bfloat16"] = _comparison(got, plain["bfloat16"], BF16_DRIFT_BOUND, False, log.read_text(errors="replace"))
    if recipe.float32 and "float32_error" in plain:
        out["float32"] = f"plain vLLM float32 fails here: {plain['float32_error']}"
    elif recipe.float32:
        if "kt_float32" not in plain:
            return {**out, "checks": checks, **_engine_failure("float32", plain_log.read_text(errors="replace"))}
        float32_log = plain_log.read_text(errors="replace")
        checks["float32"] = _comparison(
            plain["kt_float32"], plain["float32"], compare.FLOAT32_DRIFT_BOUND, True, float32_log
        )
    problems = [f"{dtype}: {c['problem']}" for dtype, c in checks.items() if c["problem"]]
    status = FAILED if problems else SERVED
    return {**out, "status": status, "reason": "; ".join(problems) or None, "checks": checks}


def _torchvision() -> str | None:
    """The torchvision the engines import, if any (``check-models --torchvision``: its Python part)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchvision")
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    import torch
    import vllm

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    try:
        variant = str(prepare_kt_kernel().__cpu_variant__)
    except Exception as error:  # noqa: BLE001 - recorded, not fatal: the torch backend still runs
        variant = f"unavailable ({error})"
    from vllm.platforms import current_platform

    return {
        "vllm": vllm.__version__,
        "vllm_build": current_platform.device_type,  # "cpu" or "cuda": which build both sides ran on
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "kt_kernel_variant": variant,
        "torchvision": _torchvision(),
        "cpu": platform.processor() or platform.machine(),
        "cores": __import__("os").cpu_count(),
    }


def run(
    architectures: Iterable[str],
    out: Path,
    models: Path,
    logs: Path,
    command: str,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Check each architecture in turn; the JSON is rewritten after every one (a long run
    can be followed, and an interrupted one keeps what it did)."""
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": command,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "seconds": 0.0,
        "architectures": {},
    }
    start = time.monotonic()
    for architecture in architectures:
        result = check(architecture, models, logs)
        report["architectures"][architecture] = result
        report["seconds"] = round(time.monotonic() - start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        if progress is not None:
            progress(result)
    return report
