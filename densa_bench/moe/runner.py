"""`densa bench moe`: BF16 vs INT4 experts on a random mixture-of-experts model made locally.

No MoE model ships in a package, so the benchmark writes one: a Qwen3-MoE-shaped checkpoint
(~1B parameters, 8 of 64 experts per token) with random BF16 weights, in the per-expert layout
checkpoints use, sharded per layer. Random weights compute exactly as much as trained ones; the
routing is roughly uniform (a trained router is more skewed, which favours decode: fewer experts
active per step). Then `densa bench weights` runs on it: checkpoints made once with `densa
quantize`, engines loaded once, prefill and decode by concurrency measured interleaved.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from densa.model.loader import resolve_model_dir
from densa.setup.args import EngineArgs, default_model_path
from densa.utils.logging import get_logger
from densa_bench.common.report import BenchReport, Table
from densa_bench.weights.runner import WeightsSettings, run_weights

logger = get_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE-style model: GQA attention with q/k norms, every MLP a sparse MoE block."""

    hidden_size: int = 1024
    num_layers: int = 12
    num_experts: int = 64
    top_k: int = 8  # 1/8 of the experts per token
    expert_intermediate_size: int = 384
    head_dim: int = 64
    vocab_size: int = 49152  # SmolLM2's tokenizer (so texts round-trip)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts or self.num_layers < 1:
            raise ValueError("need 1 <= --top-k <= --num-experts and --num-layers >= 1")
        if self.hidden_size % (4 * self.head_dim) or self.expert_intermediate_size < 1:
            raise ValueError(f"--hidden-size must be a multiple of {4 * self.head_dim}")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads // 4  # GQA, 4 query heads per KV head

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": 4 * self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        }  # fmt: skip

    def expert_parameters(self) -> int:
        per_expert = 3 * self.hidden_size * self.expert_intermediate_size  # gate, up, down
        return self.num_layers * self.num_experts * per_expert

    def other_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attention = h * (q + 2 * kv) + q * h + 2 * d + 2 * h  # + q/k norms, two layer norms
        router = self.num_experts * h
        return self.vocab_size * h + self.num_layers * (attention + router) + h

    def active_parameters(self) -> int:
        """Parameters one token's forward pass multiplies with (the tied head counted once)."""
        return self.expert_parameters() * self.top_k // self.num_experts + self.other_parameters()


def make_random_moe(shape: MoeShape, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Write the model (once; later calls reuse it): config, one safetensors shard per layer."""
    if (out_dir / "config.json").exists():
        return out_dir
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(shape.seed)
    weight_map: dict[str, str] = {}
    shards = [("model-globals.safetensors", _global_tensors(shape, gen))]
    shards += [
        (f"model-layer-{i:03d}.safetensors", _layer_tensors(shape, i, gen))
        for i in range(shape.num_layers)
    ]
    for file_name, tensors in shards:
        save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file_name)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp / "config.json").write_text(json.dumps(shape.config(), indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(out_dir)
    return out_dir


def _random(shape: tuple[int, ...], gen: torch.Generator, fan_in: int) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * fan_in**-0.5).to(torch.bfloat16)


def _global_tensors(shape: MoeShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = shape.hidden_size
    return {
        "model.embed_tokens.weight": _random((shape.vocab_size, h), gen, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }


def _layer_tensors(shape: MoeShape, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, d, width = shape.hidden_size, shape.head_dim, shape.expert_intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    p = f"model.layers.{layer}."
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    tensors = {
        p + "input_layernorm.weight": ones(h),
        p + "post_attention_layernorm.weight": ones(h),
        p + "self_attn.q_proj.weight": _random((q, h), gen, h),
        p + "self_attn.k_proj.weight": _random((kv, h), gen, h),
        p + "self_attn.v_proj.weight": _random((kv, h), gen, h),
        p + "self_attn.o_proj.weight": _random((h, q), gen, q),
        p + "self_attn.q_norm.weight": ones(d),
        p + "self_attn.k_norm.weight": ones(d),
        p + "mlp.gate.weight": _random((shape.num_experts, h), gen, h),
    }
    for e in range(shape.num_experts):  # one tensor per expert, as checkpoints store them
        expert = f"{p}mlp.experts.{e}."
        tensors[expert + "gate_proj.weight"] = _random((width, h), gen, h)
        tensors[expert + "up_proj.weight"] = _random((width, h), gen, h)
        tensors[expert + "down_proj.weight"] = _random((h, width), gen, width)
    return tensors


def run_moe(
    shape: MoeShape, settings: WeightsSettings, base: EngineArgs, model_dir: Path | None = None
) -> BenchReport:
    tokenizer_dir = resolve_model_dir(default_model_path())
    model_dir = model_dir or settings.work_dir / "random-moe"
    logger.info("random MoE model in %s (made once)", model_dir)
    source = make_random_moe(shape, model_dir, tokenizer_dir)
    report = run_weights(settings, dataclasses.replace(base, model=str(source)))
    report.name = "moe"
    report.settings["model_shape"] = dataclasses.asdict(shape)
    report.tables.insert(0, _model_table(shape))
    total = shape.expert_parameters() + shape.other_parameters()
    report.notes.insert(
        0,
        f"Model: random Qwen3-MoE shape, {total / 1e9:.2f}B parameters, "
        f"{shape.active_parameters() / 1e6:.0f}M active per token "
        f"({shape.top_k} of {shape.num_experts} experts: 1/{shape.num_experts // shape.top_k} "
        f"of the expert weights; {shape.active_parameters() / total:.0%} of all parameters).",
    )
    return report


def _model_table(shape: MoeShape) -> Table:
    total, experts = shape.expert_parameters() + shape.other_parameters(), shape.expert_parameters()
    heads = f"{shape.num_heads} heads / {shape.num_kv_heads} KV heads x {shape.head_dim}"
    width = (
        f"{shape.num_experts} per layer, top-{shape.top_k}, width {shape.expert_intermediate_size}"
    )
    rows = [
        ["layers x hidden", f"{shape.num_layers} x {shape.hidden_size}"],
        ["attention", heads],
        ["experts", width],
        ["parameters", f"{total / 1e9:.3f}B total ({experts / 1e9:.3f}B in experts)"],
        ["active per token", f"{shape.active_parameters() / 1e6:.0f}M"],
    ]
    return Table("Model", ["", ""], rows)
