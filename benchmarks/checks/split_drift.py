"""Where kt-hybrid's bf16 logprobs leave plain vLLM's on one tiny model: plain vLLM, then
kt-hybrid with every expert on vLLM's side, half, none, and half on the torch backend, each
in its own process, scoring plain vLLM's greedy continuations. Prints one JSON line per run.
Usage: python3 benchmarks/checks/split_drift.py MODEL_DIR"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUNS = {
    "all_on_vllm": {"KT_NUM_GPU_EXPERTS": "8"},
    "half_kt_kernel": {"KT_NUM_GPU_EXPERTS": "4"},
    "none_on_vllm": {"KT_NUM_GPU_EXPERTS": "0"},
    "half_torch": {"KT_NUM_GPU_EXPERTS": "4", "KT_BACKEND": "torch"},
}


def child(model: str, kt: str, reference: str) -> None:
    from vllm_kt_tools.model_check.engines import engine_answers
    from vllm_kt_tools.model_check.run import prompt_ids

    prompts = prompt_ids(Path(model))
    ref = json.loads(reference) if reference else None
    llm = {}
    if kt:
        import vllm_kt_plugin

        os.environ.update(json.loads(kt))
        vllm_kt_plugin.register()
        llm = {"quantization": "kt-hybrid"}
    answers = engine_answers(model, prompts, 16, "bfloat16", [r["ids"] for r in ref] if ref else None, **llm)
    print("RESULT " + json.dumps(answers), flush=True)


def run(model: str, kt: dict | None, reference: list | None) -> list:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if kt is None:
        env["VLLM_PLUGINS"] = ""
    args = [
        sys.executable,
        __file__,
        "--child",
        model,
        json.dumps(kt) if kt else "",
        json.dumps(reference) if reference else "",
    ]
    out = subprocess.run(args, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1][7:])


def main() -> None:
    model = sys.argv[1]
    plain = run(model, None, None)
    for name, kt in RUNS.items():
        try:
            got = run(model, kt, plain)
        except RuntimeError as error:
            print(json.dumps({"run": name, "error": str(error)[-600:]}), flush=True)
            continue
        drift = max(
            abs(a - b) for g, p in zip(got, plain, strict=True) for a, b in zip(g["forced"], p["forced"], strict=True)
        )
        differing = sum(g["ids"] != p["ids"] for g, p in zip(got, plain, strict=True))
        print(json.dumps({"run": name, "drift": round(drift, 4), "differing_completions": differing}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
