"""GGUF architectures beyond Llama / Qwen2 / Gemma 3: a tiny random transformers model of each
family is written as a GGUF the way llama.cpp's convert_hf_to_gguf.py writes it (its tensor
names from the gguf package's own name map, its metadata keys, its transformations: Q/K rows
permuted for `llama`, experts stacked into [E, out, in], DeepSeek's kv_b split into a transposed
k_b and v_b, q|k|v and gate|up left fused for Phi-3, tensors squeezed), then served by densa from
the .gguf path (as `densa serve --model x.gguf` does) and compared with transformers' greedy
tokens on the same weights; with Q8_0 tensors, on the weights Q8_0 rounds to (the round trip
is idempotent, so rounding before writing gives the file's exact values)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from densa.engine.llm_engine import LLMEngine
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.gguf import convert_gguf
from densa.model.gguf_archs import GGUF_ARCHS, FileLayout, gguf_dialect
from densa.model.gguf_tensors import gguf_tensors
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.engine.reference import first_divergence, hf_greedy, run_with_invariants
from tests.tiny_families import CONFIGS, save_tiny

# A byte-level BPE vocabulary of 275 tokens (bytes, 16 merges, 3 specials) keeps the files
# small: llama.cpp's 50k-token vocabularies take seconds to parse each time a file is opened.
MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "r e", "a t", "Ġ s", "e n", "Ġ o", "o r",
          "e s", "Ġ c", "i s", "a n"]  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(MERGES) + len(SPECIALS)
PROMPTS = [  # token ids: bytes of ASCII text, all longer than the 8-token Phi-3 window
    list(b"The capital of France is"),
    list(b"def f(n):"),
    list(b"1, 2, 3, 5, 8, 13, 21,"),
]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
Tensors = dict[str, torch.Tensor]


def phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        original_max_position_embeddings=1024, rms_norm_eps=1e-5, sliding_window=8,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


# ---- what convert_hf_to_gguf.py does, per family ---------------------------------------------
def _base_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters: the keys every family writes."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = next((cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if cfg.get(k)), None)  # fmt: skip
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])


def _llama_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    _base_metadata(writer, cfg)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])


def _qwen_moe_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    _base_metadata(writer, cfg)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _deepseek2_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA written as MQA over the latent (one KV head,
    keys of kv_lora_rank + rope values), the per-head widths under *_mla."""
    _base_metadata(writer, cfg | {"num_key_value_heads": 1, "head_dim": None})
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(cfg["kv_lora_rank"])
    writer.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    writer.add_value_length(cfg["kv_lora_rank"])
    writer.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    writer.add_value_length_mla(cfg["v_head_dim"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # V3's scoring_func
    rope = cfg.get("rope_parameters") or {}
    if rope.get("mscale_all_dim"):
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _phi3_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    """Phi3MiniModel.set_gguf_parameters (it does not call the base)."""
    heads = cfg["num_attention_heads"]
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_sliding_window(cfg.get("sliding_window") or 0)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes (what byte-level BPE vocabularies list)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return dict(sorted(chars.items()))


def add_tokenizer(writer: Any) -> None:
    tokens = [*_byte_to_unicode().values(), *(m.replace(" ", "") for m in MERGES), *SPECIALS]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_token_types([normal] * (VOCAB - len(SPECIALS)) + [control] * len(SPECIALS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(VOCAB - len(SPECIALS))
    writer.add_eos_token_id(VOCAB - len(SPECIALS))


def _llama_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: Q/K rows interleaved for llama.cpp's rotary layout."""
    shape = weight.shape
    return (
        weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _stack_experts(weights: Tensors, pattern: str, projs: tuple[str, ...], merged: str) -> Tensors:
    """The converters' expert merge: per-expert [out, in] tensors -> one [E, out, in] per layer."""
    out = dict(weights)
    layers = {int(n.split(".")[2]) for n in weights if ".experts.0." in n}
    for layer in layers:
        for proj in projs:
            names = sorted(
                (n for n in weights if n.startswith(pattern.format(layer=layer, e="")) and
                 n.endswith(f".{proj}.weight")),
                key=lambda n: int(n.split(".experts.")[1].split(".")[0]),
            )  # fmt: skip
            out[merged.format(layer=layer, proj=proj)] = torch.stack([out.pop(n) for n in names])
    return out


def _llama_tensors(weights: Tensors, cfg: dict[str, Any]) -> Tensors:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = {
        name: _llama_permute(w, heads if "q_proj" in name else kv_heads)
        if name.endswith(("q_proj.weight", "k_proj.weight")) else w
        for name, w in weights.items()
    }  # fmt: skip
    return _stack_experts(
        permuted, "model.layers.{layer}.block_sparse_moe.experts.{e}", ("w1", "w2", "w3"),
        "layers.{layer}.feed_forward.experts.{proj}.weight",
    )  # fmt: skip


def _moe_tensors(weights: Tensors, cfg: dict[str, Any]) -> Tensors:
    return _stack_experts(
        weights, "model.layers.{layer}.mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"),
        "model.layers.{layer}.mlp.experts.{proj}.weight",
    )  # fmt: skip


def _deepseek2_tensors(weights: Tensors, cfg: dict[str, Any]) -> Tensors:
    heads, nope, v_dim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {}
    for name, w in _moe_tensors(weights, cfg).items():
        if name.endswith("kv_b_proj.weight"):  # split, k_b transposed (MLA absorption)
            kv_b = w.view(heads, nope + v_dim, w.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v_dim], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b
        else:
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = w
    return out


def _unchanged(weights: Tensors, cfg: dict[str, Any]) -> Tensors:
    return weights


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH member name
    config: Callable[[], Any]
    metadata: Callable[[Any, dict[str, Any]], None]
    tensors: Callable[[Tensors, dict[str, Any]], Tensors]
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields for llama.cpp


FAMILIES = {
    "qwen3": Family("QWEN3", CONFIGS["qwen3"], _base_metadata, _unchanged),
    # llama.cpp's qwen2moe has no dense layers: every layer routed.
    "qwen2_moe": Family(
        "QWEN2MOE", CONFIGS["qwen2_moe"], _qwen_moe_metadata, _moe_tensors, {"mlp_only_layers": []}
    ),
    "qwen3_moe": Family("QWEN3MOE", CONFIGS["qwen3_moe"], _qwen_moe_metadata, _moe_tensors),
    "mixtral": Family("LLAMA", CONFIGS["mixtral"], _llama_metadata, _llama_tensors),
    "deepseek_v3": Family(
        "DEEPSEEK2", CONFIGS["deepseek_v3"], _deepseek2_metadata, _deepseek2_tensors
    ),
    "deepseek_v3_yarn": Family(
        "DEEPSEEK2", CONFIGS["deepseek_v3_yarn"], _deepseek2_metadata, _deepseek2_tensors
    ),
    "phi3": Family("PHI3", phi3, _phi3_metadata, _unchanged),
}


def _is_quantized(gguf_name: str, shape: tuple[int, ...]) -> bool:
    """llama-quantize's choice, simplified: matrices whose rows split into 32-value blocks,
    never the routers (ffn_gate_inp, ffn_gate_inp_shexp)."""
    return len(shape) >= 2 and shape[-1] % 32 == 0 and "gate_inp" not in gguf_name


def _round_trip(weight: torch.Tensor, quant: str) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType[quant]
    return torch.from_numpy(dequantize(quantize(weight.float().numpy(), kind), kind).copy())


def _rounded(name: str, weight: torch.Tensor, cfg: dict[str, Any], quant: str) -> torch.Tensor:
    """`weight` (HF layout) as the GGUF stores it under `quant`: the same row blocks are
    rounded (permutations and expert stacking move whole rows), except kv_b, whose k half
    llama.cpp transposes into rows of qk_nope_head_dim values (too short for a block here)."""
    router = name.endswith((".gate.weight", "shared_expert_gate.weight"))
    if router or not _is_quantized(name, tuple(weight.shape)):
        return weight
    if name.endswith("kv_b_proj.weight"):
        nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        kv_b = weight.view(cfg["num_attention_heads"], nope + v_dim, -1).clone()
        if nope % 32 == 0:
            kv_b[:, :nope] = _round_trip(kv_b[:, :nope], quant)
        kv_b[:, nope:] = _round_trip(kv_b[:, nope:].contiguous(), quant)
        return kv_b.view_as(weight)
    return _round_trip(weight, quant)


def write_gguf(family: Family, hf_dir: Path, out_path: Path, quant: str = "F32") -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = gguf.MODEL_ARCH[family.arch]
    weights = load_file(str(hf_dir / "model.safetensors"))
    name_map = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out_path), gguf.MODEL_ARCH_NAMES[arch])
    family.metadata(writer, cfg)
    add_tokenizer(writer)
    for hf_name, tensor in family.tensors(weights, cfg).items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"llama.cpp has no name for {hf_name}"
        data = tensor.squeeze().float().numpy()  # the converter squeezes [1, n] to [n]
        if quant != "F32" and _is_quantized(name, data.shape):
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rounded_copy(hf_dir: Path, out_dir: Path, quant: str) -> Path:
    """The HF model with each weight replaced by the values the `quant` GGUF holds."""
    out_dir.mkdir()
    for path in hf_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    rounded = {name: _rounded(name, w, cfg, quant) for name, w in weights.items()}
    save_file(rounded, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _tiny(family: str, out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(CONFIGS, family, FAMILIES[family].config)  # phi3 is not a tiny family
    return save_tiny(family, out_dir, seed=3, vocab_size=VOCAB, **FAMILIES[family].overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_reads_back_the_checkpoint(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor comes back under its HF name with its exact values (experts split, fused
    projections split, k_b / v_b joined, Q/K rows un-permuted, squeezed gates unsqueezed), and
    the config has the source's structure (MoE layers and routing, MLA widths, windows)."""
    hf_dir = _tiny(family, tmp_path / "hf", monkeypatch)
    path = tmp_path / f"{family}.gguf"
    write_gguf(FAMILIES[family], hf_dir, path)
    (tmp_path / "converted").mkdir()
    convert_gguf(path, tmp_path / "converted")
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    reader = gguf.GGUFReader(str(path))
    dialect = gguf_dialect(str(reader.fields["general.architecture"].contents()))
    ours = {name: t.dequantize() for name, t in gguf_tensors(reader, config, dialect)}
    theirs = load_file(str(hf_dir / "model.safetensors"))
    if family == "phi3":  # read as Llama layers: q|k|v and gate|up split
        theirs = _split_phi3(theirs, ArchConfig.from_dir(tmp_path / "converted"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.float()), name
    read, source = ArchConfig.from_dir(tmp_path / "converted"), ArchConfig.from_dir(hf_dir)
    for key in STRUCTURE:
        assert getattr(read, key) == getattr(source, key), key
    scaling = source.rope_scaling or {}
    assert (read.rope_scaling or {}).get("rope_type") == scaling.get("rope_type")


STRUCTURE = ("num_kv_heads", "head_dim", "layer_windows", "tie_word_embeddings", "attention_bias",
             "hidden_act", "moe", "mla")  # fmt: skip


def _split_phi3(weights: Tensors, arch: ArchConfig) -> Tensors:
    out = {}
    for name, w in weights.items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = w.split([arch.q_size, arch.kv_size, arch.kv_size])
            out |= {
                name.replace("qkv_proj", p): t
                for p, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
            }
        elif name.endswith("gate_up_proj.weight"):
            gate, up = w.chunk(2)
            out |= {
                name.replace("gate_up_proj", "gate_proj"): gate,
                name.replace("gate_up_proj", "up_proj"): up,
            }
        else:
            out[name] = w
    return out


CASES = [(family, "F32") for family in sorted(FAMILIES)] + [
    ("mixtral", "Q8_0"), ("deepseek_v3", "Q8_0"), ("phi3", "Q8_0"), ("qwen2_moe", "Q8_0"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "quant"), CASES)
def test_gguf_greedy_matches_transformers(
    family: str, quant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = _tiny(family, tmp_path / "hf", monkeypatch)
    ref_dir = hf_dir if quant == "F32" else rounded_copy(hf_dir, tmp_path / "rounded", quant)
    path = tmp_path / f"{family}.gguf"
    write_gguf(FAMILIES[family], ref_dir, path, quant)
    # Dense: the quantized tensors' values, as transformers gets them (which layers keep their
    # blocks under `auto` is densa.model.gguf_loading's business, tested there).
    formats = {"weight_format": "dense", "head_format": "dense"} if quant != "F32" else {}
    args = EngineArgs(model=str(path), max_model_len=128, num_kv_pages=64, page_size=4, **formats)
    ours = run_with_invariants(LLMEngine.from_args(args), PROMPTS, GREEDY)
    refs = hf_greedy(ref_dir, PROMPTS, MAX_NEW)
    assert [first_divergence(o, r) for o, r in zip(ours, refs, strict=True)] == [None] * len(refs)


def _layout(fields: dict[str, Any], tensors: set[str], num_layers: int = 1) -> FileLayout:
    return FileLayout(
        lambda key, default=None: fields.get(key, default), frozenset(tensors), num_layers
    )


def test_variants_densa_cannot_run_are_refused_with_the_reason(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gemma2.gguf"), "gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gemma2' is not supported"):
        convert_gguf(tmp_path / "gemma2.gguf", tmp_path)
    with pytest.raises(ModelLoadError, match="soft-capping"):
        gguf_dialect("gemma2")
    deepseek2, phi3 = GGUF_ARCHS["deepseek2"].extras, GGUF_ARCHS["phi3"].extras
    with pytest.raises(ModelLoadError, match="softmax expert routing"):  # DeepSeek-V2
        deepseek2(_layout({"expert_gating_func": 1}, {"blk.0.ffn_gate_inp.weight"}))
    dims = {"embedding_length": 3072, "attention.head_count": 32}
    with pytest.raises(ModelLoadError, match="partial rotary"):  # Phi-4-mini
        phi3(_layout(dims | {"rope.dimension_count": 72}, set()))
    with pytest.raises(ModelLoadError, match="LongRoPE"):  # Phi-3-128k, Phi-3.5
        phi3(_layout(dims | {"rope.dimension_count": 96}, {"rope_factors_long.weight"}))
