"""GET /densa/info and /densa/load: what a router learns from a worker."""

from __future__ import annotations

import httpx

from densa.ipc.messages import TokenizerFiles
from densa.text.tokenizer import Tokenizer

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer


def test_info_carries_the_tokenizer_and_page_size_the_prefix_cache_uses(
    server: RunningServer,
) -> None:
    info = httpx.get(server.base_url + "/densa/info", timeout=5).json()
    assert info["model"] == MODEL_NAME and info["max_model_len"] == MAX_MODEL_LEN
    assert info["page_size"] == server.stats.page_size == 16
    assert info["tool_call_format"] == "hermes"
    files = TokenizerFiles(**info["tokenizer"])
    messages = [{"role": "user", "content": "Hello there"}]
    assert Tokenizer(files).encode_chat(messages) == server.tokenizer.encode_chat(messages)


def test_load_reports_queue_and_free_pages(server: RunningServer) -> None:
    server.wait_idle()
    load = httpx.get(server.base_url + "/densa/load", timeout=5).json()
    assert load["num_in_flight"] == load["num_running"] == load["num_waiting"] == 0
    assert load["num_free_kv_pages"] == load["num_kv_pages"] == server.stats.num_kv_pages > 0
    assert load["engine_pid"] == server.engine.served.engine_pid
