"""The routing recorder inside a ``vllm serve`` the bench starts (``--server-engine``).

``routing.server_recording()`` names ``RoutingExtension`` as vLLM's ``--worker-extension-cls``.
vLLM's worker imports this module when it starts, before it builds the model, and that is when
the recorder must attach to the MoE routers. So importing this module installs the recorder: it
has no other use. ``/collective_rpc`` takes only a method's name, so the extension gives the
worker one that returns the recorder's sums."""

from __future__ import annotations

from typing import Any

from vllm_kt_tools.bench import routing

routing.install()


class RoutingExtension:
    """Mixed into vLLM's worker class; ``routing.SERVER_RPC`` names its method."""

    def kt_bench_routing(self) -> dict[str, Any]:
        return routing.collect()
