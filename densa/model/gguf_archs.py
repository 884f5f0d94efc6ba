"""How each GGUF architecture (`general.architecture`) maps onto a Hugging Face model: a
registry of dialects, one entry per llama.cpp architecture densa reads.

    GGUF arch   config.json architecture       what llama.cpp's converter changed (undone here)
    llama       LlamaForCausalLM               Q/K rows interleaved for its rotary layout
                MixtralForCausalLM (experts)   + experts stacked: ffn_*_exps [E, out, in]
    qwen2       Qwen2ForCausalLM               nothing
    qwen3       Qwen3ForCausalLM               nothing
    qwen2moe    Qwen2MoeForCausalLM            experts stacked; shared-expert gate squeezed to [n]
    qwen3moe    Qwen3MoeForCausalLM            experts stacked
    deepseek2   DeepseekV3ForCausalLM          experts stacked; kv_b split per head into k_b
                (sigmoid-routed: V3, Kimi K2)  (transposed) and v_b; head_count_kv set to 1
    phi3        MistralForCausalLM             nothing, but q|k|v and gate|up are fused: split
    gemma3      Gemma3ForCausalLM              norm weights stored as 1 + w

A name in `layer_names` may carry "{e}": llama.cpp stacks the experts of a layer into one
[E, out, in] tensor, which the reader splits back into one [out, in] tensor per expert (the
checkpoint layout every densa MoE class reads); a tuple of names splits a fused tensor's rows.
Settings llama.cpp fixes in its code rather than the file (Gemma 3's one global layer in six,
Qwen3-MoE's renormalized top-k) come from the dialect's `extras`, which also refuse variants
densa has no model for, saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from densa.model.arch import ModelLoadError

Getter = Callable[[str, Any], Any]  # reads "<arch>.<key>" from the GGUF fields
LayerName = str | tuple[str, ...]  # one HF tensor, or the HF tensors a fused one's rows split into
EXPERT = "{e}"  # in an HF name: one tensor per expert, split from llama.cpp's stacked one
# DeepSeek's kv_b_proj as newer llama.cpp stores it: k_b [H, r, nope] (transposed per head), v_b.
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
# [1, n] HF matrices that llama.cpp's converter squeezed to [n].
ROW_VECTORS = frozenset({"ffn_gate_inp_shexp.weight"})


@dataclass(frozen=True)
class FileLayout:
    """What a dialect's `extras` may read: the metadata and which tensors the file holds."""

    get: Getter
    tensor_names: frozenset[str]
    num_layers: int

    def layers_with(self, name: str) -> list[int]:
        return [i for i in range(self.num_layers) if f"blk.{i}.{name}" in self.tensor_names]


_COMMON_LAYER_NAMES: dict[str, LayerName] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_LAYER_NAMES = _COMMON_LAYER_NAMES | {"ffn_norm.weight": "post_attention_layernorm.weight"}
_QK_NORMS: dict[str, LayerName] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Mixtral's own checkpoint names (densa's Mixtral class renames them).
_MIXTRAL_EXPERTS: dict[str, LayerName] = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
_ROUTED_EXPERTS: dict[str, LayerName] = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


def _shared_experts(prefix: str) -> dict[str, LayerName]:
    return {
        f"ffn_{proj}_shexp.weight": f"mlp.{prefix}.{proj}_proj.weight"
        for proj in ("gate", "up", "down")
    }


# Gemma's sandwich norms: llama.cpp's "ffn_norm" is the norm *before* the MLP.
_GEMMA3_LAYER_NAMES = (
    _COMMON_LAYER_NAMES
    | _QK_NORMS
    | {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
)
_QWEN2MOE_LAYER_NAMES = (
    _LLAMA_LAYER_NAMES
    | _ROUTED_EXPERTS
    | _shared_experts("shared_expert")
    | {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
)
_DEEPSEEK2_LAYER_NAMES = (
    _LLAMA_LAYER_NAMES
    | _ROUTED_EXPERTS
    | _shared_experts("shared_experts")
    | {
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files: kv_b whole
        KV_B_PARTS[0]: "self_attn.kv_b_proj.weight",  # newer files: joined back by the reader
        KV_B_PARTS[1]: "self_attn.kv_b_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    }
)
_PHI3_LAYER_NAMES = _LLAMA_LAYER_NAMES | {
    "attn_qkv.weight": (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
    ),
    "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),  # Phi-3's gate_up_proj
}  # fmt: skip


def rope_scaling(get: Getter) -> dict[str, Any] | None:
    """config.json's rope_scaling from llama.cpp's rope.scaling.* keys (linear, as llama.cpp
    assumes when the type is missing, or YaRN)."""
    kind, factor = get("rope.scaling.type", "linear"), get("rope.scaling.factor", None)
    if not factor or kind not in ("linear", "yarn"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(
            get("rope.scaling.original_context_length", 0)
        )
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}", None) is not None:
                scaling[name] = float(get(f"rope.scaling.{key}", None))
    return scaling


def _no_extras(layout: FileLayout) -> dict[str, Any]:
    return {}


def _llama_extras(layout: FileLayout) -> dict[str, Any]:
    """llama.cpp writes Mixtral as `llama` with stacked experts."""
    if not layout.get("expert_count", 0):
        return {}
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(layout.get("expert_count", 0)),
        "num_experts_per_tok": int(layout.get("expert_used_count", 0)),
    }


def _qwen_moe_extras(layout: FileLayout, norm_topk_prob: bool) -> dict[str, Any]:
    """Qwen MoE layers: every layer with a router (llama.cpp fixes whether the top-k weights
    are renormalized per architecture: Qwen2-MoE no, Qwen3-MoE yes)."""
    get = layout.get
    routed = set(layout.layers_with("ffn_gate_inp.weight"))
    return {
        "num_experts": int(get("expert_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
        "norm_topk_prob": bool(get("expert_weights_norm", norm_topk_prob)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layout.num_layers) if i not in routed],
    }


def _qwen2moe_extras(layout: FileLayout) -> dict[str, Any]:
    shared = layout.layers_with("ffn_up_shexp.weight")
    width = int(layout.get("expert_shared_feed_forward_length", 0)) if shared else 0
    return _qwen_moe_extras(layout, norm_topk_prob=False) | {
        "shared_expert_intermediate_size": width,
        "qkv_bias": bool(layout.layers_with("attn_q.bias")),
    }


def _qwen3moe_extras(layout: FileLayout) -> dict[str, Any]:
    return _qwen_moe_extras(layout, norm_topk_prob=True)


_SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID
_YARN_LOG_MUL_PER_MSCALE = 0.1  # llama.cpp stores yarn_log_multiplier = 0.1 * mscale_all_dim


def _deepseek2_extras(layout: FileLayout) -> dict[str, Any]:
    """DeepSeek-V3 / Kimi K2 (sigmoid routing with a score bias). llama.cpp stores MLA as MQA
    over the latent: head_count_kv 1, key_length kv_lora_rank + rope; the per-head widths are
    in key_length_mla / value_length_mla (older files: key_length, value_length)."""
    get = layout.get
    sigmoid = get("expert_gating_func", 0) == _SIGMOID_GATING
    if not sigmoid and not layout.layers_with("exp_probs_b.bias"):
        raise ModelLoadError(
            "GGUF architecture 'deepseek2' with softmax expert routing (DeepSeek-V2 / V2-Lite) is "
            "not supported: densa runs DeepSeek-V3-style sigmoid routing only"
        )
    rope_dim = int(get("rope.dimension_count", 64))
    key_length = int(get("attention.key_length_mla", 0) or get("attention.key_length", 0))
    heads = int(get("attention.head_count", 0))
    extras: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": heads,
        "head_dim": rope_dim,
        "q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank", 0)),
        "qk_nope_head_dim": key_length - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": int(get("attention.value_length_mla", 0) or get("attention.value_length", 0)),
        "rope_interleave": True,
        "n_routed_experts": int(get("expert_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    scaling = rope_scaling(get)
    log_mul = get("rope.scaling.yarn_log_multiplier", None)
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul:
        mscale = float(log_mul) / _YARN_LOG_MUL_PER_MSCALE  # DeepSeek sets mscale = mscale_all_dim
        extras["rope_scaling"] = scaling | {"mscale": mscale, "mscale_all_dim": mscale}
    return extras


def _phi3_extras(layout: FileLayout) -> dict[str, Any]:
    """Phi-3 / Phi-4 with full rotary and plain RoPE are Llama layers with a sliding window in
    every layer (Mistral's layout); llama.cpp writes window 0 for none (Phi-4)."""
    get = layout.get
    head_dim = int(get("embedding_length", 0)) // int(get("attention.head_count", 1))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(
            "GGUF architecture 'phi3' with partial rotary embeddings (Phi-4-mini) is not "
            "supported: densa rotates whole heads"
        )
    if "rope_factors_long.weight" in layout.tensor_names:
        raise ModelLoadError(
            "GGUF architecture 'phi3' with LongRoPE factors (Phi-3-128k, Phi-3.5) is not "
            "supported: densa has no LongRoPE"
        )
    window = int(get("attention.sliding_window", 0))
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": window or None,
    }


GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every sixth Gemma 3 layer is global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62  # the one size whose query scale is hidden / heads, not head_dim


def _gemma3_extras(layout: FileLayout) -> dict[str, Any]:
    get, num_layers = layout.get, layout.num_layers
    head_dim = int(get("attention.key_length", 256))
    hidden, heads = int(get("embedding_length", 0)), int(get("attention.head_count", 1))
    layer_types = [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    return {
        "layer_types": layer_types,
        "sliding_window": int(get("attention.sliding_window", 512)),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": hidden // heads if num_layers == GEMMA3_27B_LAYERS else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str  # config.json "architectures" (selects densa's model class)
    model_type: str  # config.json "model_type" (what transformers needs to read the config)
    layer_names: dict[str, LayerName]  # "blk.N.<gguf>" -> "model.layers.N.<hf>"
    permuted_qk: bool = False  # Q/K rows interleaved by llama.cpp's converter
    norm_offset: float = 0.0  # stored norm weight = HF weight + norm_offset
    # config.json entries llama.cpp does not store, or that override the common ones; raises
    # ModelLoadError for a variant densa cannot run.
    extras: Callable[[FileLayout], dict[str, Any]] = field(default=_no_extras)


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(
        "LlamaForCausalLM", "llama", _LLAMA_LAYER_NAMES | _MIXTRAL_EXPERTS, permuted_qk=True,
        extras=_llama_extras,
    ),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER_NAMES),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", _LLAMA_LAYER_NAMES | _QK_NORMS),
    "qwen2moe": GGUFArch(
        "Qwen2MoeForCausalLM", "qwen2_moe", _QWEN2MOE_LAYER_NAMES, extras=_qwen2moe_extras
    ),
    "qwen3moe": GGUFArch(
        "Qwen3MoeForCausalLM", "qwen3_moe", _LLAMA_LAYER_NAMES | _QK_NORMS | _ROUTED_EXPERTS,
        extras=_qwen3moe_extras,
    ),
    "deepseek2": GGUFArch(
        "DeepseekV3ForCausalLM", "deepseek_v3", _DEEPSEEK2_LAYER_NAMES, extras=_deepseek2_extras
    ),
    "phi3": GGUFArch("MistralForCausalLM", "mistral", _PHI3_LAYER_NAMES, extras=_phi3_extras),
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM", "gemma3_text", _GEMMA3_LAYER_NAMES, norm_offset=1.0,
        extras=_gemma3_extras,
    ),
}  # fmt: skip

# llama.cpp architectures densa knows but has no model for, and why.
UNSUPPORTED_GGUF_ARCHS = {
    "gemma2": "densa has no Gemma 2 model (its attention logit soft-capping is not implemented)",
}


def gguf_dialect(arch: str) -> GGUFArch:
    """The dialect of a GGUF architecture, or a ModelLoadError that says why there is none."""
    if arch in GGUF_ARCHS:
        return GGUF_ARCHS[arch]
    reason = UNSUPPORTED_GGUF_ARCHS.get(arch, "densa has no reader for it")
    raise ModelLoadError(
        f"GGUF architecture {arch!r} is not supported: {reason} "
        f"(supported: {', '.join(GGUF_ARCHS)})"
    )
