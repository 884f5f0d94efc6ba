"""The kernel half of the GPU check: each Triton kernel against its torch reference, then timed
against the HBM roofline (bytes the kernel must move / time, as a fraction of the bandwidth).

Bytes counted are the compulsory ones: K/V pages (and FP8 scales) for attention; packed weights,
scales and activations for the matmuls. Weight-streaming kernels are timed over enough distinct
weight copies to exceed the L2 cache (60 MB on an H200), as a decode step streams every layer.

`Sizes.tiny()` runs the same code in seconds on a CPU through Triton's interpreter (the dry run
the suite keeps green); its times are not measurements.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from densa.kernels.cpu.int4_linear import int4_linear_ref
from densa.kernels.reference import paged_attention as ref
from densa.quant import int4
from densa_bench.gpu.timing import (
    GOALS,
    TIMING_RESERVE_S,
    KernelResults,
    Sizes,
    TimeLeft,
    compare,
    time_ms,
    timing_row,
)


# ---- attention ---------------------------------------------------------------------------------
@dataclass
class PagedCase:
    query: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        tokens = int(self.seq_lens.sum())
        _, heads, _, dim = self.k.shape
        per_token = 2 * heads * (dim * self.k.element_size())
        if self.k_scale is not None and self.k_scale.dim() == 3:
            per_token += 2 * heads * self.k_scale.element_size()
        return tokens * per_token


def paged_case(
    seq_lens: list[int], query_lens: list[int], sizes: Sizes, kv: str, device: torch.device
) -> PagedCase:
    """Random K/V written into shuffled pages with densa's own store (FP8: dynamic scales)."""
    from densa.kernels.triton.kv_store import store_kv

    num_heads, num_kv_heads, head_dim = sizes.heads
    page = sizes.page_size
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_per_seq)
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    shape = (num_pages, num_kv_heads, page, head_dim)
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros(shape, dtype=dtype, device=device)
    k_scale = v_scale = None
    if kv == "fp8":
        k_scale = torch.zeros(shape[:3], dtype=torch.int8, device=device)
        v_scale = torch.zeros(shape[:3], dtype=torch.int8, device=device)
    order = torch.randperm(num_pages, device=device)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        table[i, :n] = order[used : used + n].to(torch.int32)
        used += n
        positions = torch.arange(seq_len, device=device)
        slot_pages = table[i].long()[positions // page]
        for cache, scale in ((k, k_scale), (v, v_scale)):
            values = torch.randn(seq_len, num_kv_heads, head_dim, device=device)
            store_kv(cache, scale, slot_pages, positions % page, values)
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=device)
    return PagedCase(
        query.to(torch.bfloat16) if device.type == "cuda" else query, k, v, k_scale, v_scale,
        table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(query_lens, dtype=torch.int32, device=device),
    )  # fmt: skip


def _reference(case: PagedCase, sm_scale: float) -> torch.Tensor:
    """paged_attention_reference on the CPU, in float32."""

    def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu()

    return ref.paged_attention_reference(
        case.query.float().cpu(), case.k.cpu(), case.v.cpu(), case.page_table.cpu(),
        case.seq_lens.cpu(), case.query_lens.cpu(), sm_scale, cpu(case.k_scale),
        cpu(case.v_scale),
    )  # fmt: skip


def check_attention(
    sizes: Sizes, device: torch.device, results: KernelResults, time_left: TimeLeft
) -> None:
    from densa.kernels.triton.decode_attention import paged_decode_attention
    from densa.kernels.triton.prefill_attention import paged_prefill_attention

    sm_scale = sizes.heads[2] ** -0.5
    tol = 2e-2 if device.type == "cuda" else 1e-4  # bf16 queries on the GPU
    lens = list(sizes.check_lens)
    for kv in ("bf16", "fp8"):
        case = paged_case(lens, [1] * len(lens), sizes, kv, device)
        got = paged_decode_attention(
            case.query, case.k, case.v, case.page_table, case.seq_lens, sm_scale,
            case.k_scale, case.v_scale,
        )  # fmt: skip
        results.correctness.append(
            compare("decode_attention", f"{kv} lens={lens}", got, _reference(case, sm_scale), tol)
        )
        query_lens = [max(1, n // 3) for n in lens]
        case = paged_case(lens, query_lens, sizes, kv, device)
        got = paged_prefill_attention(
            case.query, case.k, case.v, case.page_table, case.seq_lens, case.query_lens,
            sm_scale, case.k_scale, case.v_scale, max_query_len=max(query_lens),
        )  # fmt: skip
        expected = _reference(case, sm_scale)
        results.correctness.append(
            compare("prefill_attention", f"{kv} q={query_lens}", got, expected, tol)
        )


def time_attention(
    sizes: Sizes, device: torch.device, results: KernelResults, time_left: TimeLeft
) -> None:
    from densa.kernels.triton.decode_attention import paged_decode_attention
    from densa.model.attention import gather_dequantized

    sm_scale = sizes.heads[2] ** -0.5
    for num_seqs, context in sizes.decode_shapes:
        if time_left() < TIMING_RESERVE_S:
            results.skipped.append(f"kernels: decode attention B={num_seqs} (time)")
            continue
        for kv in ("bf16", "fp8"):
            case = paged_case([context] * num_seqs, [1] * num_seqs, sizes, kv, device)
            q = case.query

            def run(case: PagedCase = case, q: torch.Tensor = q) -> torch.Tensor:
                return paged_decode_attention(
                    q, case.k, case.v, case.page_table, case.seq_lens, sm_scale,
                    case.k_scale, case.v_scale,
                )  # fmt: skip

            def torch_path(case: PagedCase = case) -> None:  # the torch backend's read
                gather_dequantized(case.k, case.k_scale, case.page_table, torch.bfloat16)
                gather_dequantized(case.v, case.v_scale, case.page_table, torch.bfloat16)

            ms = time_ms(run, device)
            baseline = time_ms(torch_path, device) if num_seqs * context <= 64 * 4096 else None
            results.timings.append(
                timing_row(
                    f"decode_attention_{kv}",
                    f"B={num_seqs} ctx={context} heads={sizes.heads}",
                    ms,
                    case.kv_bytes,
                    torch_gather_ms=baseline,
                    goal=GOALS.get(f"decode_attention_{kv}"),
                )
            )
            del case


# ---- matmuls -----------------------------------------------------------------------------------
def check_linears(
    sizes: Sizes, device: torch.device, results: KernelResults, time_left: TimeLeft
) -> None:
    from densa.kernels.cpu.fp8_linear import fp8_linear_ref
    from densa.kernels.triton.fp8_linear import fp8_linear_triton
    from densa.kernels.triton.int4_linear import int4_linear_triton
    from densa.quant import fp8_weights
    from densa.quant.weight_format import WeightFormat

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_features, in_features = 320, 1152  # partial tiles, 9 groups of 128
    weight = torch.randn(out_features, in_features)
    for symmetric in (True, False):
        fmt = WeightFormat("int4", group_size=128, symmetric=symmetric)
        parts = {k: t.to(device) for k, t in int4.quantize_rtn(weight, fmt).items()}
        for rows in (1, 7, 64):
            x = torch.randn(rows, in_features, device=device).to(dtype)
            args = (parts["qweight"], parts["scales"], parts.get("zeros"), 128)
            got = int4_linear_triton(x, *args)
            cpu_parts = {k: t.cpu() for k, t in parts.items()}
            expected = int4_linear_ref(
                x.cpu(), cpu_parts["qweight"], cpu_parts["scales"], cpu_parts.get("zeros"), 128
            )
            name = "int4_linear_" + ("sym" if symmetric else "asym")
            results.correctness.append(compare(name, f"{dtype} M={rows}", got, expected, 2e-2))
    fp8_parts = fp8_weights.to_runtime(fp8_weights.quantize_blocks(weight, 128), 128)
    fp8 = {k: t.to(device) for k, t in fp8_parts.items()}
    for rows in (1, 64):
        x = torch.randn(rows, in_features, device=device).to(dtype)
        got = fp8_linear_triton(x, fp8["weight"], fp8["weight_scale"], 128)
        expected = fp8_linear_ref(x.cpu(), fp8["weight"].cpu(), fp8["weight_scale"].cpu(), 128)
        results.correctness.append(compare("fp8_linear", f"{dtype} M={rows}", got, expected, 2e-2))


def time_linears(
    sizes: Sizes, device: torch.device, results: KernelResults, time_left: TimeLeft
) -> None:
    """INT4 and FP8 kernels vs the dense bf16 matmul (cuBLAS), over rotating weight copies."""
    from densa.kernels.triton.tuning import set_tuning

    for out_features, in_features in sizes.linear_shapes:
        for rows in sizes.linear_rows:
            if time_left() < TIMING_RESERVE_S:
                results.skipped.append(f"kernels: linear M={rows} N={out_features} (time)")
                continue
            # Tune (time every candidate config) for the GEMVs, the goal; heuristics elsewhere.
            set_tuning(rows == 1 and device.type == "cuda")
            try:
                results.timings += _time_linear(sizes, device, rows, out_features, in_features)
            finally:
                set_tuning(False)


def _time_linear(
    sizes: Sizes, device: torch.device, rows: int, out_features: int, in_features: int
) -> list[dict[str, Any]]:
    from densa.kernels.triton.fp8_linear import fp8_linear_triton
    from densa.kernels.triton.int4_linear import int4_linear_triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    groups = -(-in_features // 128)
    dense_bytes = out_features * in_features * 2
    copies = max(1, math.ceil(sizes.min_stream_bytes / (out_features * in_features // 2)))
    packed_shape = (copies, out_features, in_features // 2)
    qweight = torch.randint(0, 256, packed_shape, dtype=torch.uint8, device=device)
    scales = (torch.rand(copies, out_features, groups, device=device) * 0.01).to(dtype)
    fp8_weight = torch.randn(copies, out_features, in_features, device=device)
    fp8_weight = fp8_weight.to(torch.float8_e4m3fn)
    fp8_scale = torch.rand(copies, out_features, groups, device=device) * 0.01
    dense_copies = max(1, math.ceil(sizes.min_stream_bytes / dense_bytes))
    dense = torch.randn(dense_copies, out_features, in_features, device=device).to(dtype)
    x = torch.randn(rows, in_features, device=device).to(dtype)

    def int4_run() -> None:
        for c in range(copies):
            int4_linear_triton(x, qweight[c], scales[c], None, 128)

    def fp8_run() -> None:
        for c in range(copies):
            fp8_linear_triton(x, fp8_weight[c], fp8_scale[c], 128)

    def dense_run() -> None:
        for c in range(dense_copies):
            torch.nn.functional.linear(x, dense[c])

    dense_ms = time_ms(dense_run, device) / dense_copies
    int4_ms = time_ms(int4_run, device) / copies
    fp8_ms = time_ms(fp8_run, device) / copies
    act_bytes = rows * (in_features + out_features) * 2
    int4_bytes = out_features * in_features // 2 + scales[0].numel() * 2 + act_bytes
    fp8_bytes = out_features * in_features + fp8_scale[0].numel() * 4 + act_bytes
    shape = f"M={rows} N={out_features} K={in_features}"
    return [
        timing_row("dense_bf16_linear", shape, dense_ms, dense_bytes + act_bytes),
        timing_row("int4_linear", shape, int4_ms, int4_bytes, speedup_vs_dense=dense_ms / int4_ms,
                goal=GOALS["int4_gemv"] if rows == 1 else None),
        timing_row("fp8_linear", shape, fp8_ms, fp8_bytes, speedup_vs_dense=dense_ms / fp8_ms),
    ]  # fmt: skip


# ---- integrity ---------------------------------------------------------------------------------
def check_and_time_integrity(
    sizes: Sizes, device: torch.device, results: KernelResults, time_left: TimeLeft
) -> None:
    """The Triton tag check vs the torch one, host time per step (both read back a result)."""
    from densa.kernels.reference import integrity as torch_check
    from densa.kernels.triton import integrity as triton_check
    from densa.kernels.triton.common import require_triton

    require_triton()
    num_pages = 4 * sizes.tag_pairs
    tags = torch.arange(num_pages, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(0)
    page_ids = torch.randint(0, num_pages, (sizes.tag_pairs,), generator=gen).tolist()
    expected = list(page_ids)
    expected[len(expected) // 2] += num_pages  # one stale tag
    found = triton_check.mismatching_rows(tags, page_ids, expected)
    agrees = found == torch_check.mismatching_rows(tags, page_ids, expected)
    agrees = agrees and found == [len(expected) // 2]
    case = f"{sizes.tag_pairs} pairs, one stale"
    results.correctness.append({"kernel": "integrity_check", "case": case, "ok": agrees})
    for name, check in (("integrity_torch", torch_check), ("integrity_triton", triton_check)):
        start = time.perf_counter()
        for _ in range(50):
            check.mismatching_rows(tags, page_ids, page_ids)
        us = (time.perf_counter() - start) / 50 * 1e6
        results.timings.append({"kernel": name, "shape": f"{sizes.tag_pairs} pairs", "host_us": us})


Section = Callable[[Sizes, torch.device, KernelResults, TimeLeft], None]


def run_kernel_checks(sizes: Sizes, device: torch.device, time_left: TimeLeft) -> KernelResults:
    """Correctness first (cheap), then timings while the time budget lasts (each timing keeps
    TIMING_RESERVE_S back for the end-to-end sweep)."""
    results = KernelResults()
    sections: list[tuple[str, Section]] = [
        ("attention correctness", check_attention),
        ("linear correctness", check_linears),
        ("integrity", check_and_time_integrity),
        ("attention timings", time_attention),
        ("linear timings", time_linears),
    ]
    for name, section in sections:
        if time_left() < 10:
            results.skipped.append(f"kernels: {name} (time budget)")
            continue
        section(sizes, device, results, time_left)
    return results
