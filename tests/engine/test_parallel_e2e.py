"""Tensor parallelism end to end on vLLM's CPU build: two workers, kt-hybrid against plain
vLLM under the same parallelism. One engine start per (arch, system) serves every
assertion: tokens, which rank holds kt-kernel, which rank computes the CPU experts."""

from __future__ import annotations

import re

import pytest
from kt_testing.engines import PROMPTS, WHOLE_LAYER_RAN, assert_same_greedy_tokens, generate_logged, long_prompt

pytestmark = pytest.mark.engine

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_num_batched_tokens": 64}
# vLLM's CPU workers each bind their OpenMP threads; on a 2-core machine one core each.
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# Staging forced low so that the TP-sliced host copies run too (each rank computes
# its slice of every CPU expert there; the all-reduce adds them), and a metrics line
# after every CPU-expert forward, to see which rank computed it.
KT = {
    "KT_BACKEND": "kt_kernel",
    "KT_METHOD": "BF16",
    "KT_NUM_GPU_EXPERTS": "4",
    "KT_STAGING_MIN_TOKENS": "16",
    "KT_METRICS_INTERVAL": "0.000001",
}
MAX_TOKENS = 12
# vLLM 0.32's CPU build compiles DeepSeek-V3 under TP=2 into a graph whose tokens change from
# run to run, plain vLLM alone included (token 0 streams; eager mode is stable): DeepSeek
# runs eager here, Qwen3-MoE compiled (the plugin's opaque MoE op under torch.compile).
EAGER = {"deepseek_v3": True, "qwen3_moe": False}
_WORKER = re.compile(r"\(Worker_TP(\d)")


def ranks_logging(log: str, text: str) -> list[int]:
    """The TP ranks whose worker logged a line containing ``text`` (lines whose worker
    prefix was lost among progress-bar output are not attributed)."""
    return sorted({int(m.group(1)) for line in log.splitlines() if text in line for m in [_WORKER.search(line)] if m})


@pytest.mark.parametrize("arch", list(EAGER))
def test_tensor_parallel_matches_plain_and_computes_cpu_experts_once(tiny_model, arch: str) -> None:
    model = tiny_model(arch)
    prompts = PROMPTS + [long_prompt(model, 120)]  # 120 tokens: two chunks of 64
    llm = {**TP, "enforce_eager": EAGER[arch]}
    plain, _ = generate_logged(model, prompts, kt=None, max_tokens=MAX_TOKENS, llm=llm, VLLM_PLUGINS="", **BIND)
    hybrid, log = generate_logged(model, prompts, kt=KT, max_tokens=MAX_TOKENS, llm=llm, reference=plain, **BIND)

    assert_same_greedy_tokens(hybrid, plain)
    assert ranks_logging(log, "tensor-parallel rank 0 of 2 computes the CPU experts") == [0]
    assert ranks_logging(log, "tensor-parallel rank 1 of 2 leaves the CPU experts to rank 0") == [1]
    # Each CPU-expert forward logs one metrics line in the process that computed it.
    assert ranks_logging(log, "kt-hybrid metrics:") == [0], log[-4000:]
    assert ranks_logging(log, WHOLE_LAYER_RAN) != []
