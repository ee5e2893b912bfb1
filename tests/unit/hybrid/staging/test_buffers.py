"""The staging buffers every layer shares (``hybrid/staging/buffers.py``), with stand-in
layers: prefetching into the other buffer, and layers written by their CPU backend."""

from __future__ import annotations

import torch


def test_staging_prefetches_the_next_layer_into_the_other_buffer() -> None:
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
    from vllm_kt_plugin.hybrid.staging.host_memory import layout_of

    def host(value: float, experts: int) -> SimpleNamespace:
        tensors = {"w13_weight": torch.full((experts, 4, 2), value)}
        return SimpleNamespace(tensors=tensors, layout=layout_of(tensors), copies=True, num_experts=experts)

    first, second, third = host(1.0, 3), host(2.0, 2), host(3.0, 3)
    staging = StagingBuffers(torch.device("cpu"))
    for h in (first, second, third):
        staging.reserve(h)
    assert staging.numel["w13_weight"] == (3 * 4 * 2, torch.float32) and staging.nbytes == 2 * 3 * 4 * 2 * 4
    index, views = staging.acquire(first)
    assert torch.equal(views["w13_weight"], first.tensors["w13_weight"])
    staging.prefetch(second, busy=index)
    assert staging.owner == ([first, second] if index == 0 else [second, first])
    staging.release(index)
    again, views = staging.acquire(second)  # prefetched: no copy, the other buffer
    assert again == 1 - index and views["w13_weight"].shape == (2, 4, 2)
    assert torch.equal(views["w13_weight"], second.tensors["w13_weight"])
    staging.prefetch(third, busy=again)  # replaces the first layer's buffer
    assert staging.owner[index] is third and staging.uses == 2


def test_staging_writes_layers_without_a_host_copy() -> None:
    """A layer whose CPU backend writes its experts (no host copy) is written into a host
    buffer, then copied like a host copy; prefetching it writes it then."""
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers

    written: list[float] = []

    def host(value: float) -> SimpleNamespace:
        layout = {
            "w13_weight": (torch.Size([2, 4, 2]), torch.float32),
            "w2_weight": (torch.Size([2, 2, 2]), torch.float32),
        }

        def write(views: dict, rows: list[int] | None = None) -> None:
            written.append(value)
            for view in views.values():
                view.fill_(value)

        return SimpleNamespace(tensors={}, layout=layout, copies=False, write=write, num_experts=2)

    first, second = host(1.0), host(2.0)
    staging = StagingBuffers(torch.device("cpu"))
    staging.reserve(first)
    index, views = staging.acquire(first)
    assert written == [1.0] and all(bool((v == 1.0).all()) for v in views.values())
    staging.prefetch(second, busy=index)
    assert written == [1.0, 2.0]
    _, views = staging.acquire(second)
    assert written == [1.0, 2.0] and all(bool((v == 2.0).all()) for v in views.values())
