"""Page-locked host memory of the host copy (``hybrid/staging/host_memory.py``)."""

from __future__ import annotations

import pytest
import torch


def test_pinned_copies_own_whole_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host copy: one registration per layer, of whole pages inside the
    block's own allocation (CUDA refuses a page registered twice), holding equal copies."""
    import mmap

    from vllm_kt_plugin.hybrid.staging import host_memory

    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(
        host_memory, "pin_in_place", lambda t: registered.append((t.data_ptr(), t.numel() * t.element_size()))
    )
    tensors = {"w13_weight": torch.randn(3, 10, 7).bfloat16(), "w2_weight": torch.randn(3, 7, 5)}
    copies = host_memory.pinned_copies(tensors)
    [(start, nbytes)] = registered
    assert start % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0
    for name, tensor in tensors.items():
        assert torch.equal(copies[name], tensor) and copies[name].dtype == tensor.dtype
        assert start <= copies[name].data_ptr() < start + nbytes
    storage = copies["w2_weight"].untyped_storage()
    assert storage.data_ptr() <= start and start + nbytes <= storage.data_ptr() + storage.nbytes()
