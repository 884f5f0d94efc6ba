"""GGUF reading: a GGUF written the way llama.cpp's converter writes it (Q/K rows permuted) converts
back to exactly the original weights; bad files fail with a clear message."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from densa.model import gguf as gguf_module
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.checkpoint_files import safetensors_files
from densa.model.gguf import convert_gguf, converted_dir_for, ensure_converted, ensure_dense_copy
from densa.model.loader import resolve_model_dir
from densa.setup.args import default_model_path

from .helpers import densa_logits, hf_logits

HF_TO_GGUF = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: Path) -> dict[str, Any]:
    """The tokenizer fields of a GGUF file, read once per process (a 49k-token vocabulary and
    its merges take seconds to turn into Python lists, and the suite writes dozens of files)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(source)).fields
    names = ("model", "pre", "tokens", "token_type", "merges")
    found = {name: fields[f"tokenizer.ggml.{name}"].contents() for name in names}
    return {**found, "chat_template": fields["tokenizer.chat_template"].contents()}


def copy_tokenizer_fields(writer, source: Path) -> None:  # type: ignore[no-untyped-def]
    fields = _tokenizer_fields(source)
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(fields["chat_template"])


def write_gguf(hf_dir: Path, out_path: Path) -> None:
    import gguf

    arch = ArchConfig.from_dir(hf_dir)
    weights = {k: v.numpy() for k, v in load_file(str(safetensors_files(hf_dir)[0])).items()}
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    copy_tokenizer_fields(writer, Path(default_model_path()))
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for layer in range(arch.num_layers):
        for hf_name, gguf_name in HF_TO_GGUF.items():
            tensor = weights[f"model.layers.{layer}.{hf_name}"]
            if hf_name.startswith("self_attn.q_proj"):
                tensor = llama_cpp_permute(tensor, arch.num_heads)
            elif hf_name.startswith("self_attn.k_proj"):
                tensor = llama_cpp_permute(tensor, arch.num_kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}", np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_model_dir, path)
    return path


def test_conversion_restores_the_original_weights(
    tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    convert_gguf(tiny_gguf, tmp_path, dense=True)
    original = load_file(str(safetensors_files(tiny_model_dir)[0]))
    converted = load_file(str(tmp_path / "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    arch = ArchConfig.from_dir(tmp_path)
    assert (arch.num_heads, arch.num_kv_heads, arch.tie_word_embeddings) == (4, 2, False)


def test_converted_gguf_runs_like_the_source_model(
    tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model_dir(str(tiny_gguf))
    assert model_dir.is_relative_to(tmp_path)
    assert resolve_model_dir(str(tiny_gguf)) == model_dir  # cached: converted once
    assert not list(model_dir.glob("*.safetensors"))  # densa reads the GGUF file itself
    tokens = [1, 520, 9531, 198, 27, 1256]
    torch.testing.assert_close(densa_logits(model_dir, tokens), hf_logits(tiny_model_dir, tokens))


def test_dense_copy_only_on_request(
    tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model_dir(str(tiny_gguf))
    assert ensure_dense_copy(model_dir) == model_dir
    copy = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in load_file(str(safetensors_files(tiny_model_dir)[0])).items():
        assert torch.equal(copy[name], tensor), name
    assert not list(model_dir.glob(".*partial"))


def test_a_conversion_another_process_finished_first_is_used(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes opening one new file both convert it; the one that renames second finds
    the other's directory in place (ENOTEMPTY) and must use it, not fail."""
    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path))
    out_dir = converted_dir_for(tiny_gguf)

    def convert_while_another_process_wins(path: Path, dst: Path, *args: object) -> None:
        out_dir.mkdir()  # the other process, finishing first
        convert_gguf(path, out_dir)
        convert_gguf(path, dst)

    monkeypatch.setattr(gguf_module, "convert_gguf", convert_while_another_process_wins)
    assert ensure_converted(tiny_gguf) == out_dir
    assert (out_dir / "config.json").is_file()
    assert [p.name for p in out_dir.parent.iterdir()] == [out_dir.name]  # no temporary left


def test_truncated_gguf_is_a_clear_error(tiny_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        convert_gguf(broken, tmp_path / "out")


def test_missing_and_wrong_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ArchConfig.from_dir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        safetensors_files(tmp_path)


GEMMA3_TO_GGUF = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_gemma3_gguf(hf_dir: Path, out_path: Path) -> None:
    """What llama.cpp's converter does for Gemma 3: no Q/K permutation, norm weights stored as
    1 + w, a 6-layer sliding pattern and the local RoPE base left to the reader."""
    import gguf

    arch = ArchConfig.from_dir(hf_dir)
    weights = {k: v.numpy() for k, v in load_file(str(safetensors_files(hf_dir)[0])).items()}
    writer = gguf.GGUFWriter(str(out_path), "gemma3")
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_sliding_window(8)
    copy_tokenizer_fields(writer, Path(default_model_path()))

    def add(name: str, tensor: np.ndarray) -> None:
        if name.endswith("norm.weight"):
            tensor = tensor + np.float32(1.0)
        writer.add_tensor(name, np.ascontiguousarray(tensor))

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    for layer in range(arch.num_layers):
        for hf_name, gguf_name in GEMMA3_TO_GGUF.items():
            add(f"blk.{layer}.{gguf_name}", weights[f"model.layers.{layer}.{hf_name}"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma3_gguf_round_trip(tmp_path: Path) -> None:
    from tests.tiny_families import save_tiny

    # 6 layers: five local ones (window 8) and a global one, as llama.cpp assumes for Gemma 3.
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    source = save_tiny(
        "gemma3", tmp_path / "hf", seed=1, num_hidden_layers=6, layer_types=layers,
        query_pre_attn_scalar=16,  # = head_dim, what llama.cpp assumes below Gemma 3 27B
    )  # fmt: skip
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(source, path)
    (tmp_path / "converted").mkdir()
    convert_gguf(path, tmp_path / "converted", dense=True)
    original = load_file(str(safetensors_files(source)[0]))
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():  # norms come back to 0-centred weights exactly
        torch.testing.assert_close(converted[name], tensor, atol=1e-7, rtol=0, msg=name)
    arch = ArchConfig.from_dir(tmp_path / "converted")
    assert arch.layer_windows == (8, 8, 8, 8, 8, None) and arch.local_rope_theta == 10000.0
    assert arch.query_scale == arch.head_dim**-0.5 and arch.tie_word_embeddings
    tokens = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12]
    torch.testing.assert_close(
        densa_logits(tmp_path / "converted", tokens),
        hf_logits(source, tokens),
        atol=2e-4,
        rtol=1e-4,
    )
