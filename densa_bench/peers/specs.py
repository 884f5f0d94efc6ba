"""The named peers of `densa bench peers`: one builder per engine configuration, in a registry.

Equal bits is the comparison that matters at batch 1 (decode streams every weight once per
token): the bundled GGUF stores its linear layers as Q4_1 (4-bit codes in blocks of 32 with an
fp16 scale and minimum) and its tied embedding / output head as Q8_0 (8-bit, blocks of 32, fp16
scale). densa's default loads exactly those bits (w4a8 layers, a w8 head); llama.cpp and densa
both quantize activations to int8 per 32 values for the layers, and densa keeps the head's
activations in float32 (--head-format w8a8 matches llama.cpp there too). fp32 is the reference.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from densa.utils.cpu import ISA_ENV
from densa_bench.peers.servers import PeerSpec

# An AVX2-only machine's code paths on any x86 machine: densa's kernels (ISA_ENV) and torch's
# own (aten's vectorized kernels, MKL's GEMMs, oneDNN), so an AVX2 peer runs no AVX-512 code.
AVX2_ENV = {
    ISA_ENV: "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

LLAMA_SERVER_HINT = "build it with `scripts/setup.sh peers` or pass --llama-server PATH"


@dataclass(frozen=True)
class PeerContext:
    """What every builder may need: the model in each engine's form, tools, machine limits."""

    gguf: Path  # the GGUF every peer serves (llama.cpp reads it as is)
    hf_dir: Path  # densa's directory for it (config, tokenizer; a float32 copy on request)
    llama_server: Path | None
    threads: int
    max_concurrency: int  # slots / sequences each server must hold at once
    context_len: int  # tokens per request (prompt + output) the servers must fit
    output_len: int  # tokens every request must produce (EOS ignored)

    @property
    def model_id(self) -> str:
        return self.gguf.stem

    @property
    def llama_kv_bytes(self) -> int:
        """Bytes of llama-server's KV cache for its context (f16 K and V, `-c` tokens in all):
        densa gets the same memory for its pages, in whatever KV format it runs."""
        config = json.loads((self.hf_dir / "config.json").read_text())
        kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = config["num_hidden_layers"] * kv_heads * head_dim * 2 * 2  # K and V, 2 bytes
        return per_token * self.max_concurrency * self.context_len

    def stored_types(self) -> dict[str, str]:
        """The file's own types, to label rows: {"linear": "Q4_K", "head": "Q6_K"} (the most
        common type of its linear layers; the output head's, or the tied embedding's)."""
        from densa.model.gguf import stored_quantization

        stored = stored_quantization(self.hf_dir)
        return {k: str(stored.get(k) or "?") for k in ("linear", "head")}


def _labelled(formats: dict[str, str], ctx: PeerContext) -> dict[str, str]:
    """Formats with {linear} / {head} filled in with the file's own types."""
    return {key: value.format(**ctx.stored_types()) for key, value in formats.items()}


Builder = Callable[[PeerContext], PeerSpec]


def _densa(
    name: str, extra_args: list[str], formats: dict[str, str], env: dict[str, str] | None = None
) -> Builder:
    def build(ctx: PeerContext) -> PeerSpec:
        argv = [sys.executable, "-m", "densa.cli", "serve", "--port", "{port}"]
        argv += ["--served-model-name", ctx.model_id, "--max-num-seqs", str(ctx.max_concurrency)]
        # The KV memory llama-server has (same bytes; INT8 pages hold ~2x its tokens in them).
        kv_mib = -(-ctx.llama_kv_bytes // 2**20)
        argv += ["--max-model-len", str(ctx.context_len), "--kv-cache-memory", f"{kv_mib}MiB"]
        return PeerSpec(
            name=name,
            engine="densa",
            argv=tuple(argv + [str(ctx.gguf) if arg == "{gguf}" else arg for arg in extra_args]),
            model=ctx.model_id,
            formats=_labelled(formats, ctx),
            extra_body={"ignore_eos": True},
            env={"OMP_NUM_THREADS": str(ctx.threads), **(env or {})},
        )

    return build


def llama_cpp(ctx: PeerContext) -> PeerSpec:
    if ctx.llama_server is None or not ctx.llama_server.exists():
        raise FileNotFoundError(f"llama-server not found: {LLAMA_SERVER_HINT}")
    slots = ctx.max_concurrency
    argv = [str(ctx.llama_server), "-m", str(ctx.gguf), "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["-t", str(ctx.threads), "-tb", str(ctx.threads), "-np", str(slots)]
    # One context per slot, each large enough for a request (llama-server splits -c over slots).
    argv += ["-c", str(slots * ctx.context_len), "--alias", ctx.model_id, "--no-webui"]
    types = ctx.stored_types()
    return PeerSpec(
        name=f"llama.cpp {types['linear']}",
        engine="llama.cpp",
        argv=tuple(argv),
        model=ctx.model_id,
        formats={
            "linear": types["linear"],
            "head": types["head"],
            "kv": "f16",
            "compute": "int8 dot (activations Q8 per 32)",
        },
        extra_body={"ignore_eos": True, "cache_prompt": False},
        ready_path="/health",
    )


def _transformers(name: str, env: dict[str, str] | None = None) -> Builder:
    def build(ctx: PeerContext) -> PeerSpec:
        from densa.model.gguf import ensure_dense_copy

        cli = shutil.which("transformers", path=str(Path(sys.executable).parent))
        if cli is None:
            raise FileNotFoundError("the `transformers` command is missing next to this Python")
        ensure_dense_copy(ctx.hf_dir)  # transformers reads a float32 copy of the GGUF
        argv = [cli, "serve", str(ctx.hf_dir), "--continuous-batching", "--device", "cpu"]
        argv += ["--dtype", "float32", "--host", "127.0.0.1", "--port", "{port}"]
        # Exactly output_len greedy tokens (it has no ignore_eos; min_new_tokens does the same).
        generation = {"do_sample": False, "min_new_tokens": ctx.output_len}
        return PeerSpec(
            name=name,
            engine="transformers",
            argv=tuple(argv),
            model=str(ctx.hf_dir),
            formats={"linear": "fp32", "head": "fp32", "kv": "fp32 (paged)", "compute": "fp32"},
            extra_body={"generation_config": json.dumps(generation)},
            env={"OMP_NUM_THREADS": str(ctx.threads), **(env or {})},
            ready_path="/health",
        )

    return build


transformers = _transformers("transformers fp32")


DENSA_FP32 = {"linear": "fp32", "head": "fp32", "kv": "fp32", "compute": "fp32"}
# scripts/serve.sh adds these to `densa serve` (docs/kv-cache.md, "The default").
SERVE_SH_ARGS = ["--kv-cache-dtype", "int8"]
DENSA_DEFAULT = {  # {linear} / {head}: the file's own types (PeerContext.stored_types)
    "linear": "the GGUF's own {linear} blocks (w4a8 / w5a8 / w6a8 / w8 kernels: docs/models.md)",
    "head": "the GGUF's {head} blocks (w8 with float activations if Q8_0)",
    "kv": "int8, an fp16 scale per row",
    "compute": "int8 dot (activations Q8 per 32); head in fp32",
}
DENSA_LLAMA_NUMERICS = {
    **DENSA_DEFAULT,
    "head": "w8a8: the GGUF's {head} bits",
    "compute": "int8 dot",
}

PEERS: dict[str, Builder] = {
    "llama.cpp": llama_cpp,
    "transformers": transformers,
    # torch on its AVX2 code paths (MKL, aten, oneDNN), the peer of densa-avx2.
    "transformers-avx2": _transformers("transformers fp32 (AVX2)", AVX2_ENV),
    # What scripts/serve.sh starts: the bundled GGUF with its auto formats, INT8 KV pages.
    "densa": _densa("densa (default)", ["--model", "{gguf}", *SERVE_SH_ARGS], DENSA_DEFAULT),
    # llama.cpp's numerics exactly: int8 activations for the head too.
    "densa-w8a8-head": _densa(
        "densa w8a8 head",
        ["--model", "{gguf}", *SERVE_SH_ARGS, "--head-format", "w8a8"],
        DENSA_LLAMA_NUMERICS,
    ),
    # The engine core in the server's process (a thread) instead of its own: the split's cost.
    "densa-thread": _densa(
        "densa single process",
        ["--model", "{gguf}", *SERVE_SH_ARGS, "--engine-placement", "thread"],
        DENSA_DEFAULT,
    ),
    # The default on the AVX2 code paths (its kernels' and torch's), on any x86 machine.
    "densa-avx2": _densa(
        "densa (default, AVX2 kernels)",
        ["--model", "{gguf}", *SERVE_SH_ARGS],
        DENSA_DEFAULT,
        env=AVX2_ENV,
    ),
    "densa-fp32": _densa(
        "densa fp32",
        ["--model", "{gguf}", "--weight-format", "dense", "--head-format", "dense"],
        DENSA_FP32,
    ),
}
DEFAULT_PEERS = ("llama.cpp", "densa", "densa-fp32", "transformers")


def build_specs(names: list[str], ctx: PeerContext) -> list[PeerSpec]:
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    return [PEERS[name](ctx) for name in names]
