"""CPU experts computed by kt-kernel (AMX / AVX-512 / AVX2 kernels)."""

from __future__ import annotations

import functools
import glob
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts, LayerSpec
from vllm_kt_plugin.cpu_backends.kt_weight_cache import (
    PROGRESS,
    ExpertTensors,
    cache_folder,
    layer_is_cached,
    quantize_into_cache,
)
from vllm_kt_plugin.env_config import LOGGER_NAME, KTConfigError, KTEnvConfig, check_cache_dir, error_for
from vllm_kt_plugin.hookspecs import hookimpl
from vllm_kt_plugin.kt_compat import prepare_kt_kernel

logger = logging.getLogger(LOGGER_NAME)

# Methods whose weights kt-kernel reads straight from a Hugging Face checkpoint's
# safetensors, so KT_WEIGHT_PATH can default to the model directory.
READS_HF_CHECKPOINT = frozenset({"BF16", "FP8", "FP8_PERCHANNEL", "GPTQ_INT4", "RAWINT4", "MXFP4", "NVFP4", "MXFP8"})
# Methods kt-kernel quantizes online from BF16 tensors (load_weights_from_tensors); it
# runs them with AMX tiles where the CPU has them, else with AVX-512.
QUANTIZES_ONLINE = frozenset({"AMXINT4", "AMXINT8"})
# kt-kernel 0.7.2's AMX kernels tile hidden and expert-intermediate sizes in these steps;
# other sizes fail ("n or k is not aligned") or crash, so they are refused up front.
ONLINE_ALIGNMENT = {"AMXINT4": 128, "AMXINT8": 64}
# kt-kernel's own availability flags (kt_kernel.utils.amx) per method: the kernels the
# loaded build carries. kt-kernel checks the same flags, but only after vLLM has loaded
# every GPU weight; we check them at config time.
KERNEL_FLAGS = {
    "AMXINT4": ("_HAS_AMXINT4_SUPPORT",),
    "AMXINT8": ("_HAS_AMXINT8_SUPPORT",),
    "BF16": ("_HAS_BF16_SUPPORT", "_HAS_AVX2_BF16_SUPPORT"),
    "FP8": ("_HAS_FP8_SUPPORT", "_HAS_AVX2_FP8_SUPPORT"),
    "FP8_PERCHANNEL": ("_HAS_FP8_PERCHANNEL_SUPPORT",),
    "RAWINT4": ("_HAS_RAWINT4_SUPPORT", "_HAS_AVX2_RAWINT4_SUPPORT", "_HAS_AVXVNNI256_RAW_INT4_SUPPORT"),
    "GPTQ_INT4": (
        "_HAS_AVX2_GPTQ_INT4_SUPPORT",
        "_HAS_AVXVNNI256_GPTQ_INT4_SUPPORT",
        "_HAS_AVXVNNI256_PACKED_GPTQ_INT4_SUPPORT",
    ),
    "SYCL_GPTQ_INT4": ("_HAS_SYCL_GPTQ_INT4_SUPPORT",),
    "MXFP4": ("_HAS_MXFP4_SUPPORT", "_HAS_AVX2_MXFP4_SUPPORT"),
    "NVFP4": ("_HAS_AVX2_MXFP4_SUPPORT",),
    "MXFP8": ("_HAS_MXFP8_SUPPORT", "_HAS_AVX2_MXFP8_SUPPORT"),
}


def kt_inference_methods() -> frozenset[str]:
    prepare_kt_kernel()
    from kt_kernel.experts import INFERENCE_METHODS

    return frozenset(INFERENCE_METHODS)


def kernel_available(method: str) -> bool:
    """Whether the kt-kernel build this CPU loaded carries a kernel for ``method``."""
    flags = KERNEL_FLAGS.get(method)
    if flags is None:
        return True
    from kt_kernel.utils import amx

    return any(getattr(amx, flag, True) for flag in flags)


def local_model_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The directory holding ``model``'s files (a hub id resolves to its local snapshot)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)


def _check_weight_files(method: str, directory: str, *, is_model_dir: bool) -> None:
    """kt-kernel's loaders walk the directory for safetensors (GGUF for LLAMAFILE); its
    AMX and MOE_* formats it checks itself."""
    if method not in READS_HF_CHECKPOINT and method != "LLAMAFILE":
        return
    pattern = "*.gguf" if method == "LLAMAFILE" else "*.safetensors"
    if glob.glob(os.path.join(directory, "**", pattern), recursive=True):
        return
    if is_model_dir:
        raise KTConfigError(
            f"KT_WEIGHT_PATH is unset, so kt-kernel reads the model directory {directory}, "
            f"which holds no {pattern} files for KT_METHOD={method}; allowed: set KT_WEIGHT_PATH "
            "to a directory with the CPU expert weights."
        )
    raise error_for("KT_WEIGHT_PATH", directory, f"holds no {pattern} files, which KT_METHOD={method} reads")


def _ct_weight_scheme(quant_config: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors: the weight scheme of its (first) config group."""
    for group in (quant_config.get("config_groups") or {}).values():
        return group.get("weights") or {}
    return {}


class KTKernelExperts(CPUExperts):
    name: ClassVar[str] = "kt_kernel"
    supports_cuda_graphs: ClassVar[bool] = True

    @classmethod
    def default_method(cls, checkpoint: CheckpointFormat) -> str:
        """The kt-kernel method that reads this checkpoint's own expert tensors."""
        quant, cfg = checkpoint.quant_method, checkpoint.quant_config
        if quant is None:
            return "BF16"
        if quant == "fp8" and cfg.get("weight_block_size"):
            return "FP8"  # block scales (weight_scale_inv), as in DeepSeek-V3
        symmetric_gptq = cfg.get("sym", True) and not cfg.get("desc_act", False)
        if quant in ("gptq", "gptq_marlin") and checkpoint.weight_bits == 4 and symmetric_gptq:
            return "GPTQ_INT4"
        if quant == "compressed-tensors":
            scheme = _ct_weight_scheme(cfg)
            if scheme.get("num_bits") == 4 and scheme.get("type", "int") == "int":
                return "RAWINT4"
            if scheme.get("num_bits") == 8 and scheme.get("type") == "float" and scheme.get("strategy") == "channel":
                return "FP8_PERCHANNEL"
        raise KTConfigError(
            f"KT_METHOD is unset and kt-kernel reads no {quant!r} checkpoint of this kind "
            "directly; allowed: set KT_METHOD to a kt-kernel method and KT_WEIGHT_PATH to expert "
            "weights in that format (e.g. AMXINT4 weights converted by kt-kernel)."
        )

    @classmethod
    def validate(cls, config: KTEnvConfig, checkpoint: CheckpointFormat) -> None:
        method = config.method
        assert method is not None, "the quant config resolves the method first"
        if method not in kt_inference_methods():
            raise error_for("KT_METHOD", method, "not a kt-kernel 0.7.2 inference method")
        if not kernel_available(method):
            hint = "a CPU with AVX-512 (AMX is fastest)" if method in QUANTIZES_ONLINE else "another method"
            raise error_for("KT_METHOD", method, f"this CPU / kt-kernel build has no {method} kernel; use {hint}")
        if config.weight_path is not None:
            _check_weight_files(method, config.weight_path, is_model_dir=False)
            return
        if method in QUANTIZES_ONLINE:
            cls._validate_online(config, checkpoint)
            return
        if method not in READS_HF_CHECKPOINT:
            raise KTConfigError(
                f"KT_WEIGHT_PATH is unset, but KT_METHOD={method} reads kt-kernel's converted "
                "weights, which the model directory does not hold; allowed: a directory with "
                f"{method} weights, or a KT_METHOD in {sorted(READS_HF_CHECKPOINT)}."
            )
        try:
            own = cls.default_method(checkpoint)
        except KTConfigError:
            own = None
        if method != own:
            stored = checkpoint.quant_method or "unquantized"
            raise error_for(
                "KT_METHOD",
                method,
                f"KT_WEIGHT_PATH is unset, so kt-kernel would read the model's own {stored} "
                f"weights, which {method} cannot; set KT_WEIGHT_PATH to {method} weights"
                + (f" or use KT_METHOD={own}" if own else ""),
            )

    @classmethod
    def _validate_online(cls, config: KTEnvConfig, checkpoint: CheckpointFormat) -> None:
        """AMXINT4/AMXINT8 without KT_WEIGHT_PATH: quantized from the BF16/FP16 tensors vLLM
        loads, so the checkpoint must hold them unquantized; the cache must be writable."""
        if checkpoint.quant_method is not None:
            raise error_for(
                "KT_METHOD",
                config.method,
                f"KT_WEIGHT_PATH is unset, so the CPU experts would be quantized online from the "
                f"checkpoint's tensors, which are {checkpoint.quant_method}, not BF16/FP16; set "
                f"KT_WEIGHT_PATH to converted {config.method} weights",
            )
        check_cache_dir(config.cache_dir)

    @classmethod
    def check_model_dir(cls, config: KTEnvConfig, model_dir: str) -> None:
        if config.weight_path is None and config.method is not None:
            _check_weight_files(config.method, model_dir, is_model_dir=True)

    def __init__(self, spec: LayerSpec, config: KTEnvConfig) -> None:
        super().__init__(spec, config)
        assert config.method is not None
        self.method = config.method
        self.wrapper: Any = None
        self.physical_to_logical: torch.Tensor | None = None
        self._stream = 0
        # Online quantization: the layer's tensors are collected, quantized into the cache
        # once complete, and loaded from there; a cached layer skips the first two steps.
        self.online = config.weight_path is None and self.method in QUANTIZES_ONLINE
        self._collected: ExpertTensors | None = None
        self._needs_quantizing: bool | None = None  # decided on first use (files are local by then)
        self._check_alignment()
        PROGRESS.expect_layer()

    @functools.cached_property
    def cache(self) -> Path | None:
        """This layer's cache folder. Resolved on first use, during weight loading: a hub
        model's snapshot (whose path carries its commit) is only local by then."""
        if not self.online:
            return None
        spec, cfg = self.spec, self.config
        dummy = spec.load_format == "dummy"
        return cache_folder(
            cfg.cache_dir,
            model=spec.model,
            model_dir=None if dummy else local_model_dir(spec.model, spec.revision, spec.download_dir),
            method=self.method,
            pools=cfg.threadpool_count,
            shape=(spec.num_experts, spec.hidden_size, spec.intermediate_size),
        )

    def _check_alignment(self) -> None:
        step = ONLINE_ALIGNMENT.get(self.method)
        spec = self.spec
        if step and (spec.hidden_size % step or spec.intermediate_size % step):
            raise error_for(
                "KT_METHOD",
                self.method,
                f"kt-kernel's {self.method} kernels need hidden and expert intermediate sizes that are "
                f"multiples of {step}; this model has {spec.hidden_size} and {spec.intermediate_size}",
            )

    @property
    def wants_all_experts(self) -> bool:
        if self._needs_quantizing is None:  # checked once: the loader asks for every tensor
            cache = self.cache
            spec = self.spec
            self._needs_quantizing = cache is not None and not layer_is_cached(cache, spec.layer_idx, spec.num_experts)
        return self._needs_quantizing

    def _wrapper_args(self, max_deferred_experts_per_token: int = 0) -> dict[str, Any]:
        spec, cfg = self.spec, self.config
        return {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "hidden_size": spec.hidden_size,
            "moe_intermediate_size": spec.intermediate_size,
            "gpu_experts_mask": spec.placement.gpu_mask,
            "cpuinfer_threads": cfg.cpuinfer_threads,
            "threadpool_count": cfg.threadpool_count,
            "chunked_prefill_size": spec.chunked_prefill_size,
            "max_deferred_experts_per_token": max_deferred_experts_per_token,
            "method": self.method,
        }

    def load_checkpoint_tensor(self, expert_id: int, shard_id: str, tensor: torch.Tensor) -> None:
        if not self.wants_all_experts:
            return  # kt-kernel reads its own files
        spec = self.spec
        if self._collected is None:
            self._collected = ExpertTensors(spec.num_experts, spec.hidden_size, spec.intermediate_size)
        self._collected.put(expert_id, shard_id, tensor)
        if self._collected.complete:
            self._quantize()

    def _quantize(self) -> None:
        assert self.cache is not None and self._collected is not None
        kt_kernel = prepare_kt_kernel()
        start = time.perf_counter()
        quantize_into_cache(kt_kernel, self.cache, self.spec.layer_idx, self._collected, **self._wrapper_args())
        self._collected = None  # frees the layer's BF16 copy
        self._needs_quantizing = False
        PROGRESS.layer_quantized(
            self.spec.layer_name,
            f"quantized {self.spec.num_experts} experts to {self.method} into {self.cache}",
            time.perf_counter() - start,
        )

    def _complete_online_weights(self) -> None:
        """Before loading: quantize a layer vLLM did not hand over in full (random weights
        under load_format=dummy, which loads no checkpoint)."""
        if not self.wants_all_experts:
            return
        spec = self.spec
        collected = self._collected or ExpertTensors(spec.num_experts, spec.hidden_size, spec.intermediate_size)
        if spec.load_format != "dummy":
            raise RuntimeError(
                f"kt-hybrid: {spec.layer_name}: the checkpoint lacked {collected.missing()} of the "
                f"{3 * spec.num_experts} expert gate/up/down tensors needed to quantize the layer to {self.method}"
            )
        collected.fill_dummy(spec.layer_idx)
        self._collected = collected
        self._quantize()

    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        spec, cfg = self.spec, self.config
        kt_kernel = prepare_kt_kernel()
        if spec.cuda_graph_batch_sizes:
            # Graph replays reuse the addresses captured for each batch size: kt-kernel
            # keeps one set of pinned/device buffers per listed size (else it reallocates).
            kt_kernel.KTMoEWrapper.set_capture_batch_sizes(list(spec.cuda_graph_batch_sizes))
        self._complete_online_weights()
        if self.cache is not None:
            weight_path = str(self.cache)
        else:
            weight_path = cfg.weight_path or local_model_dir(spec.model, spec.revision, spec.download_dir)
        start = time.perf_counter()
        self.wrapper = kt_kernel.KTMoEWrapper(
            layer_idx=spec.layer_idx, weight_path=weight_path, **self._wrapper_args(max_deferred_experts_per_token)
        )
        # kt-kernel keeps this tensor's address and reads it on every forward: it must
        # live as long as the layer (a temporary here gave nondeterministic outputs).
        self.physical_to_logical = torch.arange(spec.num_experts, dtype=torch.long)
        self.wrapper.load_weights(self.physical_to_logical)
        PROGRESS.layer_ready(
            spec.layer_name,
            f"loaded {spec.placement.num_cpu_experts} CPU experts ({self.method}, kt-kernel "
            f"{kt_kernel.__cpu_variant__} kernels, {cfg.cpuinfer_threads} threads) from {weight_path}",
            time.perf_counter() - start,
        )

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        # kt-kernel orders its work on this CUDA stream; 0 selects its synchronous
        # path on CPU-only hosts (see kt_compat).
        self._stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        self.wrapper.submit_forward(x, topk_ids, topk_weights, self._stream)

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        # kt-kernel returns one of its reusable buffers: the caller consumes it at once.
        return self.wrapper.sync_forward(x, self._stream)


@hookimpl
def kt_cpu_backends() -> dict[str, type[CPUExperts]]:
    return {KTKernelExperts.name: KTKernelExperts}
