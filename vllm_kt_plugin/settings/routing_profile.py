"""Expert routing profiles (``KT_EXPERT_PROFILE``): how often each expert of each layer
was picked, so ``KT_EXPERT_PLACEMENT=frequency`` can keep the busiest ones on the GPU.

A profile is JSON, ``{"model": ..., "num_experts": N, "layers": {"<decoder index>":
[N non-negative counts]}}``, gathered by counting ``topk_ids`` per layer over a
representative workload (``vllm-kt profile``). Layers missing from it cannot use frequency
placement (an error names them). The format in full: docs/choosing-settings.md."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kt_plugin.settings.errors import KTConfigError


@dataclass(frozen=True)
class RoutingProfile:
    model: str
    num_experts: int
    layers: Mapping[int, tuple[int, ...]]  # layer index -> picks per expert
    path: str = ""  # the file it was read from, for errors

    def counts(self, layer_idx: int) -> tuple[int, ...]:
        if layer_idx not in self.layers:
            raise KTConfigError(
                "KT_EXPERT_PROFILE",
                self.path,
                f"no counts for MoE layer {layer_idx}; it has layers {sorted(self.layers)}",
                "a profile with every MoE layer of the model",
            )
        return self.layers[layer_idx]

    def check_fits(self, num_experts: int) -> None:
        """A profile of another model (other expert count) cannot place this one."""
        if self.num_experts != num_experts:
            raise KTConfigError(
                "KT_EXPERT_PROFILE",
                self.path,
                f"num_experts={self.num_experts}, but the model has {num_experts} routed experts per layer",
                "a profile of this model",
            )


def _bad(path: str, key: str, value: object, allowed: str) -> KTConfigError:
    return KTConfigError(key, value, allowed=allowed, where=f"KT_EXPERT_PROFILE={path!r}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_routing_profile(data: Any, path: str) -> RoutingProfile:
    """Check the profile's structure; every error names the key and the bad value."""
    if not isinstance(data, dict):
        raise _bad(path, "<top level>", type(data).__name__, 'a JSON object {"model", "num_experts", "layers"}')
    num_experts = data.get("num_experts")
    if not _is_count(num_experts) or num_experts == 0:
        raise _bad(path, "num_experts", num_experts, "a positive integer")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise _bad(path, "layers", layers, 'a non-empty object {"<layer index>": [count per expert]}')
    parsed: dict[int, tuple[int, ...]] = {}
    for key, counts in layers.items():
        if not str(key).isdigit():
            raise _bad(path, "layers key", key, "a decoder layer index such as '3'")
        if not isinstance(counts, list) or len(counts) != num_experts or not all(_is_count(c) for c in counts):
            shown = counts if not isinstance(counts, list) else f"list of {len(counts)}"
            raise _bad(path, f"layers.{key}", shown, f"a list of {num_experts} non-negative integers")
        parsed[int(key)] = tuple(counts)
    return RoutingProfile(str(data.get("model", "")), num_experts, parsed, path)


def load_routing_profile(path: str) -> RoutingProfile:
    file = Path(path)
    if not file.is_file():
        raise KTConfigError("KT_EXPERT_PROFILE", path, "no such file")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = str(e).splitlines()[0]
        raise KTConfigError("KT_EXPERT_PROFILE", path, f"not readable JSON: {reason}") from None
    return parse_routing_profile(data, path)
