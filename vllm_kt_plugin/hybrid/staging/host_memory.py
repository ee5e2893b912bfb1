"""Host memory the experts are copied to the GPU from: page-locked blocks (copies from
them run async under CUDA) and the layouts (name -> shape, dtype) of a layer's expert
tensors, for the host copy (``host_experts``) and the buffers (``buffers``)."""

from __future__ import annotations

import math
import mmap

import torch

from vllm_kt_plugin.settings.catalogue import GIB


def pin_in_place(tensor: torch.Tensor) -> None:
    """Page-lock a tensor's own memory (cudaHostRegister), so copies from it run async.
    Not ``pin_memory()``: PyTorch's caching host allocator rounds every pinned block up to
    a power of two, which would turn a layer's 0.6 + 0.3 GB of experts into 1 + 0.5 GB, on
    every layer. A refusal is fatal: it leaves CUDA's sticky last error set, which the
    next CUDA call would raise far from here."""
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    code = int(getattr(error, "value", error))
    if code != 0:
        raise RuntimeError(
            f"kt-hybrid staging: CUDA could not page-lock {tensor.numel() * tensor.element_size() / GIB:.2f} GiB "
            f"for the CPU experts' host copy (cudaHostRegister error {code}); check `ulimit -l` and the RAM check "
            "of `vllm-kt doctor`, or set KT_STAGING_MIN_TOKENS=0"
        )


def pinned_empty(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Tensors of ``layout`` in one page-locked block of whole pages that no other
    allocation shares (CUDA refuses to register a page twice; small tensors from the heap
    share pages), registered once."""
    nbytes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in layout.items()}
    sizes = {name: -(-n // _PAGE) * _PAGE for name, n in nbytes.items()}
    raw = torch.empty(sum(sizes.values()) + 2 * _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    block = raw[start : start + sum(sizes.values())]
    pin_in_place(block)
    views, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        views[name] = block[offset : offset + nbytes[name]].view(dtype).view(shape)
        offset += sizes[name]
    return views


def pinned_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` in one page-locked block (see ``pinned_empty``)."""
    copies = pinned_empty(layout_of(tensors))
    for name, tensor in tensors.items():
        copies[name].copy_(tensor)
    return copies


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (t.shape, t.dtype) for name, t in tensors.items()}


def layout_nbytes(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


_PAGE = mmap.PAGESIZE
