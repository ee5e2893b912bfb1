"""Every KT_* variable the plugin reads: name, default, allowed values, meaning.

The bottom of the package, like vLLM's ``vllm/envs.py``: it imports nothing else from
``vllm_kt_plugin``, so every other module can read it. Parsing and checking live above
it (``variables``, ``presets``, ``loader``); the error type formats its ``allowed`` text
from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Under vLLM's logger tree, so messages appear (and are filtered) like vLLM's own.
LOGGER_NAME = "vllm.kt_hybrid"
SETTINGS_PREFIX = "KT_"  # of every setting, and of kt-kernel's own variables

# 1 GB in every KT_* setting and log line is 2**30 bytes, the unit GPU memory is quoted in
# (an "80 GB" A100 has 80 GiB).
GIB = 2**30

DEFAULT_BACKEND = "kt_kernel"
# Cores left to vLLM by the default KT_CPUINFER: kt-kernel's spinning workers plus the
# Python and CUDA-callback threads oversubscribe a fully used CPU (13-26x slower measured).
RESERVED_CORES = 2

# KT_GPU_PREFILL_MIN_TOKENS=auto under CUDA: the token count from which one layer's GPU
# prefill beat its CPU path in `vllm-kt bench`'s layer timing on the H200 host (AMXINT4).
GPU_PREFILL_AUTO_MIN_TOKENS = 2048
# ... on a block-FP8 checkpoint (kt-kernel's FP8): an estimate, not yet a measured
# break-even. The FP8 sitting's GPU path cost ~11 ms per layer whatever the size (half the
# bytes of BF16 stream), where kt-kernel's BF16 kernel takes 20.7 ms per layer at 512
# tokens (its FP8 kernel is untimed; docs/design.md, GPU prefill).
GPU_PREFILL_AUTO_MIN_TOKENS_FP8 = 1024

# kt-kernel 0.7.2's inference methods (kt_kernel.experts.INFERENCE_METHODS; a test keeps
# this copy equal to it, so KT_METHOD's help can list them without importing kt-kernel).
KT_METHODS = (
    "AMXINT4",
    "AMXINT8",
    "BF16",
    "FP8",
    "FP8_PERCHANNEL",
    "RAWINT4",
    "GPTQ_INT4",
    "SYCL_GPTQ_INT4",
    "MXFP4",
    "NVFP4",
    "MXFP8",
    "LLAMAFILE",
    "MOE_INT4",
    "MOE_INT8",
)

# kt-kernel methods whose experts kt-kernel writes back in the layout of vLLM's Triton MoE
# kernels (NativeMoEWrapper.submit_write_weight_scale_to_buffer), with the checkpoint format
# they are that layout of: BF16 of unquantized checkpoints, FP8 (with its 128 x 128 block
# scales) of block-FP8 ones. GPU prefill stages them from kt-kernel's own copy, with no
# second copy in RAM.
UNQUANTIZED, BLOCK_FP8 = "unquantized", "block-FP8"
KT_GPU_LAYOUT_WRITERS = {"BF16": UNQUANTIZED, "FP8": BLOCK_FP8}

# KT_EXPERT_PLACEMENT values: which experts of each layer go to the GPU.
PLACEMENT_STRATEGIES = ("uniform", "front-loading", "random", "frequency")

# Variables kt-kernel 0.7.2 itself reads; they share our prefix and are not typos.
KT_KERNEL_OWN_VARIABLES = frozenset(
    {
        "KT_ADAPTER_MANIFEST_NAME",
        "KT_EXTERNAL_NPU_REPORT_SUBSCRIBER",
        "KT_FORCE_SYNC_SUBMIT",
        "KT_GPTQ_INT4_BACKEND",
        "KT_INT8_VNNI_BACKEND",
        "KT_KERNEL_CPU_VARIANT",
        "KT_KERNEL_DEBUG",
        "KT_LANG",
        "KT_MXFP4_BACKEND",
        "KT_MXFP8_BACKEND",
        "KT_NON_EXPERT_MANIFEST_NAME",
        "KT_RAWINT4_BACKEND",
        "KT_REUSE_CHECKPOINT_FORWARD",
        "KT_SFT_DEBUG",
        "KT_SFT_ENABLE_WARMUP",
    }
)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/vllm-kt-plugin`` (``~/.cache/...``): online weights, the demo's
    tiny model and benchmark files all live under it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-kt-plugin"


def default_cache_dir() -> Path:
    """KT_CACHE_DIR when unset."""
    return cache_root() / "kt-weights"


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    allowed: str
    help: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "KT_BACKEND",
        DEFAULT_BACKEND,
        "a registered CPU-expert backend: kt_kernel, torch, or one from an installed plugin",
        "which code computes the CPU experts",
    ),
    Variable(
        "KT_METHOD",
        "from the checkpoint (BF16 for unquantized, FP8 / FP8_PERCHANNEL / GPTQ_INT4 / RAWINT4)",
        f"a kt-kernel inference method ({', '.join(KT_METHODS)}); torch backend: BF16",
        "how the CPU experts are stored and computed",
    ),
    Variable(
        "KT_WEIGHT_PATH",
        "the model directory, for methods that read the Hugging Face checkpoint",
        "an existing directory holding the CPU expert weights in KT_METHOD's format",
        "where kt-kernel reads the CPU experts",
    ),
    Variable(
        "KT_CACHE_DIR",
        "$XDG_CACHE_HOME/vllm-kt-plugin/kt-weights (~/.cache/... without XDG_CACHE_HOME)",
        "a directory that exists or can be created, and is writable",
        "where AMXINT4/AMXINT8 CPU experts quantized online are kept (one folder per model, method, pools)",
    ),
    Variable(
        "KT_NUM_GPU_EXPERTS",
        "0",
        "an integer from 0 to the number of routed experts per layer, or auto (as many as fit the GPU)",
        "experts per MoE layer kept on the GPU (which ones: KT_EXPERT_PLACEMENT)",
    ),
    Variable(
        "KT_GPU_EXPERTS_RATIO",
        "unset",
        "a number from 0 to 1, not together with KT_NUM_GPU_EXPERTS",
        "fraction of each layer's routed experts kept on the GPU (rounded)",
    ),
    Variable(
        "KT_KV_CACHE_RESERVE_GB",
        "20% of the memory vLLM is granted, at least 2",
        "a number >= 0 (GB = 2**30 bytes)",
        "GPU memory KT_NUM_GPU_EXPERTS=auto leaves for the KV cache, activations and CUDA graphs",
    ),
    Variable(
        "KT_GPU_MEMORY_GB",
        "measured by vLLM's platform (NVML); unset without a CUDA GPU",
        "a number > 0 (GB = 2**30 bytes, e.g. 80 for an 80 GB A100/H100)",
        "GPU size used by KT_NUM_GPU_EXPERTS=auto and by a KT_CONFIG preset's table",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT",
        "uniform",
        f"{', '.join(PLACEMENT_STRATEGIES)} (frequency needs KT_EXPERT_PROFILE)",
        "which experts of each layer go to the GPU",
    ),
    Variable(
        "KT_EXPERT_PROFILE",
        "unset",
        'an existing JSON routing profile {"model", "num_experts", "layers": {"<layer>": [count per expert]}}',
        "expert activation counts for KT_EXPERT_PLACEMENT=frequency",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT_SEED",
        "0",
        "an integer >= 0",
        "seed of KT_EXPERT_PLACEMENT=random",
    ),
    Variable(
        "KT_CONFIG",
        "unset",
        "a preset name from configs/ (e.g. deepseek-v3, qwen3-30b-a3b) or the path of a preset YAML file",
        "preset settings for a model; KT_* variables override them",
    ),
    Variable(
        "KT_CPUINFER",
        f"usable cores - {RESERVED_CORES}, at least 1",
        "a positive integer",
        "CPU threads computing experts",
    ),
    Variable(
        "KT_THREADPOOL_COUNT",
        "1",
        "a positive integer, at most the NUMA node count and at most KT_CPUINFER",
        "thread pools (one per NUMA node)",
    ),
    Variable(
        "KT_CHUNKED_PREFILL_SIZE",
        "vLLM's max_num_batched_tokens",
        "an integer >= vLLM's max_num_batched_tokens",
        "tokens kt-kernel's buffers hold per forward",
    ),
    Variable(
        "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
        "0",
        "an integer from 0 to top_k - 1",
        "CPU experts per token whose result is added one layer later (0 on the last MoE layer)",
    ),
    Variable(
        "KT_GPU_PREFILL_MIN_TOKENS",
        f"auto: {GPU_PREFILL_AUTO_MIN_TOKENS} under CUDA (the break-even measured on the H200, docs/design.md; "
        f"{GPU_PREFILL_AUTO_MIN_TOKENS_FP8} on block-FP8 checkpoints, estimated) where the CPU experts can be staged "
        "(unquantized on vLLM's Triton kernels, or block-FP8 with KT_METHOD=FP8) and the staging fits; else off",
        "auto, or an integer >= 0 (0 = off)",
        "forward passes with at least this many tokens compute every expert on the GPU, "
        "the CPU experts' weights streamed in layer by layer",
    ),
    Variable(
        "KT_DYNAMIC_GPU_EXPERTS",
        "0 (off)",
        "an integer >= 0; needs KT_METHOD=BF16 and one tensor-parallel rank",
        "every N-th forward pass that runs outside CUDA graphs, each layer's most-picked CPU experts swap "
        "places with its least-picked GPU experts (routing counted on the device, CUDA graphs included)",
    ),
    Variable(
        "KT_METRICS_INTERVAL",
        "0 (off)",
        "a number of seconds >= 0",
        "log per-layer CPU-expert, GPU-expert and CPU-wait times every N seconds (also Prometheus counters)",
    ),
)
KNOWN_VARIABLES = frozenset(v.name for v in VARIABLES)
BY_NAME = {v.name: v for v in VARIABLES}
