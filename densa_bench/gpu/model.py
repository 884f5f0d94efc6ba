"""Random-weight Llama checkpoints for the GPU check: a machine with no network and no bundled
model still gets a real HF directory (config.json, safetensors, a tokenizer) that densa loads
through its ordinary loader.

The tokenizer is synthetic: a word-level vocabulary "t0" .. "t{V-1}" built with the `tokenizers`
library and saved as a transformers fast tokenizer. Benchmarks feed token ids directly, so only
decoding (engine detokenization) ever uses it; it costs nothing to carry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class RandomLlama:
    """A Llama shape. The default is TinyLlama-1.1B's: 22 layers, GQA 32/4, head_dim 64."""

    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_layers: int = 22
    num_heads: int = 32
    num_kv_heads: int = 4
    vocab_size: int = 32000
    max_position: int = 2048

    @property
    def num_parameters(self) -> int:
        head_dim = self.hidden_size // self.num_heads
        attn = self.hidden_size * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * self.hidden_size

    def hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        }


TINY = RandomLlama(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    vocab_size=512, max_position=256,
)  # fmt: skip


def write_random_llama(
    out_dir: Path, shape: RandomLlama, device: torch.device, seed: int = 0
) -> Path:
    """Save a random-weight checkpoint (bf16, std 0.02 like a fresh init; norms 1) and a
    synthetic tokenizer into out_dir. Weights are drawn on `device` (fast on a GPU)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    tensors = _random_tensors(shape, device, seed)
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_word_tokenizer(out_dir, shape.vocab_size)
    (out_dir / "densa-random-llama.json").write_text(json.dumps(asdict(shape)))
    return out_dir


def _random_tensors(shape: RandomLlama, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    head_dim = shape.hidden_size // shape.num_heads
    hidden, inter = shape.hidden_size, shape.intermediate_size

    def normal(*size: int) -> torch.Tensor:
        values = torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02
        return values.to(torch.bfloat16).cpu()

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(shape.vocab_size, hidden),
        "model.norm.weight": ones(hidden),
        "lm_head.weight": normal(shape.vocab_size, hidden),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(shape.num_heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(shape.num_kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(shape.num_kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, shape.num_heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
    return tensors


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the made-up words t0 .. t{V-1}; <s> = 1, </s> = 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {**specials, **{f"t{i}": i for i in range(len(specials), vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(out_dir))
