"""What the static forward computes for a target, per family and per layer, read from its config alone
(`layer_plan`): the family's layout and norms, each layer's mixer kind and MLP kind. `stack.check_supported` refuses
what it cannot compute; `StaticTarget` builds each layer's decode layer from the plan."""
from __future__ import annotations

from dataclasses import dataclass

from trainer.decode.layers.moe import Routing, routing_of
from trainer.model.linear_attention import LINEAR
from trainer.model.target import attention_kinds

# model_type -> (layout, norms, the mixer kind of its softmax attention layers)
FAMILIES = {
    **{t: ("plain", "plain", "attention") for t in ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral",
                                                    "gpt_oss")},
    **{t: ("sandwich", "offset", "attention") for t in ("gemma2", "gemma3_text")},
    **{t: ("plain", "offset", "gated_attention") for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                                            "qwen3_5_moe_text")},
}
# RoPE types whose frequencies change with the sequence length: a static forward cannot recompute them.
DYNAMIC_ROPE = ("dynamic", "longrope")
HINT = "use eval.engine=hf for this target"


@dataclass(frozen=True)
class LayerPlan:
    """What the static forward computes, per family and per layer, from the config alone."""

    model_type: str
    layout: str  # plain | sandwich
    norms: str  # plain | offset
    mixers: tuple[str, ...]  # per layer: attention | linear | gated_attention
    mlps: tuple[str, ...]  # per layer: dense | moe
    routing: Routing | None  # the MoE router rule (None: no MoE layer, or a family without a rule)
    top_k: int  # experts per token (0: no MoE layer)


def layer_plan(cfg) -> LayerPlan:
    """The plan of a config whose model type is in FAMILIES (check_supported refuses the others first). MoE layers
    as the families place them: every layer, except those in `mlp_only_layers` or off the `decoder_sparse_step`
    (Qwen3-MoE, Qwen3-Next)."""
    cfg = text_cfg(cfg)
    model_type = cfg.model_type
    layout, norms, softmax_kind = FAMILIES[model_type]
    types = attention_kinds(cfg).layer_types
    mixers = tuple("linear" if t == LINEAR else softmax_kind for t in types)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    dense_only, step = set(getattr(cfg, "mlp_only_layers", None) or ()), getattr(cfg, "decoder_sparse_step", 1) or 1
    mlps = tuple("moe" if experts and i not in dense_only and (i + 1) % step == 0 else "dense"
                 for i in range(len(types)))
    moe = "moe" in mlps
    return LayerPlan(model_type, layout, norms, mixers, mlps, routing_of(cfg) if moe else None,
                     cfg.num_experts_per_tok if moe else 0)


def text_cfg(cfg):
    """The language model's config (a multimodal config's text config; what load_target reads the layers from)."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_types(cfg) -> set[str]:
    """The RoPE types a config names: transformers 5 `rope_parameters` (one dict, or one per layer type, Gemma 3),
    or 4.x `rope_scaling` (`rope_type` or the older `type` key)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    dicts = [params] if "rope_type" in params or "type" in params else [p for p in params.values()
                                                                        if isinstance(p, dict)]
    return {str(d.get("rope_type", d.get("type", "default"))) for d in dicts}


def layers_of(kinds: tuple[str, ...], kind: str) -> str:
    at = [str(i) for i, k in enumerate(kinds) if k == kind]
    return ", ".join(at[:4]) + (", ..." if len(at) > 4 else "")
