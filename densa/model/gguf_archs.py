"""How each GGUF architecture (`general.architecture`) maps onto a Hugging Face model: a
registry of dialects, one entry per llama.cpp architecture densa reads.

llama.cpp's converter changes tensors on the way in, and each change is undone here:
- Llama: Q and K rows are interleaved for llama.cpp's rotary layout (`permuted_qk`);
- Gemma: norm weights are stored as 1 + w (llama.cpp's RMSNorm multiplies by the stored weight,
  Gemma's by 1 + w), so `norm_offset` = 1 is subtracted again;
and some settings are not stored at all but fixed in llama.cpp's code per architecture (Gemma 3:
one global layer in six, local RoPE base 10k, the query scale), so the dialect supplies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Getter = Callable[[str, Any], Any]  # reads "<arch>.<key>" from the GGUF fields

_COMMON_LAYER_NAMES = {
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
# Gemma's sandwich norms: llama.cpp's "ffn_norm" is the norm *before* the MLP.
_GEMMA3_LAYER_NAMES = _COMMON_LAYER_NAMES | {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _no_extras(get: Getter, num_layers: int) -> dict[str, Any]:
    return {}


GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every sixth Gemma 3 layer is global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62  # the one size whose query scale is hidden / heads, not head_dim


def _gemma3_extras(get: Getter, num_layers: int) -> dict[str, Any]:
    head_dim = int(get("attention.key_length", 256))
    hidden, heads = int(get("embedding_length", 0)), int(get("attention.head_count", 1))
    layer_types = [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    extras: dict[str, Any] = {
        "layer_types": layer_types,
        "sliding_window": int(get("attention.sliding_window", 512)),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": hidden // heads if num_layers == GEMMA3_27B_LAYERS else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    factor = get("rope.scaling.factor", None)
    if factor and get("rope.scaling.type", "linear") == "linear":
        extras["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return extras


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str  # config.json "architectures" (selects densa's model class)
    model_type: str  # config.json "model_type" (what transformers needs to read the config)
    layer_names: dict[str, str]  # "blk.N.<gguf>" -> "model.layers.N.<hf>"
    permuted_qk: bool = False  # Q/K rows interleaved by llama.cpp's converter
    norm_offset: float = 0.0  # stored norm weight = HF weight + norm_offset
    extras: Callable[[Getter, int], dict[str, Any]] = field(default=_no_extras)


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", _LLAMA_LAYER_NAMES, permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER_NAMES),
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _GEMMA3_LAYER_NAMES,
        norm_offset=1.0,
        extras=_gemma3_extras,
    ),
}
