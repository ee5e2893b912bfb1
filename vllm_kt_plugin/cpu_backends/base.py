"""The interface every CPU-expert backend implements (one instance per MoE layer)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_plugin.settings.variables import KTSettings

# The shards of one expert, as vLLM's expert weight loaders name them: gate, up, down.
EXPERT_SHARDS = ("w1", "w3", "w2")

# vLLM's dummy-weight range (model_loader.weight_utils.initialize_dummy_weights).
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3


def fill_dummy_experts(experts: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Random weights in vLLM's dummy range for an [experts, ...] tensor (load_format=dummy
    loads no checkpoint): one random expert, repeated with alternating sign. Drawing every
    expert of a large model (58 GiB for Qwen3-30B-A3B) takes minutes, at every start; kernel
    speed does not depend on the values."""
    base = torch.rand(experts.shape[1:], generator=generator) * (DUMMY_HIGH - DUMMY_LOW) + DUMMY_LOW
    experts[0::2].copy_(base)
    experts[1::2].copy_(-base)


@dataclass(frozen=True)
class CheckpointFormat:
    """How the checkpoint stores its weights: vLLM's name of its quantization method
    (None when unquantized) and the checkpoint's ``quantization_config``."""

    quant_method: str | None = None
    quant_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weight_bits(self) -> int | None:
        bits = self.quant_config.get("bits")
        if bits is None:  # compressed-tensors keeps it per config group
            for group in (self.quant_config.get("config_groups") or {}).values():
                bits = (group.get("weights") or {}).get("num_bits")
                if bits is not None:
                    break
        return int(bits) if bits is not None else None


OK, WARN, ERROR = "OK", "WARN", "ERROR"


@dataclass(frozen=True)
class Diagnostic:
    """One line of ``vllm-kt doctor``: a check's name, OK / WARN / ERROR, and why."""

    check: str
    level: str
    reason: str


@dataclass(frozen=True)
class ExpertMath:
    """What each expert of a layer computes, as vLLM's layer declares it: ``activation``
    (vLLM's MoEActivation value: "silu" is SiLU(gate) * up; a "_no_mul" suffix means no
    gate), biases on both projections, SwiGLU's clamp, scale and offset (gpt-oss, DeepSeek-V4,
    MiniMax-M3), and router weights applied to the expert's input instead of its output (Llama 4)."""

    activation: str = "silu"
    has_bias: bool = False
    clamp: float | None = None  # SwiGLU's clamp of gate and up
    alpha: float | None = None  # SwiGLU's scale inside the sigmoid
    beta: float | None = None  # SwiGLU's offset added to up (MiniMax-M3's swigluoai_uninterleave)
    router_weight_on_input: bool = False

    def differences(self) -> list[str]:
        """How these experts differ from plain SiLU-gated ones without biases (which every
        backend computes), in words."""
        out = []
        if self.activation != "silu":
            out.append(f"{self.activation} activation")
        if self.has_bias:
            out.append("biases")
        if self.clamp is not None or self.alpha is not None or self.beta is not None:
            out.append(f"a clamped/scaled SwiGLU (limit {self.clamp}, alpha {self.alpha}, beta {self.beta})")
        if self.router_weight_on_input:
            out.append("router weights applied to the input")
        return out


@dataclass(frozen=True)
class LayerSpec:
    """What a backend needs to build the CPU experts of one MoE layer."""

    layer_name: str  # vLLM module prefix, e.g. "model.layers.3.mlp.experts"
    layer_idx: int  # decoder layer index, as in checkpoint tensor names
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert, not split by tensor parallelism
    placement: ExpertPlacement
    chunked_prefill_size: int
    model: str  # model name or directory, as given to vLLM
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    # Batch sizes vLLM captures CUDA graphs for; empty without CUDA graphs.
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    math: ExpertMath = ExpertMath()


class CPUExperts(ABC):
    """Computes the CPU experts' weighted sum for one layer.

    Lifecycle: ``validate`` (class, at config time) -> ``__init__`` (model construction)
    -> ``load_checkpoint_tensor`` for every checkpoint tensor of a CPU expert ->
    ``finalize_weights`` (after loading) -> per forward ``submit`` then ``sync``.
    ``submit`` must not block on the computation where the backend can overlap it with
    the GPU experts; ``sync`` returns the result on ``x``'s device and dtype.
    """

    name: ClassVar[str]
    # Whether submit/sync may be captured in a CUDA graph (no host syncs, fixed buffers).
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether the backend takes its experts as vLLM's layer loaded them (``load_loaded_experts``:
    # vLLM's own loader, so any checkpoint layout, biases included) rather than as checkpoint
    # tensors (``load_checkpoint_tensor``).
    takes_loaded_experts: ClassVar[bool] = False

    @classmethod
    def cannot_compute(cls, math: ExpertMath) -> str | None:
        """Why this backend cannot compute experts that do ``math``, or None where it can.
        Default: SiLU-gated experts without biases only."""
        differences = math.differences()
        return f"{cls.name} computes SiLU-gated experts only, not {', '.join(differences)}" if differences else None

    @classmethod
    @abstractmethod
    def default_method(cls, checkpoint: CheckpointFormat) -> str:
        """KT_METHOD to use when the user sets none."""

    @classmethod
    def resolve_method(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> KTSettings:
        """The settings with KT_METHOD decided: as set, else ``default_method``."""
        return settings.with_method(settings.method or cls.default_method(checkpoint))

    @classmethod
    @abstractmethod
    def validate(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> None:
        """Config-time checks; raise KTConfigError naming the variable on a mistake."""

    @classmethod
    def check_model(cls, settings: KTSettings, model: str, hf_config: Mapping[str, Any]) -> None:
        """Checks against the model (``model`` as given to vLLM: a directory or a hub id, and
        its config.json), in the front end before any weight loads (default: none)."""
        return

    @classmethod
    def diagnose(
        cls, settings: KTSettings, cpu_flags: frozenset[str], weight_path: str | None, model_dir: str | None
    ) -> list[Diagnostic]:
        """What ``vllm-kt doctor`` reports about this backend on a machine with ``cpu_flags``:
        e.g. how fast it runs ``settings.method`` (None: not chosen yet) there, and whether
        the weights it would read (``weight_path``, else the model directory) look right.
        Checks that would refuse serve belong in ``validate``/``check_model``. Default: none."""
        return []

    def __init__(self, spec: LayerSpec, settings: KTSettings) -> None:
        self.spec = spec
        self.settings = settings

    def describe(self) -> str:
        """The CPU side as kt-hybrid's start-up log names it: backend, method, threads."""
        return f"{self.name} {self.settings.method} with {self.settings.cpuinfer_threads} threads"

    @property
    def wants_all_experts(self) -> bool:
        """Whether ``load_checkpoint_tensor`` should also receive the GPU experts' tensors
        (e.g. to quantize and cache the whole layer, which then serves any placement)."""
        return False

    def load_checkpoint_tensor(self, expert_id: int, shard_id: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor of a CPU expert (shard w1 = gate, w3 = up, w2 = down), or of
        any expert when ``wants_all_experts``. Backends that read their own weight files
        ignore it (the default)."""
        return

    def load_loaded_experts(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The CPU experts as vLLM loaded them (``takes_loaded_experts``), before its
        post-processing, by vLLM's parameter name, one row per CPU expert in placement
        order: ``w13_weight`` [n, 2I, H] (gate then up, or interleaved where the activation
        says so) or [n, I, H] (no gate), ``w2_weight`` [n, H, I], ``w13_bias``, ``w2_bias``."""
        raise NotImplementedError(f"{type(self).__name__} reads checkpoint tensors")

    @property
    def writes_gpu_layout(self) -> bool:
        """Whether ``write_gpu_layout`` can hand out this backend's experts (staging
        then keeps no host copy of its own)."""
        return False

    def gpu_layout(self, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What ``write_gpu_layout`` writes for ``n`` experts: each tensor's shape and dtype,
        by vLLM's parameter name."""
        raise NotImplementedError(f"{type(self).__name__} cannot write its experts in the GPU layout")

    def write_gpu_layout(self, expert_ids: list[int], weights: Mapping[str, torch.Tensor]) -> None:
        """Write experts ``expert_ids`` (global ids), in that order, into the rows of host
        tensors named as vLLM's MoE layers name them: ``w13_weight`` [n, 2I, H] (gate, then
        up), ``w2_weight`` [n, H, I], and the scales of a quantized layout
        (``w13_weight_scale_inv``, ``w2_weight_scale_inv``); blocks until done."""
        raise NotImplementedError(f"{type(self).__name__} cannot write its experts in the GPU layout")

    @classmethod
    def can_move_experts(cls, settings: KTSettings) -> bool:
        """Whether experts can move between the GPU and this backend after loading
        (KT_DYNAMIC_GPU_EXPERTS): it must write any expert in the GPU layout
        (``write_gpu_layout``) and take a new GPU-expert mask (``set_gpu_experts``)."""
        return False

    def set_gpu_experts(self, gpu_mask: torch.Tensor) -> None:
        """From the next forward on, skip the experts ``gpu_mask`` marks (the GPU's)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move experts")

    @abstractmethod
    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        """All checkpoint tensors are in; make the experts ready to run. A non-zero
        ``max_deferred_experts_per_token`` allows adding that many CPU experts per token
        to the next layer's output (only offered when the next layer is a kt-hybrid one)."""

    @abstractmethod
    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Start computing sum_k w[t,k] * expert_{ids[t,k]}(x[t]) over CPU experts."""

    @abstractmethod
    def sync(self, x: torch.Tensor) -> torch.Tensor:
        """Wait for the submitted work; return it as a [tokens, hidden] tensor like ``x``."""
