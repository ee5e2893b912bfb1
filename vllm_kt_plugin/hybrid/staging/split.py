"""The split path: in a forward, a part of a layer's CPU experts is staged on the GPU while
the CPU computes the rest.

Per forward, after routing: count the tokens each CPU expert got (the forward's one host
sync), let the cost model (``costs``) or KT_STAGING_SPLIT's share pick the staged experts,
most-picked first, then submit the rest to the CPU, copy the staged ones, run the GPU
experts and the staged ones, prefetch the next layer's predicted part, sync and add.
docs/split.md, "How a forward runs", says why in this order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, SplitNeighbour, StageMarks
from vllm_kt_plugin.hybrid.staging.costs import (
    SplitCosts,
    SplitPlan,
    balanced_count,
    path_thresholds,
    plan,
    share_plan,
)
from vllm_kt_plugin.hybrid.staging.layer import SPLIT_RAN, WHOLE_LAYER_RAN, LayerStaging
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, SPLIT_PATH, WHOLE_LAYER_PATH
from vllm_kt_plugin.hybrid.staging.probe import probe
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once

NEVER = 1 << 62  # a token count no forward reaches


def _span(start: int, end: int, limit: int) -> str:
    """Forwards from ``start`` to below ``end`` tokens, in words, for the log."""
    if start > limit or start >= end:
        return "none"
    return f">= {start} tokens" if end > limit else f"{start}-{end - 1} tokens"


class SplitPath(ForwardPath):
    """One layer's split path. ``share`` (KT_STAGING_SPLIT=<share>): stage that share of
    the picked CPU experts; None: the cost model, probed on the first such forward."""

    name = SPLIT_PATH

    def __init__(self, staging: LayerStaging, cpu: CPUExperts) -> None:
        parts = staging.parts
        self.staging = staging
        self.cpu = cpu
        self.min_tokens = staging.plan.min_tokens
        self.share = staging.plan.share
        self.layer_idx = parts.layer_idx
        self.layer_name = parts.layer_name
        self.hidden_size = parts.moe.hidden_dim
        self.defers = parts.context.settings.max_deferred_experts_per_token > 0
        self.costs: SplitCosts | None = None
        self.plan_min_tokens = 0  # with the cost model: smaller forwards are not read back
        self.whole_min_tokens = NEVER  # with the cost model: larger ones stage the whole layer
        self.cpu_expert_ids = torch.tensor(parts.placement.cpu_expert_ids(), dtype=torch.long)
        self._cpu_ids_dev: torch.Tensor | None = None
        self.last_counts: list[int] | None = None
        # For tests, the bench and the log: forwards planned, experts staged / picked.
        self.forwards = 0
        self.staged_experts = 0
        self.picked_experts = 0
        self.splits = 0  # forwards with 0 < staged < picked
        self.whole_forwards = 0  # forwards that staged the whole layer, no routing read-back

    @property
    def host(self) -> HostExperts | None:
        return self.staging.host

    @property
    def buffers(self) -> StagingBuffers | None:
        return self.staging.buffers

    @property
    def by_expert(self) -> bool:
        """Whole experts by row (vLLM's Triton and CPU layouts): any part can be staged;
        otherwise all or nothing."""
        return self.host is not None and self.host.rows_are_experts

    def takes(self, forward: Forward) -> bool:
        return self.staging.takes(forward, self.min_tokens)

    # --- weights -------------------------------------------------------------------------

    def create_weights(self, layer: RoutedExperts, create_args: dict[str, Any]) -> None:
        self.staging.create_weights(layer, create_args)

    def load_cpu_expert(
        self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, cpu_slot: int
    ) -> None:
        self.staging.load_cpu_expert(param_name, weight, weight_name, shard_id, cpu_slot)

    def after_loading(self, layer: RoutedExperts) -> None:
        self.staging.after_loading(self.describe())
        self.staging.parts.context.process.add_split_path(self.layer_idx, self)

    # --- planning ------------------------------------------------------------------------

    def plan(self, counts: list[int], resident: set[int], prefetched: int | None = None) -> SplitPlan:
        if self.share is not None:
            chosen = share_plan(counts, self.share, resident)
        else:
            assert self.costs is not None, "probed on the first forward"
            chosen = plan(self.costs, counts, resident, prefetched)
        if not self.by_expert and 0 < len(chosen.staged) < chosen.picked:
            every = tuple(s for s, c in enumerate(counts) if c > 0)
            whole = SplitPlan(every, chosen.picked, len(every), chosen.predicted_s, chosen.cpu_only_s)
            chosen = whole if len(chosen.staged) * 2 >= chosen.picked else SplitPlan((), chosen.picked, 0, 0.0, 0.0)
        return chosen

    def _probed_costs(self, dtype: torch.dtype) -> SplitCosts:
        """One probe per process (the process state keeps it), scaled to this layer."""
        process = self.staging.parts.context.process
        if process.split_probe is None:
            process.split_probe = probe(self, dtype)
        assert self.host is not None
        return process.split_probe.for_host(self.host)

    def predict(self, count: int) -> list[int]:
        """The ``count`` CPU-expert rows this layer picked most in its last forward here."""
        if self.last_counts is None or count <= 0:
            return []
        order = sorted(range(len(self.last_counts)), key=lambda s: (-self.last_counts[s], s))
        return sorted(s for s in order[:count] if self.last_counts[s] > 0)

    def describe(self) -> str:
        """How the path shares a forward's CPU experts out, for the start-up log."""
        if self.share is not None:
            return f", {self.share:.0%} of each forward's picked CPU experts staged on the GPU (KT_STAGING_SPLIT)"
        return ", split between the CPU and the GPU by the cost model (probed on the first such forward)"

    def _next(self) -> SplitNeighbour | None:
        path = self.staging.parts.context.process.split_path_after(self.layer_idx)
        return path if path is not self else None

    # --- forward -------------------------------------------------------------------------

    def counts(self, topk_ids: torch.Tensor) -> list[int]:
        """Tokens routed to each CPU expert (by slot): the forward's one host sync. Ids of
        -1 (padding) are not counted."""
        assert self.host is not None
        if self._cpu_ids_dev is None or self._cpu_ids_dev.device != topk_ids.device:
            self._cpu_ids_dev = self.cpu_expert_ids.to(topk_ids.device)
        num_experts = self.host.cpu_slot_of.numel()
        every = torch.bincount(topk_ids.flatten().long() + 1, minlength=num_experts + 1)[1:]
        return every[self._cpu_ids_dev].tolist()

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        """The layer's routed-expert output (the module docstring's order)."""
        host, buffers = self.host, self.buffers
        assert host is not None and buffers is not None
        x, topk_weights, topk_ids = forward.x, forward.topk_weights, forward.topk_ids
        if self.share is None and self.costs is None:
            self._choose_paths(x.dtype)
        tokens = x.shape[0]
        whole = tokens >= self.whole_min_tokens  # every CPU expert staged, no routing read-back
        counts: list[int] = []
        chosen = None
        if whole:
            self.whole_forwards += 1
            self._log_whole(tokens)
        elif tokens >= self.plan_min_tokens:
            counts = self.counts(topk_ids)
            chosen = self.plan(counts, buffers.resident(host), buffers.take_prefetched(host))
            self._count(chosen, tokens)
        if whole:
            staged, picked = list(range(host.num_experts)), host.num_experts
        else:
            staged = sorted(chosen.staged) if chosen is not None else []
            picked = chosen.picked if chosen is not None else 0
        marks.planned(len(staged), picked, WHOLE_LAYER_PATH if whole else SPLIT_PATH if staged else CPU_PATH)
        # With deferral (KT_MAX_DEFERRED_EXPERTS_PER_TOKEN) the previous layer's deferred
        # experts are added by this layer's sync: the CPU backend runs even with nothing left.
        on_cpu = (not whole and (chosen is None or chosen.picked > len(staged))) or self.defers

        x_cpu = x[..., : self.hidden_size] if x.shape[-1] != self.hidden_size else x
        slot_of = None
        index = None
        if whole:  # the device's own mask: no copy from the host, which would wait for the device
            cpu_ids = topk_ids.masked_fill(host.cpu_slot_of[topk_ids.long()] >= 0, -1) if on_cpu else topk_ids
        elif staged:
            mask = torch.zeros(host.cpu_slot_of.numel(), dtype=torch.bool)
            mask[self.cpu_expert_ids[staged]] = True
            mask = mask.to(topk_ids.device)
            slot_of = torch.where(mask, host.cpu_slot_of, -1)
            cpu_ids = topk_ids.masked_fill(mask[topk_ids.long()], -1)  # kt-kernel skips -1
        else:
            cpu_ids = topk_ids
        # With a host copy the CPU's part is submitted first: issuing a copy per staged expert
        # takes the host a while, and the copy stream is mostly busy with this layer's
        # prefetch anyway. A layer kt-kernel writes out is written on the threads the submit
        # would occupy: there the write goes first.
        copies_first = bool(staged) and not host.copies
        if copies_first:
            index = buffers.start(host, self._rows(staged))
        if on_cpu:
            self.cpu.submit(x_cpu, cpu_ids, topk_weights)
            marks.submitted()
        if staged and not copies_first:
            index = buffers.start(host, self._rows(staged))
        out = self.staging.gpu_experts(forward)
        if index is not None:
            views = buffers.wait(index, host)
            staged_out = host.apply(views, x, topk_weights, topk_ids, slot_of)
            buffers.release(index)
            out = staged_out if out is None else out + staged_out
        marks.gpu_done()
        if whole:
            self._prefetch_next(host.num_experts, index)
        elif chosen is not None:
            size = len(chosen.staged) if self.share is not None else balanced_count(self._costs(), counts)
            self._prefetch_next(size, index)
            self.last_counts = counts
        if on_cpu:
            cpu_out = self.cpu.sync(x_cpu).to(x.dtype)
            if cpu_out.shape[-1] != x.shape[-1]:
                cpu_out = F.pad(cpu_out, (0, x.shape[-1] - cpu_out.shape[-1]))
            out = cpu_out.clone() if out is None else out + cpu_out
        marks.synced()
        return out if out is not None else torch.zeros_like(x)

    def _choose_paths(self, dtype: torch.dtype) -> None:
        """On the first forward that takes the path: probe the costs, and from them the
        sizes from which forwards take the split and the whole-layer stream (logged)."""
        assert self.host is not None
        self.costs = self._probed_costs(dtype)
        spec = self.cpu.spec
        self.plan_min_tokens, whole_from = path_thresholds(
            self.costs, self.host.num_experts, spec.num_experts, spec.top_k, spec.chunked_prefill_size
        )
        # A layer kt-kernel writes out is written on the threads of the CPU's part; a whole
        # layer of it staged on demand is the split's all-staged case, planned per forward.
        self.whole_min_tokens = whole_from if self.host.copies else NEVER
        if self.staging.parts.context.process.first_split_path() is not self:
            return
        logger.info(
            "kt-hybrid: by the probed costs, forwards of %s take the CPU path, %s the split, %s the whole-layer "
            "stream (%s; the split's predicted time x%.2f, its measured excess for this staged format)",
            f"< {self.plan_min_tokens} tokens",
            _span(self.plan_min_tokens, self.whole_min_tokens, spec.chunked_prefill_size),
            _span(self.whole_min_tokens, NEVER, spec.chunked_prefill_size),
            self.layer_name,
            self.costs.split_over_model,
        )

    def _costs(self) -> SplitCosts:
        assert self.costs is not None, "probed on the first forward"
        return self.costs

    def _log_whole(self, tokens: int) -> None:
        if self.whole_forwards == 1 and self.staging.parts.context.process.first_split_path() is self:
            logger.info(
                "%s: %s staged all %d of its CPU experts in a forward of %d tokens, the next layer's prefetched",
                WHOLE_LAYER_RAN,
                self.layer_name,
                self.host.num_experts if self.host is not None else 0,
                tokens,
            )

    def _rows(self, staged: list[int]) -> list[int] | None:
        """The staged rows to copy (None: the whole layer, one copy per tensor)."""
        assert self.host is not None
        return staged if self.by_expert and len(staged) < self.host.num_experts else None

    def _prefetch_next(self, size: int, index: int | None) -> None:
        """The next layer's predicted part (``size`` experts; all: the whole layer) into the
        other buffer, while this one computes."""
        following = self._next()
        if following is None or following.host is None or not following.host.copies:
            # A layer without a host copy is written by kt-kernel's threads, which are busy
            # with this layer's CPU experts: prefetching it would hold this thread until
            # they are done. Its part is written on demand.
            return
        if size >= following.host.num_experts:
            rows: list[int] | None = None
        else:
            rows = following.predict(size) if following.by_expert else (None if size else [])
        if rows == []:  # nothing predicted (None: the whole layer)
            return
        assert self.buffers is not None
        busy = index if index is not None else self.buffers.last
        self.buffers.prefetch(following.host, busy=busy, rows=rows)

    def _count(self, chosen: SplitPlan, tokens: int) -> None:
        self.forwards += 1
        self.staged_experts += len(chosen.staged)
        self.picked_experts += chosen.picked
        if chosen.is_split:
            self.splits += 1
        if self.forwards == 1 and self.staging.parts.context.process.first_split_path() is self:
            logger.info(
                "%s: %s staged %d of the %d CPU experts a forward of %d tokens picked (%d copied now, the rest on "
                "the CPU)%s",
                SPLIT_RAN,
                self.layer_name,
                len(chosen.staged),
                chosen.picked,
                tokens,
                chosen.copied,
                "" if self.share is None else f"; KT_STAGING_SPLIT={self.share}",
            )
