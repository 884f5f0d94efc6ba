"""The packed CPU formats: made from the bundled GGUF's dequantized weights they recover its very
Q4_1 / Q8_0 blocks, and PackedLinear computes what its float64 reference does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densa.kernels.cpu import native, qgemm
from densa.model.packed_linear import PackedLinear, quantize_q4_1, reference_linear
from densa.setup.args import default_model_path


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, tuple[np.ndarray, str]]:
    """Raw blocks and type of the two tensors the tests read (the first 512 rows of each)."""
    from gguf import GGUFReader

    reader = GGUFReader(default_model_path())
    wanted = {"blk.0.ffn_down.weight", "token_embd.weight"}
    return {
        t.name: (np.asarray(t.data[:512]).copy(), t.tensor_type.name)
        for t in reader.tensors
        if t.name in wanted
    }


def _dequantized(raw: np.ndarray, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)
    return torch.from_numpy(values.reshape(raw.shape[0], -1).copy())


def test_q4_1_blocks_come_back_exactly(gguf_tensors: dict) -> None:
    """Q4_1 block = fp16 d, fp16 m, 16 bytes (element j low nibble, j + 16 high nibble)."""
    raw, kind = gguf_tensors["blk.0.ffn_down.weight"]
    assert kind == "Q4_1"
    blocks = raw.reshape(raw.shape[0], -1, 20)  # [rows, groups, 20 bytes]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(blocks[..., 4:].copy())  # [rows, groups, 16]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(raw.shape[0], -1)
    got_codes, got_d, got_m = quantize_q4_1(_dequantized(raw, kind))
    assert torch.equal(got_d, d) and torch.equal(got_m, m)
    assert torch.equal(got_codes, codes)


def test_q8_0_blocks_come_back_exactly(gguf_tensors: dict) -> None:
    """Q8_0 block = fp16 d, 32 int8 codes: the tied embedding / output head."""
    rows, kind = gguf_tensors["token_embd.weight"]
    assert kind == "Q8_0"
    blocks = rows.reshape(rows.shape[0], -1, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows.shape[0], -1)
    got_codes, got_d = qgemm.quantize_w8(_dequantized(rows, kind))
    assert torch.equal(got_d, d) and torch.equal(got_codes, codes)


@pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")
@pytest.mark.parametrize("fmt", ["w4a8", "w8a8", "w8"])
def test_packed_linear_matches_reference(fmt: str) -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    bias = torch.randn(48)
    layer = PackedLinear(fmt, weight, bias)
    x = torch.randn(2, 3, 96)  # any leading shape
    got = layer(x)
    want = reference_linear(x.reshape(-1, 96), weight, fmt).view(2, 3, 48) + bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_auto_keeps_a_ggufs_own_bits_where_kernels_run(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import json

    from densa.model import loader
    from densa.model.gguf import QUANTIZATION_FILE

    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (tmp_path / QUANTIZATION_FILE).write_text(json.dumps({"linear": "Q4_1", "head": "Q8_0"}))
    monkeypatch.setattr(loader.native, "is_available", lambda: True)
    assert loader.auto_formats("m.gguf", tmp_path, "auto", "auto") == ("w4a8", "w8")
    assert loader.auto_formats("m.gguf", tmp_path, "dense", "auto") == ("dense", "w8")
    assert loader.auto_formats("m.gguf", tmp_path, "auto", "dense") == ("w4a8", "dense")
    # An HF directory (even a GGUF's converted copy, as tests compare it with transformers)
    # keeps its checkpoint's format.
    assert loader.auto_formats(str(tmp_path), tmp_path, "auto", "auto") == ("auto", "dense")
    # A Q4_K_M file: its layers keep their blocks under `auto` (gguf_loading); an untied head
    # keeps its own (HEAD_FROM_BLOCKS), a tied one is the embedding, which Q6_K cannot pack.
    (tmp_path / QUANTIZATION_FILE).write_text(json.dumps({"linear": "Q4_K", "head": "Q6_K"}))
    assert loader.auto_formats("m.gguf", tmp_path, "auto", "auto") == ("blocks", "dense")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert loader.auto_formats("m.gguf", tmp_path, "auto", "auto") == ("blocks", "blocks")
    monkeypatch.setattr(loader.native, "is_available", lambda: False)
    (tmp_path / QUANTIZATION_FILE).write_text(json.dumps({"linear": "Q4_1", "head": "Q8_0"}))
    assert loader.auto_formats("m.gguf", tmp_path, "auto", "auto") == ("auto", "dense")


def test_the_bundled_gguf_records_q4_1_layers_and_a_q8_0_head() -> None:
    from densa.model.gguf import stored_quantization
    from densa.model.loader import resolve_model_dir

    assert stored_quantization(resolve_model_dir(default_model_path())) == {
        "linear": "Q4_1",
        "head": "Q8_0",
    }
