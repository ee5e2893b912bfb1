"""Every vLLM internal kt-hybrid relies on (``hybrid/vllm_compat.py``'s TOUCHES, and the
tooling's in ``vllm_kt_tools/support/vllm_internals.py``) exists on the installed vLLM: an
upgrade that renames one fails here, by name, and not in the middle of a forward. Outside
those two modules both packages read only public attributes of vLLM's objects
(PUBLIC_VLLM_ATTRIBUTES); tests/unit/test_layout.py guards the imports."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kt_testing.schedulers import build_scheduler, request, scheduler_vllm_config

from vllm_kt_plugin.hybrid.vllm_compat import TOUCHES, Touch
from vllm_kt_tools.support import vllm_internals
from vllm_kt_tools.support.moe_layers import build_moe

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "vllm_kt_plugin" / "hybrid" / "vllm_compat.py"
TOOLS_COMPAT = ROOT / "vllm_kt_tools" / "support" / "vllm_internals.py"
EVERY_TOUCH = (*TOUCHES, *vllm_internals.TOUCHES)

BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def owner_of(touch: Touch) -> object:
    module, _, cls = touch.owner.partition(":")
    found = importlib.import_module(module)
    return getattr(found, cls) if cls else found


@pytest.fixture(scope="module")
def instances(vllm_layer_context, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One instance of each class whose instance attributes we touch or whose attributes
    the guard below collects, built as a model builds them (plain vLLM, no kt-hybrid: the
    attributes are vLLM's)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    plain = build_moe(None)
    fp8 = build_moe(Fp8Config.from_config(dict(BLOCK_FP8)), hidden=256, inter=256).routed_experts
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = build_scheduler(Scheduler, scheduler_vllm_config(tmp_path_factory.mktemp("scheduler")))
    return {
        "Scheduler": scheduler,
        "Request": request("a", 8),
        "MoERunner": plain,
        "RoutedExperts": plain.routed_experts,
        "ExpertMapManager": plain.routed_experts.expert_map_manager,
        "FusedMoEConfig": plain.routed_experts.moe_config,
        "FusedMoEParallelConfig": plain.routed_experts.moe_config.moe_parallel_config,
        "VllmConfig": vllm_layer_context,
        "UnquantizedFusedMoEMethod": plain.routed_experts.quant_method,
        "FusedMoEMethodBase": plain.routed_experts.quant_method,
        "Fp8MoEMethod": fp8.quant_method,
    }


# Attributes of vLLM's objects that code outside vllm_compat may read: vLLM's interfaces,
# not its internals. Each group says why.
PUBLIC_VLLM_ATTRIBUTES: dict[str, frozenset[str]] = {
    # The quantization-method interface (QuantizeMethodBase, FusedMoEMethodBase) kt-hybrid
    # implements and forwards to the checkpoint's own method; vLLM's engine calls it.
    "the MoE method interface": frozenset(
        {
            "create_weights",
            "process_weights_after_loading",
            "maybe_roundup_sizes",
            "requires_device_loading",
            "uses_meta_device",
            "supports_pre_processed_weights",
            "is_monolithic",
            "moe",
        }
    ),
    # What vLLM's own MoE methods read of the RoutedExperts layer they are given, and the
    # parameters vLLM's unquantized method creates on it (the names checkpoints map to).
    "the layer a method is given": frozenset(
        {"moe_config", "global_num_experts", "apply_router_weight_on_input", "w13_weight", "w2_weight"}
    ),
    # FusedMoEConfig and its FusedMoEParallelConfig: the layer's shape and parallel layout,
    # the constructor argument of every MoE method.
    "the layer's shape and parallel layout": frozenset(
        {
            "activation",
            "has_bias",
            "hidden_dim",
            "intermediate_size",
            "experts_per_token",
            "num_experts",
            "device",
            "moe_parallel_config",
            "tp_size",
            "tp_rank",
            "dp_size",
            "use_ep",
            "enable_eplb",
            "make",  # FusedMoEQuantConfig.make(): the unquantized quant config's constructor
        }
    ),
    # VllmConfig's parts: the engine's settings, as the user gave them.
    "the engine's settings": frozenset(
        {
            "model_config",
            "parallel_config",
            "cache_config",
            "scheduler_config",
            "load_config",
            "compilation_config",
            "max_num_batched_tokens",  # scheduler_config's (VllmConfig has one too)
            "max_num_scheduled_tokens",  # scheduler_config's (vLLM's Scheduler keeps a copy)
            "vllm_config",  # our own attribute holding the config (vLLM's Scheduler has one too)
        }
    ),
    # Attributes of the package's own objects whose names vLLM's objects also carry
    # (LayerSpec.top_k and layer_name, a Variable's name, pluggy's register, ...).
    "our own names that vLLM also uses": frozenset(
        {
            "name",
            "enabled",
            "register",
            "gate",
            "layer_name",
            "hidden_size",
            "top_k",
            "quant_config",
            "quant_method",
            "load_weights",
            "expert_map",  # HostExperts' own
            "update",  # dict.update
        }
    ),
}
PUBLIC_NAMES = frozenset().union(*PUBLIC_VLLM_ATTRIBUTES.values())
# The tooling's own objects whose attribute names vLLM's scheduler or request also carries:
# the bench's run specs and argparse's max_model_len and max_tokens, an HTTP response's and a
# support-matrix row's status. Listed for vllm_kt_tools only: the runtime reads none of them.
TOOLING_OWN_NAMES = frozenset({"max_model_len", "max_tokens", "status"})
_NAME_ARGUMENT_CALLS = {"getattr", "hasattr", "setattr", "delattr"}


def vllm_attribute_names(instances: dict[str, object]) -> set[str]:
    """The attributes vLLM's objects of these kinds carry (methods, fields, instance
    attributes, parameters and buffers), less those of torch.nn.Module and object."""
    inherited = set(dir(torch.nn.Module())) | set(dir(object()))
    names: set[str] = set()
    for obj in instances.values():
        names |= set(dir(obj)) | set(getattr(obj, "__dict__", {}))
        for table in ("_parameters", "_buffers", "_modules"):
            names |= set(getattr(obj, "__dict__", {}).get(table, {}) or {})
    return {n for n in names - inherited if not n.startswith("__")}


def attribute_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every attribute ``path`` reads or writes: ``x.name``, and the name
    string of ``getattr(x, "name")`` and its kin."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            uses.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _NAME_ARGUMENT_CALLS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            uses.append((node.lineno, node.args[1].value))
    return uses


def unlisted_vllm_attributes(
    vllm_names: set[str], paths: list[Path], allowed: frozenset[str] = PUBLIC_NAMES
) -> list[str]:
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line} {name}"
        for path in paths
        for line, name in attribute_uses(path)
        if name in vllm_names and name not in allowed
    ]


def _runtime_files() -> list[Path]:
    return [p for p in sorted((ROOT / "vllm_kt_plugin").rglob("*.py")) if p != COMPAT]


def _tool_files() -> list[Path]:
    return [p for p in sorted((ROOT / "vllm_kt_tools").rglob("*.py")) if p != TOOLS_COMPAT]


def test_vllm_objects_are_read_through_public_attributes_only(instances: dict[str, object]) -> None:
    """Every attribute that vLLM's MoE layer, its runner, configs and methods carry, used
    outside vllm_compat, is on PUBLIC_VLLM_ATTRIBUTES: a new one — whatever its name —
    fails here, to be moved into vllm_compat with a TOUCHES entry (or added above, with why).
    Names are matched, not types: an attribute of our own with a vLLM name is listed as such;
    the engine's settings' own fields (ModelConfig.max_model_len, ...) are not checked."""
    vllm_names = vllm_attribute_names(instances)
    assert {"moe_config", "global_num_experts", "swiglu_limit", "is_lora_enabled", "pcp_size"} <= vllm_names
    unlisted = unlisted_vllm_attributes(vllm_names, _runtime_files())
    assert not unlisted, "vLLM attributes outside hybrid/vllm_compat.py: " + "; ".join(unlisted)


def test_the_tooling_reads_vllm_objects_through_public_attributes_only(instances: dict[str, object]) -> None:
    """The same guard over vllm_kt_tools, whose internals go through support/vllm_internals.py."""
    allowed = PUBLIC_NAMES | TOOLING_OWN_NAMES
    unlisted = unlisted_vllm_attributes(vllm_attribute_names(instances), _tool_files(), allowed)
    assert not unlisted, "vLLM attributes outside vllm_kt_tools/support/vllm_internals.py: " + "; ".join(unlisted)


def test_public_attributes_are_vllms_and_not_touches(instances: dict[str, object]) -> None:
    """The allow-list against the installed vLLM: each name is still one of its objects'
    (an upgrade that renames one fails here), and none is an internal TOUCHES lists."""
    missing = (PUBLIC_NAMES | TOOLING_OWN_NAMES) - vllm_attribute_names(instances)
    assert not missing, sorted(missing)
    assert not (PUBLIC_NAMES | TOOLING_OWN_NAMES) & {touch.attribute for touch in EVERY_TOUCH}


def test_the_attribute_guard_finds_what_it_was_not_told_about(instances: dict[str, object], tmp_path: Path) -> None:
    """A new touch is caught by being vLLM's, not by its name being on some list."""
    new = tmp_path / "new_touch.py"
    new.write_text("def f(layer):\n    return layer.moe_config.routing_method, getattr(layer, 'expert_map_manager')\n")
    found = unlisted_vllm_attributes(vllm_attribute_names(instances), [new])
    assert [entry.rsplit(" ", 1)[1] for entry in found] == ["routing_method", "expert_map_manager"]


def test_expert_weights_load_as_vllm_compat_says(instances: dict[str, object]) -> None:
    """The loader convention load_expert_weight and wrap_expert_weight_loaders rely on:
    vLLM's expert loader takes (param, loaded_weight, weight_name, shard_id, expert_id,
    return_success) positionally, puts gate (w1) then up (w3) into w13_weight and down (w2)
    into w2_weight, refuses other shard ids, and carries the supports_moe_loading mark."""
    import inspect

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_kt_plugin.hybrid.vllm_compat import DOWN_SHARD, GATE_SHARD, UP_SHARD, load_expert_weight

    parameters = list(inspect.signature(RoutedExperts.weight_loader).parameters)
    assert parameters == ["self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success"]
    assert RoutedExperts.weight_loader.supports_moe_loading  # type: ignore[attr-defined]
    layer = build_moe(None).routed_experts
    assert layer.w13_weight.weight_loader == layer.weight_loader  # each parameter carries the loader
    inter, hidden = layer.w2_weight.shape[2], layer.w2_weight.shape[1]
    gate, up, down = (
        torch.full(shape, v, dtype=torch.bfloat16)
        for shape, v in (((inter, hidden), 1), ((inter, hidden), 2), ((hidden, inter), 3))
    )
    assert load_expert_weight(layer, "w13_weight", gate, "w13_weight", GATE_SHARD, 5)
    assert load_expert_weight(layer, "w13_weight", up, "w13_weight", UP_SHARD, 5)
    assert load_expert_weight(layer, "w2_weight", down, "w2_weight", DOWN_SHARD, 5)
    assert torch.equal(layer.w13_weight.data[5], torch.cat([gate, up]))
    assert torch.equal(layer.w2_weight.data[5], down)
    with pytest.raises(ValueError, match="shard_id"):
        load_expert_weight(layer, "w2_weight", down, "w2_weight", "w4", 5)


def test_gpt_oss_copies_expert_stacks_past_the_loader() -> None:
    """Why route_stack_copies exists: vLLM 0.32's gpt-oss loader copies each layer's stack of
    all experts' unquantized tensors with ``param.copy_``, not through the expert loader.
    When it stops, this fails and route_stack_copies can go."""
    import inspect

    from vllm.model_executor.models.gpt_oss import GptOssModel

    source = inspect.getsource(GptOssModel._load_weights_other)
    assert '".w13_weight" in name' in source and "param.copy_(narrow_weight)" in source


def test_stack_copies_are_routed_until_released(vllm_layer_context) -> None:
    from vllm_kt_plugin.hybrid.vllm_compat import route_stack_copies, stack_copies_released

    layer = build_moe(None, num_experts=4).routed_experts
    seen: list[tuple[str, tuple[int, ...]]] = []
    route_stack_copies(layer, ["w2_weight"], 8, lambda name, stack: seen.append((name, tuple(stack.shape))))
    stack = torch.ones((8, *layer.w2_weight.shape[1:]), dtype=layer.w2_weight.dtype)
    layer.w2_weight.copy_(stack)
    assert seen == [("w2_weight", tuple(stack.shape))]
    layer.w2_weight.copy_(stack[:4])  # the parameter's own shape: the tensor's own copy
    assert len(seen) == 1 and torch.equal(layer.w2_weight.data, stack[:4])
    stack_copies_released(layer)
    with pytest.raises(RuntimeError):
        layer.w2_weight.copy_(stack)


@pytest.mark.parametrize("touch", EVERY_TOUCH, ids=lambda t: f"{t.owner}.{t.attribute}")
def test_the_vllm_internal_exists(touch: Touch, instances: dict[str, object]) -> None:
    owner = owner_of(touch)
    if touch.on == "owner":
        assert hasattr(owner, touch.attribute), f"vLLM no longer has {touch.owner}.{touch.attribute}: {touch.relied_on}"
        return
    if touch.on == "init":  # set on instances by the class's __init__: read from its source
        import inspect

        source = inspect.getsource(owner.__init__)  # type: ignore[misc]
        assert f"self.{touch.attribute} =" in source or f"self.{touch.attribute}:" in source, touch
        return
    assert touch.on == "instance", touch
    instance = instances[touch.owner.partition(":")[2]]
    assert isinstance(instance, owner), (type(instance), owner)  # type: ignore[arg-type]
    found = hasattr(instance, touch.attribute) or touch.attribute in getattr(instance, "_buffers", {})
    assert found, f"vLLM's {touch.owner} instances no longer have {touch.attribute}: {touch.relied_on}"


def test_every_touched_class_has_an_instance_here(instances: dict[str, object]) -> None:
    """A new instance touch needs an instance above, or the test above cannot check it."""
    wanted = {t.owner.partition(":")[2] for t in EVERY_TOUCH if t.on == "instance"}
    assert wanted <= set(instances)


def test_the_op_finds_its_layer_through_the_forward_context(vllm_layer_context) -> None:
    """As vLLM's moe_forward does: the runner registered under the layer's name."""
    from vllm.forward_context import set_forward_context

    from vllm_kt_plugin.hybrid.vllm_compat import routed_experts_of

    runner = build_moe(None)
    with set_forward_context(None, vllm_layer_context):
        assert routed_experts_of(runner.routed_experts.layer_name) is runner.routed_experts


# A fresh process: this one asked already (vllm_world). ARCH_GET_XCOMP_PERM = 0x1022 (syscall
# arch_prctl, 158) reads the granted features; bit 18 is XFEATURE_XTILEDATA, AMX's tile data.
_TILE_PERMISSION = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def granted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & (1 << 18))
before = granted()
from vllm_kt_plugin.hybrid.vllm_compat import ask_for_amx_tiles
print(before, ask_for_amx_tiles(), granted())
"""


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles: there is no permission to ask for"
)
def test_ask_for_amx_tiles_gets_the_tile_permission() -> None:
    """What keeps vLLM's CPU kernels from dying of SIGILL under --enforce-eager (see
    ask_for_amx_tiles): a process starts without tile permission and has it afterwards."""
    out = subprocess.run([sys.executable, "-c", _TILE_PERMISSION], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out


# --- vLLM's CPU router: sigmoid top-k without expert groups (route_ungrouped_sigmoid_on_cpu) ---


@pytest.fixture
def own_cpu_routing():
    """vLLM's own ``CPURouter._compute_routing`` for the test (unwrapped where an earlier
    register() in this process patched it), whatever the test patches put back after."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the fix applies on vLLM's CPU build only; this vLLM is another platform's")
    current = CPURouter._compute_routing
    CPURouter._compute_routing = getattr(current, "__wrapped__", current)
    yield CPURouter
    CPURouter._compute_routing = current


def sigmoid_top_k(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """As CUDA routes it, written out: sigmoid scores; the experts chosen on score + bias; their
    weights the unbiased scores, renormalized where asked; scaled where there is a bias
    (fused_topk_bias; without one, FusedTopKRouter is never given the factor)."""
    scores = logits.float().sigmoid()
    ids = (scores if bias is None else scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * (scale if bias is not None else 1.0), ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weights, ids) in expert order (the kernels take them in any order)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _route(router_cls: type, logits: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    router = router_cls(top_k=kwargs.pop("top_k", 4), global_num_experts=logits.shape[1], **kwargs)
    return router._compute_routing(torch.zeros(logits.shape[0], 16), logits, None)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_router_routes_sigmoid_without_groups_as_cuda(own_cpu_routing, renormalize, scale, with_bias) -> None:
    """vLLM's CPU build asserts softmax for a sigmoid router without expert groups (MiniMax-M2,
    Laguna); patched, it gives the hand-written routing above on random logits and bias."""
    from vllm_kt_plugin.hybrid.vllm_compat import route_ungrouped_sigmoid_on_cpu

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32, generator=generator)
    bias = torch.randn(32, generator=generator) * 0.5 if with_bias else None
    routing = dict(scoring_func="sigmoid", renormalize=renormalize, routed_scaling_factor=scale)
    with pytest.raises(AssertionError):
        _route(own_cpu_routing, logits, e_score_correction_bias=bias, **routing)
    assert route_ungrouped_sigmoid_on_cpu()
    weights, ids = _route(own_cpu_routing, logits, e_score_correction_bias=bias, **routing)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (64, 4)
    want_weights, want_ids = by_expert(*sigmoid_top_k(logits, bias, 4, renormalize, scale))
    got_weights, got_ids = by_expert(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)
    if with_bias:  # the bias changed the choice somewhere: selection and weights really differ
        assert not torch.equal(want_ids, by_expert(*sigmoid_top_k(logits, None, 4, renormalize, scale))[1])


@pytest.mark.parametrize(
    "routing",
    [
        dict(scoring_func="softmax", renormalize=True),
        dict(scoring_func="softmax", renormalize=False),
        dict(scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2, routed_scaling_factor=2),
        dict(scoring_func="softmax", use_grouped_topk=True, num_expert_group=4, topk_group=2),
        dict(scoring_func="sigmoid", custom_routing_function="custom"),
    ],
    ids=["softmax", "softmax-no-renormalize", "grouped-sigmoid-bias", "grouped-softmax", "custom"],
)
def test_cpu_router_leaves_every_other_routing_as_it_was(own_cpu_routing, routing: dict) -> None:
    from vllm_kt_plugin.hybrid.vllm_compat import route_ungrouped_sigmoid_on_cpu

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 32, generator=generator)
    if routing.get("custom_routing_function") == "custom":
        routing = {**routing, "custom_routing_function": lambda **kw: kw["gating_output"].topk(kw["topk"], dim=-1)}
    if routing.get("use_grouped_topk") and routing["scoring_func"] == "sigmoid":
        routing = {**routing, "e_score_correction_bias": torch.randn(32, generator=generator)}
    before = by_expert(*_route(own_cpu_routing, logits, **routing))
    assert route_ungrouped_sigmoid_on_cpu()
    after = by_expert(*_route(own_cpu_routing, logits, **routing))
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])


def test_cpu_router_fix_is_applied_once(own_cpu_routing) -> None:
    from vllm_kt_plugin.hybrid.vllm_compat import route_ungrouped_sigmoid_on_cpu

    own = own_cpu_routing._compute_routing
    assert route_ungrouped_sigmoid_on_cpu()
    patched = own_cpu_routing._compute_routing
    assert patched is not own and patched.__wrapped__ is own
    assert route_ungrouped_sigmoid_on_cpu() and own_cpu_routing._compute_routing is patched


def test_a_config_whose_layer_kinds_name_no_moe_layer_declares_no_routed_experts() -> None:
    from transformers import JambaConfig, NemotronHConfig
    from vllm.transformers_utils.configs.cosmos3_edge import Cosmos3EdgeConfig

    from vllm_kt_plugin.hybrid.vllm_compat import routed_expert_counts

    # Cosmos3-Edge's text config is Nemotron-H's with attention and plain MLP layers only: the
    # expert counts it carries are Nemotron-H's defaults
    cosmos = Cosmos3EdgeConfig()
    assert cosmos.get_text_config().n_routed_experts > 0
    assert routed_expert_counts(cosmos) == (0, 0)
    moe = NemotronHConfig(layers_block_type=["mamba", "moe", "attention", "moe"])
    assert routed_expert_counts(moe) == (moe.n_routed_experts, moe.num_experts_per_tok)
    # Jamba's layer kinds are its mixers only: its MoE layers come from expert_layer_period
    jamba = JambaConfig()
    assert routed_expert_counts(jamba) == (jamba.num_experts, jamba.num_experts_per_tok)
