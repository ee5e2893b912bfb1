"""The log of a process's dynamic expert swaps (KT_DYNAMIC_GPU_EXPERTS, ``dynamic_experts``):
one per process, shared by its layers, so the running mean covers every layer's swaps."""

from __future__ import annotations

import logging
import math

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


class SwapLog:
    """A process's layer swaps, one line each: at INFO the 1st, 10th, 100th, ..., the rest at
    DEBUG, with the running mean time per layer swap (what moving experts costs, without an
    INFO line per layer)."""

    def __init__(self) -> None:
        self.swaps = self.experts = 0
        self.seconds = 0.0

    def add(self, layer_name: str, pairs: list[tuple[int, int]], seconds: float) -> None:
        self.swaps += 1
        self.experts += len(pairs)
        self.seconds += seconds
        log = logger.info if math.log10(self.swaps).is_integer() else logger.debug
        log(
            "kt-hybrid: dynamic GPU experts: %s: experts %s moved to the GPU, %s to the CPU in %.1f ms; %d layer "
            "swaps so far moved %d experts, %.1f ms per layer swap on average",
            layer_name,
            [p[0] for p in pairs],
            [p[1] for p in pairs],
            seconds * 1e3,
            self.swaps,
            self.experts,
            self.seconds / self.swaps * 1e3,
        )
