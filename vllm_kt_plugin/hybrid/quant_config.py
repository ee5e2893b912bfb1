"""The ``kt-hybrid`` quantization config: the checkpoint's own method for everything,
except that each MoE layer's routed experts are split between it and a CPU backend."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.hybrid import serve_checks
from vllm_kt_plugin.hybrid.vllm_compat import parallel_place, pipeline_stage_layers, resolve_native_method_name
from vllm_kt_plugin.planning.layer_plan import LayerPlan
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import environment_drift, load_settings
from vllm_kt_plugin.settings.variables import ALONE, HostShare, KTSettings, host_share

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.models.utils import WeightsMapper

    from vllm_kt_plugin.hybrid.contracts import LayerContext

logger = logging.getLogger(LOGGER_NAME)

QUANT_NAME = "kt-hybrid"


def current_host_share() -> HostShare:
    """This process's place among its host's kt-kernel processes, from vLLM's parallel
    groups (in a worker); one process where they do not exist yet (the front end)."""
    place = parallel_place()
    if place is None:
        return ALONE
    return host_share(place.pipeline_stages, place.tensor_parallel_size, place.nodes, place.pipeline_rank)


@contextlib.contextmanager
def _logged_config_errors() -> Iterator[None]:
    """vLLM reports config errors inside a long pydantic traceback; log ours as one
    plain line too, so the user sees the variable and the fix at once."""
    try:
        yield
    except KTConfigError as e:
        logger.error("kt-hybrid: %s", e)
        raise


class KTHybridConfig(QuantizationConfig):
    """Wraps the checkpoint's quantization config (``native``; None if unquantized).

    vLLM's model-executor modules are imported inside the methods that use them: every
    vLLM process imports this module through ``register()`` at start-up, and they load
    only once a model is built."""

    def __init__(
        self,
        native: QuantizationConfig | None = None,
        checkpoint: CheckpointFormat | None = None,
        settings: KTSettings | None = None,
    ) -> None:
        self.native = native  # set first: the base __init__ assigns packed_modules_mapping
        super().__init__()
        self.checkpoint = checkpoint or CheckpointFormat()
        with _logged_config_errors():
            self.settings, self.backend = serve_checks.validated(settings or load_settings(), self.checkpoint)
        self.layer_plan = LayerPlan(self.settings, stage_layers=pipeline_stage_layers)
        logger.info("kt-hybrid: native method %s; %s", self.native_name, self.settings.describe())

    @functools.cached_property
    def process_settings(self) -> KTSettings:
        """The settings with this worker's share of its host's cores and NUMA nodes: vLLM
        builds this config in its front end and hands it to every worker. They are the
        front end's; a worker whose own KT_* differ (a Ray node that sets its own, or a
        Ray executor that did not copy them) is told which apply."""
        drift = environment_drift(self.settings)
        if drift:
            logger.warning(
                "kt-hybrid: this worker's KT_* environment differs from vllm serve's: %s; "
                "the values given to vllm serve apply (set KT_* where vllm serve starts)",
                ", ".join(drift),
            )
        settings = self.settings.for_host(current_host_share())
        if settings is not self.settings:
            logger.info("kt-hybrid: on this host: %s", settings.describe())
        return settings

    @property
    def native_name(self) -> str:
        return self.checkpoint.quant_method or "unquantized"

    # --- what vLLM asks of a quantization config -------------------------------------

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        if self.native is not None:
            return self.native.get_supported_act_dtypes()
        return [torch.bfloat16, torch.float16, torch.float32]

    def get_min_capability(self) -> int:  # type: ignore[override]
        return self.native.get_min_capability() if self.native is not None else 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KTHybridConfig:
        """Called with the checkpoint's ``quantization_config`` when it has one."""
        from vllm.model_executor.layers.quantization import get_quantization_config

        name = resolve_native_method_name(config)
        native = get_quantization_config(name).from_config(config)
        return cls(native=native, checkpoint=CheckpointFormat(name, dict(config)))

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """A quantized checkpoint plus ``--quantization kt-hybrid`` is kt-hybrid around
        the checkpoint's method, not a mismatch."""
        return QUANT_NAME if user_quant == QUANT_NAME else None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        if self.native is not None:
            self.native.maybe_update_config(model_name, hf_config=hf_config, revision=revision)
        if hf_config is not None:
            with _logged_config_errors():
                self.check_model(hf_config, model_name)

    def check_model(self, hf_config: Any, model_name: str) -> None:
        """Model-dependent checks, in the API-server process, before the engine core starts
        (the same code ``vllm-kt doctor --model`` runs)."""
        for warning in serve_checks.check_model(self.settings, self.backend, hf_config, model_name):
            logger.warning("kt-hybrid: %s", warning)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            from vllm_kt_plugin.hybrid.moe_method import KTHybridMoEMethod

            with _logged_config_errors():
                return KTHybridMoEMethod(layer, prefix, self.layer_context())
        return self.native_quant_method(layer, prefix)

    def layer_context(self) -> LayerContext:
        """What a MoE layer of this process is given (not this whole config)."""
        from vllm_kt_plugin.hybrid.contracts import LayerContext
        from vllm_kt_plugin.hybrid.process_state import process_state

        return LayerContext(
            settings=self.process_settings,
            plan=self.layer_plan,
            backend=self.backend,
            make_native=self.native_moe_method,
            process=process_state(),
            checkpoint=self.checkpoint,
        )

    def native_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """What vLLM would use for ``layer`` without kt-hybrid."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import resolve_quant_method

        if self.native is not None:
            return resolve_quant_method(self.native, layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def native_moe_method(self, layer: RoutedExperts, prefix: str) -> FusedMoEMethodBase:
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        method = self.native_quant_method(layer, prefix)
        if method is None:
            return UnquantizedFusedMoEMethod(layer.moe_config)
        assert isinstance(method, FusedMoEMethodBase), method
        return method

    # --- checkpoint-format helpers belong to the native method -------------------------

    def get_cache_scale_mapper(self) -> WeightsMapper:  # type: ignore[override]
        if self.native is not None:
            return self.native.get_cache_scale_mapper()
        return super().get_cache_scale_mapper()

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:  # type: ignore[override]
        if self.native is not None:
            return self.native.get_checkpoint_weight_mapper()
        return super().get_checkpoint_weight_mapper()

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        if self.native is not None:
            self.native.apply_vllm_mapper(hf_to_vllm_mapper)

    @property  # type: ignore[override]
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self._packed_modules_mapping

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, mapping: dict[str, list[str]]) -> None:
        self._packed_modules_mapping = mapping
        if self.native is not None:
            self.native.packed_modules_mapping = mapping

    def __getattr__(self, name: str) -> Any:
        """Model code sometimes reads attributes of its checkpoint's config (e.g.
        ``weight_block_size``); answer from the native config."""
        native = self.__dict__.get("native")
        if native is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(native, name)
