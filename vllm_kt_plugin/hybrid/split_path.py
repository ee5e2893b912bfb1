"""The split path: in a mid-size forward, some of a layer's CPU experts are computed on
the GPU (staged, expert by expert) while the CPU computes the rest.

Per forward, after routing: count the tokens each CPU expert got (one small device-to-host
read), let the cost model (``split_cost``) or a fixed share choose the staged experts,
most-picked first, then

    submit the rest to the CPU backend (the staged ones' ids are -1, which kt-kernel
    skips) -> start copying the staged experts' rows on the copy stream (a layer without a
    host copy: written out by kt-kernel first, then submitted) -> native GPU experts ->
    wait for the copies -> staged experts with the shadow method (an expert map sends
    every other expert to -1, which vLLM's Triton kernels drop) -> prefetch the next
    layer's predicted part -> sync the CPU and add the three.

So a layer takes about max(copy(part) + GPU(part), CPU(rest)), and no less than the copy
stream's share of it (``split_cost``).

**Why after routing, plus a predicted prefetch.** The staged set is chosen from this
forward's own counts: which experts are hot changes from batch to batch, and staging a
cold expert saves the CPU nothing. The copy of what is chosen then overlaps the CPU's
work on the rest. On top, while a layer computes, the next layer's *predicted* part
streams into the other staging buffer, as the whole-layer path does today: the experts
that layer picked most in its previous split forward, as many as the model stages with
nothing resident (``balanced_count``, from this forward's counts: the next layer sees the
same tokens). At the next layer, prefetched experts cost no copy and the model takes them
first; a wrong guess costs only copy-stream time.

**Constants: a start-up probe, logged** (``split_probe``), on the first layer that takes
this path; other layers scale its per-expert numbers by their expert bytes.

``SplitPath`` is a ``gpu_prefill_path.GPUPrefillPath`` (the same host copy, buffers and
weight lifecycle) that stages a part of the CPU experts per forward; it takes the place of
the whole-layer stream where ``staging_policy.splits`` says so (``paths.PATH_BUILDERS``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, LayerParts, SplitNeighbour, StageMarks
from vllm_kt_plugin.hybrid.gpu_prefill_path import GPUPrefillPath
from vllm_kt_plugin.hybrid.metrics import CPU_PATH, SPLIT_PATH
from vllm_kt_plugin.hybrid.split_cost import (
    WHOLE,
    SplitCosts,
    SplitPlan,
    balanced_count,
    path_thresholds,
    plan,
    share_plan,
)
from vllm_kt_plugin.hybrid.split_probe import probe
from vllm_kt_plugin.hybrid.staging_policy import gpu_prefill_min_tokens, splits
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.host_experts import HostExperts
    from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once

SPLIT_RAN = "kt-hybrid: split ran"  # the log line's start, for tests
WHOLE_RAN = "kt-hybrid: whole-layer stream ran"
NEVER = 1 << 62  # a token count no forward reaches


def _span(start: int, end: int, limit: int) -> str:
    """Forwards from ``start`` to below ``end`` tokens, in words, for the log."""
    if start > limit or start >= end:
        return "none"
    return f">= {start} tokens" if end > limit else f"{start}-{end - 1} tokens"


class SplitPath(GPUPrefillPath):
    """One layer's split path. ``share`` (KT_GPU_PREFILL_SPLIT=<share>): stage that share
    of the picked CPU experts; None: the cost model, probed on the first such forward."""

    name = SPLIT_PATH

    def __init__(self, parts: LayerParts, min_tokens: int, cpu: CPUExperts) -> None:
        super().__init__(parts, min_tokens)
        settings = parts.context.settings
        self.cpu = cpu
        self.share = settings.gpu_prefill_split
        self.layer_idx = parts.layer_idx
        self.layer_name = parts.layer_name
        self.hidden_size = parts.moe.hidden_dim
        self.defers = settings.max_deferred_experts_per_token > 0
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
    def by_expert(self) -> bool:
        """Whole experts by row (vLLM's Triton and CPU layouts): any part can be staged;
        otherwise all or nothing."""
        return self.host is not None and self.host.rows_are_experts

    def after_loading(self, layer: RoutedExperts) -> None:
        super().after_loading(layer)
        self.parts.context.process.add_split_path(self.layer_idx, self)

    def attach(self, host: HostExperts, staging: StagingBuffers) -> None:
        """Use ``host`` and ``staging`` (another path's, loaded: the probe's test)."""
        self.host, self.staging = host, staging

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
        process = self.parts.context.process
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
            return f", {self.share:.0%} of each forward's picked CPU experts staged on the GPU (KT_GPU_PREFILL_SPLIT)"
        return ", split between the CPU and the GPU by the cost model (probed on the first such forward)"

    def _next(self) -> SplitNeighbour | None:
        path = self.parts.context.process.split_path_after(self.layer_idx)
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
        host, staging = self.host, self.staging
        assert host is not None and staging is not None
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
            chosen = self.plan(counts, staging.resident(host), staging.take_prefetched(host))
            self._count(chosen, tokens)
        if whole:
            staged, picked = list(range(host.num_experts)), host.num_experts
        else:
            staged = sorted(chosen.staged) if chosen is not None else []
            picked = chosen.picked if chosen is not None else 0
        marks.planned(len(staged), picked, WHOLE if whole else SPLIT_PATH if staged else CPU_PATH)
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
        # With a host copy, the CPU's part is submitted first, then the copies are issued:
        # issuing a copy per staged expert takes the host a while, and the copy stream is
        # mostly still busy with this layer's prefetch, while the CPU waits for its submit.
        # (The H100 curve of 2026-12-06 issued the copies first, and its split took 1.02-1.22x
        # the model's time with the BF16 copy, 0.94-1.49x with the FP8 one; whether this was
        # why is the next sitting's to tell.) A layer kt-kernel writes out (no host copy) is
        # written on the threads the submit would occupy: there the write goes first.
        copies_first = bool(staged) and not host.copies
        if copies_first:
            index = staging.start(host, self._rows(staged))
        if on_cpu:
            self.cpu.submit(x_cpu, cpu_ids, topk_weights)
            marks.submitted()
        if staged and not copies_first:
            index = staging.start(host, self._rows(staged))
        out = self.gpu_experts(forward)
        if index is not None:
            views = staging.wait(index, host)
            staged_out = host.apply(views, x, topk_weights, topk_ids, slot_of)
            staging.release(index)
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
        if self.parts.context.process.first_split_path() is not self:
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
        if self.whole_forwards == 1 and self.parts.context.process.first_split_path() is self:
            logger.info(
                "%s: %s staged all %d of its CPU experts in a forward of %d tokens, the next layer's prefetched",
                WHOLE_RAN,
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
        assert self.staging is not None
        busy = index if index is not None else self.staging.last
        self.staging.prefetch(following.host, busy=busy, rows=rows)

    def _count(self, chosen: SplitPlan, tokens: int) -> None:
        self.forwards += 1
        self.staged_experts += len(chosen.staged)
        self.picked_experts += chosen.picked
        if chosen.is_split:
            self.splits += 1
        if self.forwards == 1 and self.parts.context.process.first_split_path() is self:
            logger.info(
                "%s: %s staged %d of the %d CPU experts a forward of %d tokens picked (%d copied now, the rest on "
                "the CPU)%s",
                SPLIT_RAN,
                self.layer_name,
                len(chosen.staged),
                chosen.picked,
                tokens,
                chosen.copied,
                "" if self.share is None else f"; KT_GPU_PREFILL_SPLIT={self.share}",
            )


def build(parts: LayerParts) -> SplitPath | None:
    """The layer's split path, or None where the split does not apply to it
    (``staging_policy.splits``) or GPU prefill is off for it."""
    if not splits(parts) or parts.cpu is None:
        return None
    min_tokens = gpu_prefill_min_tokens(parts)
    return SplitPath(parts, min_tokens, parts.cpu) if min_tokens else None
