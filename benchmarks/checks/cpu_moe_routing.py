"""vLLM's CPU MoE kernel (``cpu_fused_moe``) against a float32 torch reference, for the
routings kt-hybrid hands it: every pick on a GPU slot, and picks of CPU experts sent to
slot 0 with weight 0 (``planning.placement.route_to_gpu_slots``), which puts one expert
twice in a token's picks. Run where vLLM's CPU build is installed, e.g. on an AMX host:
``python3 benchmarks/checks/cpu_moe_routing.py``; prints one JSON line per case."""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops


def reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].float() @ x[t].float()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, k].float() * (w2[e].float() @ a)
    return out


def run(isa: str, tokens: int, hidden: int, inter: int, experts: int, top_k: int, duplicates: bool) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, dtype=torch.float32)
    if duplicates:  # as kt-hybrid routes: half the picks went to CPU experts -> slot 0, weight 0
        cpu = torch.rand(tokens, top_k) < 0.5
        ids = ids.masked_fill(cpu, 0)
        weights = weights.masked_fill(cpu, 0.0)
    want = reference(x, w13, w2, weights, ids)
    got = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    ops.cpu_fused_moe(
        got,
        x,
        ops.cpu_prepack_moe_weight(w13, isa),
        ops.cpu_prepack_moe_weight(w2, isa),
        None,
        None,
        weights,
        ids,
        "silu",
        isa,
    )
    err = (got.float() - want).abs().max().item() / want.abs().max().item()
    dup_tokens = int(sum(len(set(r.tolist())) < top_k for r in ids))
    return {
        "isa": isa,
        "tokens": tokens,
        "hidden": hidden,
        "inter": inter,
        "experts": experts,
        "top_k": top_k,
        "duplicates": duplicates,
        "tokens_with_a_repeated_expert": dup_tokens,
        "max_rel_error": round(err, 5),
    }


def main() -> None:
    isas = ["vec"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])  # type: ignore[attr-defined]
    for isa in isas:
        for hidden, inter in ((128, 64), (256, 128), (2048, 768)):
            for tokens in (1, 16, 64):
                for duplicates in (False, True):
                    print(json.dumps(run(isa, tokens, hidden, inter, 8, 2, duplicates)), flush=True)


if __name__ == "__main__":
    main()
