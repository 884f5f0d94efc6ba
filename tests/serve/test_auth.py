"""Optional API keys: /v1/* needs a listed key once keys are set; /health and /metrics stay open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.security import HTTPAuthorizationCredentials

from densa.cli import main
from densa.openai.errors import APIError
from densa.serve.auth import load_api_keys

from .support import MODEL_NAME, RunningServer

CHAT_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def chat(server: RunningServer, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/chat/completions", json=CHAT_BODY, headers=headers, timeout=30
    )


def test_wrong_or_missing_key_is_401(server: RunningServer, api_keys: Any) -> None:
    api_keys("key-one", "key-two")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic a2V5LW9uZQ=="}):
        response = chat(server, headers)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert "key" in error["message"]
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert chat(server, {"Authorization": "Bearer key-two"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="key-three").models.list()
    assert [m.id for m in server.client(api_key="key-one").models.list()] == [MODEL_NAME]


def test_health_and_metrics_need_no_key(server: RunningServer, api_keys: Any) -> None:
    api_keys("secret")
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/openapi.json").status_code == 200


def test_without_keys_any_key_is_accepted(server: RunningServer) -> None:
    assert chat(server, {"Authorization": "Bearer whatever"}).status_code == 200
    assert chat(server, {}).status_code == 200


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    keys = load_api_keys(["gamma"], path)
    assert keys.is_enabled
    for key in ("alpha", "beta", "gamma"):
        keys.check(_bearer(key))
    with pytest.raises(APIError, match="incorrect API key"):
        keys.check(_bearer("delta"))
    path.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_api_keys([], path)
    with pytest.raises(ValueError, match="empty"):
        load_api_keys([" "])


def test_serve_refuses_a_bad_key_file_before_loading(tmp_path: Path) -> None:
    assert main(["serve", "--api-key-file", str(tmp_path / "missing.txt")]) == 2


def _bearer(key: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=key)
