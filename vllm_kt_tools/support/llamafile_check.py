"""How well kt-kernel's LLAMAFILE computes experts stored in each GGML type: one small layer
of random weights written in the type (``gguf_export``), its output against float32 experts
that gguf-py dequantizes from the same file (an independent decoder). Run in a child
process per kt-kernel variant (``KT_KERNEL_CPU_VARIANT``): some types abort the process.
The plugin's list of accepted types (``gguf_files.LLAMAFILE_TYPES``) comes from this."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXPERTS, HIDDEN, WIDTH, TOP_K = 8, 256, 256, 2


def relative_errors(workdir: str, types: list[str], hidden: int = HIDDEN) -> dict[str, Any]:
    """Per type, the relative error of the layer's output at 1 and 16 tokens (this process's
    kt-kernel variant, a layer of ``hidden``; runs in the child)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_tools.support.gguf_export import write_random_experts

    kt_kernel = prepare_kt_kernel()
    out: dict[str, Any] = {"variant": str(kt_kernel.__cpu_variant__), "errors": {}}
    for type_name in types:
        path = write_random_experts(Path(workdir) / f"{type_name}.gguf", [0], EXPERTS, hidden, WIDTH, type_name, seed=1)
        weights = {
            t.name.split(".")[2].split("_")[1]: dequantize(t.data, t.tensor_type).reshape(EXPERTS, -1, int(t.shape[0]))
            for t in GGUFReader(path).tensors
        }
        wrapper = kt_kernel.KTMoEWrapper(
            layer_idx=0,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            hidden_size=hidden,
            moe_intermediate_size=WIDTH,
            gpu_experts_mask=torch.zeros(EXPERTS, dtype=torch.bool),
            cpuinfer_threads=1,
            threadpool_count=1,
            weight_path=str(path),
            chunked_prefill_size=16,
            method="LLAMAFILE",
        )
        mapping = torch.arange(EXPERTS)
        wrapper.load_weights(mapping)
        gen = torch.Generator().manual_seed(0)
        errors = []
        for n in (1, 16):
            x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(n)])
            scores = torch.rand(n, TOP_K, generator=gen)
            wrapper.submit_forward(x, ids, scores, 0)
            got = wrapper.sync_forward(x, 0).float().numpy()
            want = np.zeros((n, hidden), dtype=np.float32)
            for t in range(n):
                xt = x[t].float().numpy()
                for k in range(TOP_K):
                    e = int(ids[t, k])
                    gate, up = weights["gate"][e] @ xt, weights["up"][e] @ xt
                    want[t] += float(scores[t, k]) * (weights["down"][e] @ (gate / (1 + np.exp(-gate)) * up))
            errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        out["errors"][type_name] = errors
        del wrapper, mapping
    return out
