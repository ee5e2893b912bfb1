"""The FP8 host copy's drift beside the CPU methods' drift, measured the same way, on whatever
vLLM build runs here (the CUDA one, or the CPU one on an AMX CPU, whose block-FP8 MoE kernel
needs AMX): the numbers behind KT_STAGING_FP8_COPY=auto (hybrid/staging/plan.py) and
tests/engine/test_gpu.py's test_fp8_copy_drift_within_the_cpu_methods_drift, which checks them
on a GPU.

    python benchmarks/fp8_copy_accuracy.py qwen3_moe mixtral deepseek_v3

For each tiny model (128-wide experts where it has such a variant), half of each layer's experts
on the CPU: the FP8 copy against the exact copy (KT_METHOD=BF16, GPU prefill from 16 tokens:
kt-kernel's BF16 experts on the CPU build's host copy), and AMXINT8 / AMXINT4 against BF16 CPU
experts (GPU prefill off); chosen-token logprob drift, teacher-forced past a difference
(tests/kt_testing/engines.py), and completions that differ. One JSON line per model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kt_testing.engines import PROMPTS, differing, generate, logprob_drift, long_prompt  # noqa: E402

from vllm_kt_tools.support.tiny_models import tiny_model_dir  # noqa: E402

WIDE = {"qwen3_moe", "deepseek_v3"}  # archs with a 128-wide variant (the tiny Mixtral's are 256 already)


def measure(arch: str, root: Path) -> dict:
    model = tiny_model_dir(arch, root, quantizable=arch in WIDE)
    prompts = PROMPTS + [long_prompt(model, 180)]
    config = json.loads((model / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    base = {"KT_NUM_GPU_EXPERTS": str(experts // 2)}
    started = time.time()
    prefill = {**base, "KT_METHOD": "BF16", "KT_STAGING_MIN_TOKENS": "16"}
    exact = generate(model, prompts, kt={**prefill, "KT_STAGING_FP8_COPY": "0"})
    fp8 = generate(model, prompts, kt={**prefill, "KT_STAGING_FP8_COPY": "1"}, reference=exact)
    result = {"arch": arch, "wide": arch in WIDE, "fp8_copy": (differing(fp8, exact), logprob_drift(fp8, exact))}
    cpu = {**base, "KT_STAGING_MIN_TOKENS": "0"}
    bf16 = generate(model, prompts, kt={**cpu, "KT_METHOD": "BF16"})
    for method in ("AMXINT8", "AMXINT4"):
        got = generate(model, prompts, kt={**cpu, "KT_METHOD": method}, reference=bf16)
        result[method] = (differing(got, bf16), logprob_drift(got, bf16))
    result["seconds"] = round(time.time() - started)
    return result


def main() -> None:
    import os

    from vllm_kt_plugin.settings.catalogue import cache_root

    root = Path(os.environ.get("VLLM_KT_TEST_MODEL_CACHE") or cache_root() / "test-models")
    for arch in sys.argv[1:] or ["qwen3_moe", "mixtral", "deepseek_v3"]:
        print(json.dumps(measure(arch, root)), flush=True)


if __name__ == "__main__":
    main()
