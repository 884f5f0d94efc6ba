"""Every native and Numba kernel lets other Python threads run while it computes.

The engine's heartbeat is a Python thread: a kernel call that keeps the GIL for seconds (a real
model's step) would silence it, and the front would take a healthy engine for a dead one
(issue 21). Each test runs one deliberately long call (~TARGET_S seconds, sized on this machine)
while a second thread ticks every millisecond, and asserts the ticker was never held up for long.
A kernel that keeps the GIL holds the ticker for the whole call.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from numba.core.registry import CPUDispatcher

import densa
from densa.kernels.cpu import native

TARGET_S = 2.0  # how long each kernel call is made to run
MAX_GAP_S = 0.3  # the longest the ticker may wait (the front's heartbeat deadline is 3 s)

needs_native = pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")


def _longest_stall(call: Callable[[], object]) -> tuple[float, float]:
    """Run `call` on this thread while another ticks every 1 ms -> (how long the call took,
    the longest the ticker went without a tick during it)."""
    stop = threading.Event()
    ticks: list[float] = []

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.05)  # the ticker is running
    start = time.monotonic()
    call()
    end = time.monotonic()
    stop.set()
    ticker.join()
    inside = [start, *(t for t in ticks if start < t < end), end]
    return end - start, max(b - a for a, b in itertools.pairwise(inside))


def _size(make: Callable[[int], Callable[[], object]], max_n: int) -> int:
    """make(n) returns a call whose work grows linearly with n: the n that takes ~TARGET_S here
    (at most max_n), scaled from the first size whose second run takes 0.2 s (a first run at a
    new size also grows buffers)."""
    make(1)()  # compile / warm up
    n, took = 1, 0.0
    while took < 0.2 and n < max_n:
        n = min(max_n, 2 * n)
        call = make(n)
        call()
        start = time.monotonic()
        call()
        took = time.monotonic() - start
    return min(max_n, max(n, round(n * TARGET_S / took)))


def _assert_releases_the_gil(
    make: Callable[[int], Callable[[], object]], max_n: int = 1 << 20
) -> None:
    n = _size(make, max_n)
    for _ in range(3):  # the machine is shared: a sizing run slowed down by others sizes short
        duration, stall = _longest_stall(make(n))
        if duration > 2 * MAX_GAP_S or n == max_n:
            break
        n = min(max_n, round(n * TARGET_S / duration))
    assert duration > 2 * MAX_GAP_S, f"the call took only {duration:.2f} s: size it up"
    assert stall < MAX_GAP_S, (
        f"another thread could not run for {stall:.2f} s of a {duration:.2f} s kernel call: "
        "the kernel holds the GIL"
    )


# ---- C++ (densa/kernels/cpu/csrc) -------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("bits", [4, 8, 80])
def test_quantized_matmuls_release_the_gil(bits: int) -> None:
    from densa.kernels.cpu import qgemm

    n, k = 2048, 2048
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001
    isa = native.isa()
    if bits == 4:
        weight = qgemm.pack_w4(codes, d, torch.zeros_like(d), isa)
    elif bits == 8:
        weight = qgemm.pack_w8(codes.to(torch.int8), d, isa)
    else:
        weight = qgemm.pack_w8_float(codes.to(torch.int8), d, isa)

    def make(n_calls: int) -> Callable[[], object]:
        x = torch.randn(64 * n_calls, k, generator=gen)  # rows: the work of one call
        return lambda: qgemm.quantized_linear(x, weight)

    _assert_releases_the_gil(make)


class _DecoderCase:
    """A C++ Decoder over random dense weights (2 layers, hidden 1024) and fp32 KV pages."""

    HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE, VOCAB = 1024, 4096, 16, 2, 64, 1, 1000
    MAX_ROWS = 32768  # one KV page (one slot) per row

    def __init__(self) -> None:

        ext = native.load()
        assert ext is not None
        h, d = self.HIDDEN, self.HEAD_DIM
        gen = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * 0.05

        shape = (h, self.INTER, self.HEADS, self.KV_HEADS, d, 1e-5)
        cos, sin = torch.ones(64, d), torch.zeros(64, d)
        self.decoder = ext.Decoder(
            shape, native.isa(), rand(self.VOCAB, h), torch.ones(h), cos, sin, native.fp8_table()
        )
        self.num_pages = self.MAX_ROWS
        qkv_out = (self.HEADS + 2 * self.KV_HEADS) * d
        for _ in range(2):
            k = torch.zeros(self.num_pages, self.KV_HEADS, self.PAGE, d)
            self.decoder.add_layer(
                torch.ones(h), torch.ones(h),
                (32, rand(qkv_out, h), None, qkv_out, h),
                (32, rand(h, self.HEADS * d), None, h, self.HEADS * d),
                (32, rand(2 * self.INTER, h), None, 2 * self.INTER, h),
                (32, rand(h, self.INTER), None, h, self.INTER),
                k, None, k.clone(), None, None,
            )  # fmt: skip

    def forward(self, rows: int) -> Callable[[], object]:
        """One decode step of `rows` one-token sequences, each in a page of its own."""
        token_ids = torch.arange(rows) % self.VOCAB
        zeros = torch.zeros(rows, dtype=torch.long)
        page_table = torch.arange(rows, dtype=torch.int32).view(rows, 1)
        seq_lens = torch.ones(rows, dtype=torch.int32)
        slot_pages = torch.arange(rows)
        return lambda: self.decoder.forward(
            token_ids, zeros, page_table, seq_lens, slot_pages, zeros, None
        )

    def mlp(self, rows: int) -> Callable[[], object]:
        """The second half of a layer (prefill / mixed steps) over `rows` tokens."""
        attn = torch.randn(rows, self.HEADS * self.HEAD_DIM)
        x = torch.randn(rows, self.HIDDEN)
        return lambda: self.decoder.mlp(0, attn, x)


@needs_native
@pytest.mark.parametrize("half", ["forward", "mlp"])
def test_fused_decoder_releases_the_gil(half: str) -> None:
    case = _DecoderCase()
    make = case.forward if half == "forward" else case.mlp
    _assert_releases_the_gil(lambda n: make(16 * n), max_n=case.MAX_ROWS // 16)


# ---- Numba --------------------------------------------------------------------------------------
def _numba_dispatchers() -> list[tuple[str, CPUDispatcher]]:
    """Every @njit function defined anywhere in the densa package."""
    root = Path(densa.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "njit" not in text and "numba.jit" not in text:
            continue
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == name:
                found.append((f"{name}.{attr}", value))
    return found


def test_every_numba_kernel_is_compiled_nogil() -> None:
    dispatchers = _numba_dispatchers()
    assert len(dispatchers) >= 10  # the walk found the kernels
    holding = [name for name, fn in dispatchers if not fn.targetoptions.get("nogil")]
    assert holding == [], f"these Numba kernels keep the GIL while they run: {holding}"


# Numba releases the GIL itself inside a prange loop, but not in the serial code around it, and
# a kernel without prange (stores, masks) keeps it throughout unless compiled nogil.
def _streaming_matmul(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.streaming_matmul import streaming_matmul

    weight, x, out = _matmul_operands(n)
    return lambda: streaming_matmul(weight, x, out)


def _fp8_matmul(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.streaming_matmul import streaming_fp8_matmul

    weight, x, out = _matmul_operands(n)
    codes = np.full(weight.shape, 0x38, dtype=np.uint8)  # 1.0 in e4m3
    scale = np.ones((weight.shape[0], weight.shape[1] // 128), dtype=np.float32)
    return lambda: streaming_fp8_matmul(codes, scale, 128, x, out)


def _grouped_matmul(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.streaming_matmul import grouped_streaming_matmul

    weight, x, out = _matmul_operands(n)
    experts = np.array([0, 1], dtype=np.int64)
    bounds = np.array([0, x.shape[0] // 2, x.shape[0]], dtype=np.int64)
    stacked = np.stack([weight, weight])
    return lambda: grouped_streaming_matmul(stacked, x, experts, bounds, out)


def _matmul_operands(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [1024, 1024], x [8 n, 1024], out [8 n, 1024] (float32)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1024, 1024), dtype=np.float32)
    x = rng.standard_normal((8 * n, 1024), dtype=np.float32)
    return weight, x, np.empty((8 * n, 1024), dtype=np.float32)


def _paged_decode_attention(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.paged_attention import paged_decode_attention

    heads, kv_heads, head_dim, page, num_pages = 8, 2, 64, 16, 64
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_pages, kv_heads, page, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, kv_heads, page, head_dim, generator=gen)
    batch = 4 * n  # every sequence reads all the pages: 1024 cached tokens each
    query = torch.randn(batch, heads, head_dim, generator=gen)
    table = torch.arange(num_pages, dtype=torch.int32).repeat(batch, 1)
    lens = torch.full((batch,), num_pages * page, dtype=torch.int32)
    return lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)


def _fp8_store(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.fp8_kv_store import store_exponent_kernel

    tokens, heads, head_dim = 4096 * n, 8, 128
    row = np.random.default_rng(0).standard_normal((1, heads, head_dim), dtype=np.float32)
    x = np.broadcast_to(row, (tokens, heads, head_dim))  # many tokens, one row of memory
    cache = np.zeros((1, heads, 1, head_dim), dtype=np.uint8)
    exponents = np.zeros((1, heads, 1), dtype=np.int8)
    slots = np.zeros(tokens, dtype=np.int64)  # all into one slot: serial, so no race
    return lambda: store_exponent_kernel(x, cache, exponents, slots, slots)


def _token_bitmask(n: int) -> Callable[[], object]:
    from densa.kernels.cpu.token_bitmask import compiled_apply

    vocab, rows = 65536, 256 * n
    logits = np.zeros((1, vocab), dtype=np.float32)
    words = np.zeros((1, vocab // 32), dtype=np.int32)  # every token disallowed: all written
    bitmask = np.broadcast_to(words, (rows, vocab // 32))
    return lambda: compiled_apply()(logits, bitmask, np.zeros(rows, dtype=np.int64))


@pytest.mark.parametrize(
    "make",
    [_streaming_matmul, _fp8_matmul, _grouped_matmul, _paged_decode_attention, _fp8_store,
     _token_bitmask],
    ids=lambda make: make.__name__.strip("_"),
)  # fmt: skip
def test_numba_kernels_release_the_gil(make: Callable[[int], Callable[[], object]]) -> None:
    _assert_releases_the_gil(make)
