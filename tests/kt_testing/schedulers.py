"""vLLM's real schedulers built without an engine (a config-only model, a KV cache config of
one group), and real requests for them: for the tests of kt-hybrid's scheduler
(``hybrid/scheduler.py``) and of the vLLM internals it touches."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kt_testing.config_only import write_config_only_qwen3_moe

BLOCK = 16


def scheduler_vllm_config(model_dir: Path, budget: int = 2048, max_seqs: int = 16) -> Any:
    """A VllmConfig whose scheduler takes ``budget`` tokens and ``max_seqs`` requests a step,
    with a KV cache of 1,000 blocks and no prefix caching (whose block hashes a request
    would need)."""
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    write_config_only_qwen3_moe(model_dir, layers=2)
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig.default_factory(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=budget
        ),
    )
    config.cache_config.num_gpu_blocks = 1000
    config.cache_config.enable_prefix_caching = False
    return config


def build_scheduler(cls: Any, vllm_config: Any) -> Any:
    """``cls`` built as vLLM's engine core builds its scheduler (keyword arguments)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False,
        log_stats=False,
        block_size=BLOCK,
        hash_block_size=BLOCK,
    )


def request(request_id: str, tokens: int, arrival: float | None = None) -> Any:
    """A greedy request of ``tokens`` prompt tokens that arrived at ``arrival`` (time.time())."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, tokens + 1)),
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0),
        pooling_params=None,
        arrival_time=time.time() if arrival is None else arrival,
    )
