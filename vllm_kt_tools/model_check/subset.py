"""The architectures CI checks: one per distinct MoE layer class of vLLM's models."""

from __future__ import annotations

CI_SUBSET: tuple[str, ...] = ("Qwen3MoeForCausalLM",)
