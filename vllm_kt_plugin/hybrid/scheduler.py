"""``KTHybridScheduler``: vLLM's own scheduler, holding new prompts back for a few steps where
prompts sent together would otherwise pay one whole-layer copy each (``admission`` decides).

Turned on by ``vllm serve ... --scheduler-cls vllm_kt_plugin.hybrid.scheduler.KTHybridScheduler``
(KT_STAGING_GATHER_MS: the wait). vLLM's engine core loads it by name and builds it with the
engine's config; what it builds is vLLM's ``Scheduler`` or ``AsyncScheduler`` with the gate
(``vllm_compat.holding_scheduler_class``). The whole layer's size comes from the layers where
they live in the engine core (one GPU), else from the settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.admission import AdmissionGate, Gathered, LayersSeen, WaitingQueues, whole_layer_from
from vllm_kt_plugin.hybrid.moe_method import cuda_graph_batch_sizes
from vllm_kt_plugin.hybrid.process_state import HybridProcessState, process_state
from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.hybrid.vllm_compat import holding_scheduler_class
from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER, LOGGER_NAME, WHOLE_LAYER_AUTO_MIN_TOKENS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for warning_once

GATHERED = "kt-hybrid: scheduler gathered"  # the log line's start, for tests


def layers_seen(state: HybridProcessState) -> LayersSeen | None:
    """What this process's layers say about whole-layer forwards; None where it holds none
    (the engine core of tensor-parallel ranks or of vLLM's CPU build: the layers live in
    worker processes)."""
    if not state.layers:
        return None
    splits = [path for _, path in state.split_paths]
    return LayersSeen(
        stage=bool(state.host_experts),
        split=bool(splits),
        probed=state.split_probe is not None,
        split_whole_from=max((path.whole_min_tokens for path in splits), default=0),
    )


def gate_for(vllm_config: VllmConfig) -> Callable[[WaitingQueues], bool] | None:
    """The gate of a scheduler of this engine (None: vLLM's own scheduling), said once."""
    quant = vllm_config.quant_config
    if not isinstance(quant, KTHybridConfig):
        logger.warning("kt-hybrid: %s without --quantization kt-hybrid: vLLM's own scheduling", GATHERING_SCHEDULER)
        return None
    settings = quant.settings
    if not settings.staging_gather_ms:
        logger.info("kt-hybrid: scheduler: prompts are not held (KT_STAGING_GATHER_MS=0): vLLM's own scheduling")
        return None
    scheduler = vllm_config.scheduler_config
    graphs = cuda_graph_batch_sizes(vllm_config)

    def whole_from() -> int | None:
        seen = layers_seen(process_state())
        return whole_layer_from(
            settings.staging_min_tokens,
            settings.staging_split,
            WHOLE_LAYER_AUTO_MIN_TOKENS,
            graphs[-1] if graphs else 0,
            seen,
        )

    window_ms = settings.staging_gather_ms
    gate = AdmissionGate(
        window_ms / 1e3,
        scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens,
        scheduler.max_num_active_seqs or scheduler.max_num_seqs,
        whole_from,
    )
    logger.info(
        "kt-hybrid: scheduler: while no request runs, waiting prompts that stream the whole layer are held up to %g "
        "ms after the oldest arrived, for more to join their forward (KT_STAGING_GATHER_MS; the whole layer "
        "streams from %s tokens, as known now)",
        window_ms,
        whole_from() or "no",
    )

    def holds(queues: WaitingQueues) -> bool:
        held = gate.holds(queues)
        if gate.released is not None:
            _log(gate.released, gate.holds_count)
        return held

    return holds


def _log(gathered: Gathered, holds: int) -> None:
    """The 1st, 10th, 100th, ... hold at INFO (one per burst that finds the engine idle), the
    others at DEBUG."""
    (logger.info if math.log10(holds).is_integer() else logger.debug)(
        "%s %d prompts (%d tokens) into one step after holding them %.1f ms (the whole layer streams from %d "
        "tokens; %d holds so far)",
        GATHERED,
        gathered.prompts,
        gathered.tokens,
        gathered.held_s * 1e3,
        gathered.whole_layer_from,
        holds,
    )


class KTHybridScheduler:
    """The class to name in ``--scheduler-cls``: building it builds vLLM's scheduler for the
    engine's mode (synchronous or async scheduling) with kt-hybrid's gate."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        scheduler = holding_scheduler_class(bool(vllm_config.scheduler_config.async_scheduling))(*args, **kwargs)
        scheduler.kt_gate = gate_for(vllm_config)
        return scheduler
