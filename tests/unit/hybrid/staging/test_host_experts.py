"""The CPU experts as staging keeps them (``hybrid/staging/host_experts.py``)."""

from __future__ import annotations

import torch


def test_a_writer_whose_layout_differs_is_caught_before_use() -> None:
    """kt-kernel writes through raw pointers: the shadow's tensors (e.g. with biases, or
    other block scales) must be exactly what the CPU backend writes."""
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts

    written = {"w13_weight": ((2, 8, 4), torch.bfloat16), "w2_weight": ((2, 4, 4), torch.bfloat16)}
    writer = SimpleNamespace(gpu_layout=lambda n: {k: ((n, *s[1:]), d) for k, (s, d) in written.items()})

    def host(layout: dict) -> SimpleNamespace:
        layout = {k: (torch.Size(s), d) for k, (s, d) in layout.items()}
        return SimpleNamespace(writer=writer, layout=layout, cpu_expert_ids=[3, 5], native=object())

    assert HostExperts.writer_mismatch(host(written)) is None
    biased = {**written, "w13_bias": ((2, 8), torch.bfloat16)}
    assert "w13_bias" in (HostExperts.writer_mismatch(host(biased)) or "")
    assert HostExperts.writer_mismatch(SimpleNamespace(writer=None)) is None
