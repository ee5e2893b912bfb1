"""CPU experts computed by kt-kernel (AMX / AVX-512 / AVX2 kernels)."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts, Diagnostic, LayerSpec
from vllm_kt_plugin.cpu_backends.kt_kernel.compat import load_bf16_from_tensors, prepare_kt_kernel
from vllm_kt_plugin.cpu_backends.kt_kernel.cores import keep_vllm_off_kt_cores, resolved_vllm_cores
from vllm_kt_plugin.cpu_backends.kt_kernel.diagnostics import check_cpu, check_weights, fastest_here
from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import (
    LLAMAFILE_BLOCK,
    gguf_files,
    is_gguf_path,
    kt_kernel_path,
)
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import pick_fastest, ranking, source
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import (
    ONLINE_ALIGNMENT,
    QUANTIZES_ONLINE,
    READS_HF_CHECKPOINT,
    broken_kernel,
    kernel_available,
    kt_inference_methods,
    writes_gpu_layout,
)
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import (
    PROGRESS,
    ExpertTensors,
    cache_folder,
    layer_is_cached,
    layer_is_damaged,
    quantize_into_cache,
)
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_files import TensorInfo, check_expert_tensors, fp8_blocks, read_index
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import (
    Checkpoint,
    check_default,
    check_model_directory,
    check_weight_path,
    classify,
)
from vllm_kt_plugin.hookspecs import hookimpl
from vllm_kt_plugin.settings.catalogue import AUTO_METHOD, GIB, LOGGER_NAME
from vllm_kt_plugin.settings.errors import UNSET, KTConfigError
from vllm_kt_plugin.settings.model_memory import ExpertShape, ModelConfigError, estimate_model_memory, expert_shape
from vllm_kt_plugin.settings.variables import KTSettings, check_cache_dir

logger = logging.getLogger(LOGGER_NAME)


def local_model_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The directory holding ``model``'s files (a hub id resolves to its local snapshot)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)


def _read_config(model_dir: str | None) -> dict[str, Any] | None:
    path = Path(model_dir) / "config.json" if model_dir else None
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None  # doctor's model check says why


def _check_cache_room(
    settings: KTSettings, model: str, model_dir: str | None, hf_config: Mapping[str, Any], shape: ExpertShape
) -> None:
    """Online AMX weights of the layers not cached yet must fit in KT_CACHE_DIR's free space:
    a disk that fills up mid-way would fail only after vLLM loaded every GPU weight."""
    method = settings.method
    assert method is not None
    total = estimate_model_memory(hf_config).cpu_expert_bytes(method)
    if total is None:
        return
    has_weights = model_dir is not None and any(Path(model_dir).glob("*.safetensors"))
    folder = cache_folder(
        settings.cache_dir,
        model=model,
        model_dir=model_dir if has_weights else None,  # a config-only directory: dummy weights
        method=method,
        pools=settings.threadpool_count,
        shape=(shape.num_experts, shape.hidden_size, shape.intermediate_size),
    )
    missing = [i for i in shape.moe_layers if not layer_is_cached(folder, i, shape.num_experts)]
    need = total * len(missing) // max(len(shape.moe_layers), 1)
    free = shutil.disk_usage(settings.cache_dir).free
    if need > free:
        raise KTConfigError(
            "KT_CACHE_DIR",
            settings.cache_dir,
            f"the {method} CPU experts of {len(missing)} uncached layers need ~{need / GIB:.1f} GB there, "
            f"{free / GIB:.1f} GB are free",
            "a writable directory with room for them (or free space there)",
        )


def check_alignment(
    method: str, hidden_size: int, intermediate_size: int, *, auto: bool = False, pools: int = 1
) -> None:
    """kt-kernel's AMX kernels tile the hidden and expert-intermediate sizes; other sizes fail
    in its C++ ("n or k is not aligned") or crash. LLAMAFILE computes in 256-wide blocks:
    other expert widths kt-kernel refuses after vLLM loaded the GPU weights, other hidden
    sizes it computes wrongly without an error (zeros at 128 and 192, wrong sums at 384 and
    640: measured, tests/unit/test_llamafile_types.py), and each thread pool needs one
    block of the width. The refusal names what does fit."""
    value = f"auto (which picked {method})" if auto else method
    if method == "LLAMAFILE":
        misfits = [
            f"{name} {size}"
            for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size))
            if size % LLAMAFILE_BLOCK
        ]
        if misfits:
            raise KTConfigError(
                "KT_METHOD",
                value,
                f"kt-kernel's LLAMAFILE needs a hidden size and an expert intermediate size (moe_intermediate_size) "
                f"that are multiples of {LLAMAFILE_BLOCK}; this model has {' and '.join(misfits)}",
                "a method that reads the checkpoint (unset KT_METHOD), or AMXINT4/AMXINT8 where the sizes fit",
            )
        if intermediate_size // LLAMAFILE_BLOCK < pools:
            raise KTConfigError(
                "KT_THREADPOOL_COUNT",
                str(pools),
                f"LLAMAFILE gives each thread pool whole {LLAMAFILE_BLOCK}-wide blocks of the experts' "
                f"{intermediate_size} columns",
                f"at most {intermediate_size // LLAMAFILE_BLOCK} with KT_METHOD=LLAMAFILE for this model",
            )
        return
    step = ONLINE_ALIGNMENT.get(method)
    if not step or not (hidden_size % step or intermediate_size % step):
        return
    fitting = [
        f"{other} (sizes that are multiples of {other_step})"
        for other, other_step in sorted(ONLINE_ALIGNMENT.items())
        if other != method and not (hidden_size % other_step or intermediate_size % other_step)
    ]
    raise KTConfigError(
        "KT_METHOD",
        value,
        f"kt-kernel's {method} kernels need hidden and expert intermediate sizes that are multiples of {step}; "
        f"this model has {hidden_size} and {intermediate_size}",
        " or ".join(["KT_METHOD unset (the checkpoint's own method, BF16 for a BF16 checkpoint)", *fitting]),
    )


def _ct_weight_scheme(quant_config: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors: the weight scheme of its (first) config group."""
    for group in (quant_config.get("config_groups") or {}).values():
        return group.get("weights") or {}
    return {}


def _takes_loaded_bf16(method: str, weight_path: str | None) -> bool:
    """BF16 from the model's own checkpoint: where kt-kernel's loader cannot read its
    experts, they are taken as vLLM loads them (``KTKernelExperts.from_loader``)."""
    return method == "BF16" and weight_path is None


@functools.cache
def _checkpoint_index(directory: str) -> dict[str, TensorInfo]:
    """The checkpoint's tensor index, read once per process: every layer asks of it."""
    return read_index(directory, is_model_dir=True)


def _kt_kernel_reads_layer(directory: str, layer: int, num_experts: int, hidden: int, intermediate: int) -> bool:
    """Whether kt-kernel's BF16 loader finds this layer's experts in the checkpoint, named
    and shaped as it reads them."""
    try:
        index = _checkpoint_index(directory)
        check_expert_tensors(
            "BF16", directory, [layer], num_experts, hidden, intermediate, is_model_dir=True, index=index
        )
    except KTConfigError:
        return False
    return True


class KTKernelExperts(CPUExperts):
    name: ClassVar[str] = "kt_kernel"
    supports_cuda_graphs: ClassVar[bool] = True

    @classmethod
    def default_method(cls, checkpoint: CheckpointFormat) -> str:
        """The kt-kernel method that reads this checkpoint's own expert tensors."""
        quant, quant_config = checkpoint.quant_method, checkpoint.quant_config
        if quant is None:
            return "BF16"
        # The checkpoint's own name: vLLM's varies by version and GPU (0.32: gptq -> auto_gptq).
        quant = str(quant_config.get("quant_method") or quant).lower()
        if quant == "fp8" and quant_config.get("weight_block_size"):
            return "FP8"  # block scales (weight_scale_inv), as in DeepSeek-V3
        symmetric_gptq = quant_config.get("sym", True) and not quant_config.get("desc_act", False)
        if quant == "gptq" and checkpoint.weight_bits == 4 and symmetric_gptq:
            return "GPTQ_INT4"
        if quant == "compressed-tensors":
            scheme = _ct_weight_scheme(quant_config)
            if scheme.get("num_bits") == 4 and scheme.get("type", "int") == "int":
                return "RAWINT4"
            if scheme.get("num_bits") == 8 and scheme.get("type") == "float" and scheme.get("strategy") == "channel":
                return "FP8_PERCHANNEL"
        raise KTConfigError(
            "KT_METHOD",
            UNSET,
            f"kt-kernel reads no {quant!r} checkpoint of this kind directly",
            "set KT_METHOD to a kt-kernel method and KT_WEIGHT_PATH to expert weights in that format "
            "(e.g. AMXINT4 weights converted by kt-kernel)",
        )

    @classmethod
    def resolve_method(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> KTSettings:
        """KT_METHOD as set; unset with GGUF weights: LLAMAFILE (the one method that reads
        them); ``auto``: the fastest this CPU's kt-kernel variant ran in the measured table
        among the methods these weights allow (one log line says which, and what faster
        method other weights would allow)."""
        if settings.method == AUTO_METHOD:
            method, line = cls._auto_method(settings, checkpoint)
            logger.info("kt-hybrid: %s", line)
            return settings.with_method(method, auto=True)
        if settings.method is None and settings.weight_path is not None and is_gguf_path(settings.weight_path):
            return settings.with_method("LLAMAFILE")
        return super().resolve_method(settings, checkpoint)

    @classmethod
    def _auto_method(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> tuple[str, str]:
        gguf = settings.weight_path is not None and is_gguf_path(settings.weight_path)
        if settings.weight_path is not None and not gguf:
            raise KTConfigError(
                "KT_METHOD",
                "auto",
                f"KT_WEIGHT_PATH={settings.weight_path} holds {classify(settings.weight_path).describe()}; auto picks "
                "among the methods that read the checkpoint or GGUF weights",
                "KT_METHOD set to the method of those weights, or auto with KT_WEIGHT_PATH unset (the checkpoint) "
                "or naming GGUF weights",
            )
        variant = str(prepare_kt_kernel().__cpu_variant__)
        ranked = [s for s in ranking(variant) if kernel_available(s.method)]
        if not ranked:
            raise KTConfigError(
                "KT_METHOD", "auto", f"the measured table ({source()}) has no row for kt-kernel's {variant} kernels"
            )
        chosen, line = pick_fastest(ranked, variant, gguf=gguf, quantized=checkpoint.quant_method)
        if chosen is None:  # a quantized checkpoint and no GGUF: its own method, which the table lacks
            return cls.default_method(checkpoint), line
        return chosen.method, line

    @classmethod
    def validate(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> None:
        method = settings.method
        assert method is not None, "the quant config resolves the method first"
        if method not in kt_inference_methods():
            raise KTConfigError("KT_METHOD", method, "not a kt-kernel 0.7.2 inference method")
        if not kernel_available(method):
            hint = "a CPU with AVX-512 (AMX is fastest)" if method in QUANTIZES_ONLINE else "another method"
            broken = broken_kernel(method)
            reason = f"kt-kernel {broken}" if broken else f"this CPU / kt-kernel build has no {method} kernel"
            runnable = sorted(m for m in kt_inference_methods() if m != method and kernel_available(m))
            raise KTConfigError(
                "KT_METHOD", method, f"{reason}; use {hint}", f"a method this build runs: {', '.join(runnable)}"
            )
        checkpoint_of = cls.checkpoint(checkpoint)
        if settings.weight_path is not None:
            check_weight_path(method, settings.weight_path, pools=settings.threadpool_count, checkpoint=checkpoint_of)
            if method == "LLAMAFILE":
                gguf_files(settings.weight_path)  # the file, the whole split set, or a folder's; in full later
            return
        refusal = check_default(method, checkpoint_of)
        if refusal is not None:
            raise refusal
        if method in QUANTIZES_ONLINE:
            check_cache_dir(settings.cache_dir)

    @classmethod
    def checkpoint(cls, checkpoint: CheckpointFormat) -> Checkpoint:
        """The checkpoint as the weight checks name it: its format and the method that reads it."""
        try:
            own = cls.default_method(checkpoint)
        except KTConfigError:
            own = None
        return Checkpoint(checkpoint.quant_method, own)

    @classmethod
    def check_model(cls, settings: KTSettings, model: str, hf_config: Mapping[str, Any]) -> None:
        """Before any weight loads: the sizes the method's kernels take, the files kt-kernel will
        read (every expert present, of the model's shape, every file readable), and room in
        KT_CACHE_DIR for online weights."""
        method = settings.method
        assert method is not None, "the quant config resolves the method first"
        model_dir = model if os.path.isdir(model) else None
        reads_model_dir = settings.weight_path is None and model_dir is not None and method in READS_HF_CHECKPOINT
        if reads_model_dir:
            check_model_directory(method, model_dir)
        try:
            shape = expert_shape(hf_config)
        except ModelConfigError:  # a config layout we cannot read: kt-kernel's own checks remain
            return
        check_alignment(
            method,
            shape.hidden_size,
            shape.intermediate_size,
            auto=settings.auto_method,
            pools=settings.threadpool_count,
        )
        if settings.weight_path is not None:
            variant = str(prepare_kt_kernel().__cpu_variant__) if method == "LLAMAFILE" else None
            check_weight_path(
                method, settings.weight_path, pools=settings.threadpool_count, model=shape, variant=variant
            )
        elif reads_model_dir:
            try:
                check_model_directory(method, model_dir, shape)
            except KTConfigError as error:
                if not _takes_loaded_bf16(method, settings.weight_path):
                    raise
                logger.info(
                    "kt-hybrid: kt-kernel's BF16 loader does not read this checkpoint's experts (%s): it takes "
                    "them as vLLM loads them",
                    error.reason,
                )
        if settings.weight_path is None and method in QUANTIZES_ONLINE:
            _check_cache_room(settings, model, model_dir, hf_config, shape)

    @classmethod
    def diagnose(
        cls, settings: KTSettings, cpu_flags: frozenset[str], weight_path: str | None, model_dir: str | None
    ) -> list[Diagnostic]:
        return [
            check_cpu(settings.method, cpu_flags),
            fastest_here(weight_path),
            cls._diagnose_weights(settings, weight_path, model_dir),
        ]

    @classmethod
    def _diagnose_weights(cls, settings: KTSettings, weight_path: str | None, model_dir: str | None) -> Diagnostic:
        """Serve's weight checks (weight_paths.py), on what doctor knows: the model's
        config.json where ``model_dir`` is a folder holding one."""
        config = _read_config(model_dir)
        quant = (config or {}).get("quantization_config") or {}
        checkpoint = cls.checkpoint(CheckpointFormat(quant.get("quant_method"), quant)) if config else None
        try:
            shape = expert_shape(config) if config is not None else None
        except ModelConfigError:
            shape = None
        variant = None
        if settings.method == "LLAMAFILE":
            try:
                variant = str(prepare_kt_kernel().__cpu_variant__)
            except KTConfigError:
                variant = None
        return check_weights(
            settings.method,
            weight_path,
            model_dir if model_dir is not None and os.path.isdir(model_dir) else None,
            pools=settings.threadpool_count,
            checkpoint=checkpoint,
            shape=shape,
            variant=variant,
        )

    def __init__(self, spec: LayerSpec, settings: KTSettings) -> None:
        super().__init__(spec, settings)
        assert settings.method is not None
        self.method = settings.method
        # BF16 experts kt-kernel's loader cannot read from the checkpoint: collected from
        # vLLM's loader instead (decided on first use, when the files are local)
        self._from_loader: bool | None = None
        self.wrapper: Any = None
        self.physical_to_logical: torch.Tensor | None = None
        self._stream = 0
        # Online quantization: the layer's tensors are collected, quantized into the cache
        # once complete, and loaded from there; a cached layer skips the first two steps.
        self.online = settings.weight_path is None and self.method in QUANTIZES_ONLINE
        self._collected: ExpertTensors | None = None
        self._needs_quantizing: bool | None = None  # decided on first use (files are local by then)
        check_alignment(  # checked at config time too
            self.method, spec.hidden_size, spec.intermediate_size, pools=settings.threadpool_count
        )
        PROGRESS.expect_layer()

    @functools.cached_property
    def cache(self) -> Path | None:
        """This layer's cache folder. Resolved on first use, during weight loading: a hub
        model's snapshot (whose path carries its commit) is only local by then."""
        if not self.online:
            return None
        spec, settings = self.spec, self.settings
        dummy = spec.load_format == "dummy"
        return cache_folder(
            settings.cache_dir,
            model=spec.model,
            model_dir=None if dummy else local_model_dir(spec.model, spec.revision, spec.download_dir),
            method=self.method,
            pools=settings.threadpool_count,
            shape=(spec.num_experts, spec.hidden_size, spec.intermediate_size),
        )

    @property
    def from_loader(self) -> bool:
        """Whether this layer's experts come from vLLM's loader (kt-kernel's BF16 loader
        does not read them from the checkpoint: other tensor names or layouts)."""
        if self._from_loader is None:
            spec = self.spec
            self._from_loader = (
                _takes_loaded_bf16(self.method, self.settings.weight_path)
                and spec.load_format != "dummy"
                and not _kt_kernel_reads_layer(
                    local_model_dir(spec.model, spec.revision, spec.download_dir),
                    spec.layer_idx,
                    spec.num_experts,
                    spec.hidden_size,
                    spec.intermediate_size,
                )
            )
        return self._from_loader

    @property
    def wants_all_experts(self) -> bool:
        if self.from_loader:
            return True
        if self._needs_quantizing is None:  # checked once: the loader asks for every tensor
            cache = self.cache
            spec = self.spec
            self._needs_quantizing = cache is not None and not layer_is_cached(cache, spec.layer_idx, spec.num_experts)
            if cache is not None and layer_is_damaged(cache, spec.layer_idx, spec.num_experts):
                logger.warning(
                    "kt-hybrid: %s: the cached %s layer in %s is incomplete or damaged (files missing or cut "
                    "short); quantizing it again",
                    spec.layer_name,
                    self.method,
                    cache / f"_layer_{spec.layer_idx}",
                )
        return self._needs_quantizing

    def _wrapper_args(self, max_deferred_experts_per_token: int = 0) -> dict[str, Any]:
        spec, settings = self.spec, self.settings
        return {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "hidden_size": spec.hidden_size,
            "moe_intermediate_size": spec.intermediate_size,
            "gpu_experts_mask": spec.placement.gpu_mask,
            "cpuinfer_threads": settings.cpuinfer_threads,
            "threadpool_count": settings.threadpool_count,
            "numa_nodes": list(settings.numa_nodes) if settings.numa_nodes else None,
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
        if self._collected.complete and not self.from_loader:
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

    def fill_cache(self) -> bool:
        """Quantize this layer's random (load_format=dummy) experts into KT_CACHE_DIR now,
        as an engine start would, e.g. ahead of it while the GPU is busy; False when the
        layer was cached already."""
        if not self.wants_all_experts:
            return False
        self._complete_online_weights()
        return True

    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        spec, settings = self.spec, self.settings
        kt_kernel = prepare_kt_kernel()
        if spec.cuda_graph_batch_sizes:
            # Graph replays reuse the addresses captured for each batch size: kt-kernel
            # keeps one set of pinned/device buffers per listed size (else it reallocates).
            kt_kernel.KTMoEWrapper.set_capture_batch_sizes(list(spec.cuda_graph_batch_sizes))
        if self.from_loader:
            self._load_collected(kt_kernel)
            return
        self._complete_online_weights()
        if self.cache is not None:
            weight_path = str(self.cache)
        elif self.method == "LLAMAFILE" and settings.weight_path is not None:
            # the file, or a folder holding exactly the model's files (a split set among others: links)
            weight_path = kt_kernel_path(settings.weight_path, gguf_files(settings.weight_path), settings.cache_dir)
        else:
            weight_path = settings.weight_path or local_model_dir(spec.model, spec.revision, spec.download_dir)
        start = time.perf_counter()
        self.wrapper = kt_kernel.KTMoEWrapper(
            layer_idx=spec.layer_idx, weight_path=weight_path, **self._wrapper_args(max_deferred_experts_per_token)
        )
        if resolved_vllm_cores(settings) == "free":  # kt-kernel's workers exist now
            keep_vllm_off_kt_cores(settings.cpuinfer_threads)
        # kt-kernel keeps this tensor's address and reads it on every forward: it must
        # live as long as the layer (a temporary here gave nondeterministic outputs).
        self.physical_to_logical = torch.arange(spec.num_experts, dtype=torch.long)
        self.wrapper.load_weights(self.physical_to_logical)
        PROGRESS.layer_ready(
            spec.layer_name,
            f"loaded {spec.placement.num_cpu_experts} CPU experts ({self.method}, kt-kernel "
            f"{kt_kernel.__cpu_variant__} kernels, {settings.cpuinfer_threads} threads) from {weight_path}",
            time.perf_counter() - start,
        )

    def _load_collected(self, kt_kernel: Any) -> None:
        """kt-kernel BF16 experts from the tensors vLLM's loader handed over (``from_loader``)."""
        spec, collected = self.spec, self._collected
        if collected is None or not collected.complete:
            missing = collected.missing() if collected is not None else 3 * spec.num_experts
            raise RuntimeError(
                f"kt-hybrid: {spec.layer_name}: vLLM's loader gave {3 * spec.num_experts - missing} of the "
                f"{3 * spec.num_experts} expert gate/up/down tensors kt-kernel needs"
            )
        start = time.perf_counter()
        self.physical_to_logical = torch.arange(spec.num_experts, dtype=torch.long)
        self.wrapper = load_bf16_from_tensors(
            kt_kernel,
            spec.layer_idx,
            collected.gate,
            collected.up,
            collected.down,
            self.physical_to_logical,
            **self._wrapper_args(),
        )
        self._collected = None
        PROGRESS.layer_ready(
            spec.layer_name,
            f"loaded {spec.placement.num_cpu_experts} CPU experts (BF16, kt-kernel {kt_kernel.__cpu_variant__} "
            f"kernels, {self.settings.cpuinfer_threads} threads) from the tensors vLLM loaded",
            time.perf_counter() - start,
        )

    @property
    def writes_gpu_layout(self) -> bool:
        return writes_gpu_layout(self.method)

    @classmethod
    def can_move_experts(cls, settings: KTSettings) -> bool:
        # kt-kernel keeps every expert of a layer, writes BF16 ones back (the GPU slots
        # they move into are unquantized), and reads its GPU-expert mask through a pointer
        # at each forward (checked: tests).
        return settings.method == "BF16" and writes_gpu_layout(settings.method)

    def set_gpu_experts(self, gpu_mask: torch.Tensor) -> None:
        self.wrapper.gpu_experts_mask.copy_(gpu_mask)  # in place: kt-kernel holds its address

    def write_gpu_layout(self, expert_ids: list[int], weights: Mapping[str, torch.Tensor]) -> None:
        # kt-kernel writes whole experts (its own widths, not split by tensor parallelism)
        # through raw pointers: any other shape or dtype would overrun the rows.
        layout = self.gpu_layout(len(expert_ids))
        for name, (shape, dtype) in layout.items():
            tensor = weights.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"{self.spec.layer_name}: cannot write experts' {name} {shape} into {got}")
            if tensor.dtype != dtype:
                raise ValueError(
                    f"{self.spec.layer_name}: kt-kernel writes {self.method} {name} as {dtype}, not {tensor.dtype}"
                )

        def pointers(name: str, row: int) -> list[int]:  # one GPU rank; 0 where the method has no scales
            return [weights[name][row].data_ptr()] if name in layout else [0]

        for row, expert_id in enumerate(expert_ids):  # one task per expert on kt-kernel's threads
            self.wrapper.submit_write_weight_scale_to_buffer(
                1,
                expert_id,
                pointers("w13_weight", row),
                pointers("w13_weight_scale_inv", row),
                pointers("w2_weight", row),
                pointers("w2_weight_scale_inv", row),
            )
        self.wrapper.sync_write_weight_scale_to_buffer()

    def gpu_layout(self, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        # BF16 weights, or FP8 ones with float32 scales per 128 x 128 block (checked against
        # the checkpoint's tensors: tests).
        inter, hidden = self.spec.intermediate_size, self.spec.hidden_size
        if self.method == "BF16":
            bf16 = torch.bfloat16
            return {"w13_weight": ((n, 2 * inter, hidden), bf16), "w2_weight": ((n, hidden, inter), bf16)}
        if self.method == "FP8":
            return {
                "w13_weight": ((n, 2 * inter, hidden), torch.float8_e4m3fn),
                "w13_weight_scale_inv": ((n, 2 * fp8_blocks(inter), fp8_blocks(hidden)), torch.float32),
                "w2_weight": ((n, hidden, inter), torch.float8_e4m3fn),
                "w2_weight_scale_inv": ((n, fp8_blocks(hidden), fp8_blocks(inter)), torch.float32),
            }
        raise NotImplementedError(f"kt-kernel writes no {self.method} experts back")

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        # kt-kernel orders its work on this CUDA stream; 0 selects its synchronous
        # path on CPU-only hosts (see compat.py).
        self._stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        self.wrapper.submit_forward(x, topk_ids, topk_weights, self._stream)

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        # kt-kernel returns one of its reusable buffers: the caller consumes it at once.
        return self.wrapper.sync_forward(x, self._stream)


@hookimpl
def kt_cpu_backends() -> dict[str, type[CPUExperts]]:
    return {KTKernelExperts.name: KTKernelExperts}
