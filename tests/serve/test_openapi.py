"""The published OpenAPI schema documents what the server validates, and fuzzing it (schemathesis)
finds no 5xx: afterwards the server is healthy and every KV page is free."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from densa.engine.async_engine import AsyncEngine
from densa.serve.protocol import ChatCompletionRequest, CompletionRequest

from .support import RunningServer, make_engine, running_server

FUZZ_MAX_MODEL_LEN = 64  # short generations keep a fuzzing run to seconds
FUZZ_EXAMPLES = 100  # per generation mode, spread over every operation


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    engine = make_engine(tiny_model_dir, max_model_len=FUZZ_MAX_MODEL_LEN, max_num_seqs=4)
    with running_server(AsyncEngine(engine)) as running:
        yield running
    # After every fuzzed request: nothing left in flight, every page free.
    running.wait_idle()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def test_schema_documents_the_validated_request_models(server: RunningServer) -> None:
    schema = httpx.get(server.base_url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
        operation = schema["paths"][path]["post"]
        assert {"200", "400", "401", "413", "429", "503", "504"} <= set(operation["responses"])
        headers = [p["name"] for p in operation["parameters"] if p["in"] == "header"]
        assert headers == ["x-session-affinity"]
    chat = components["ChatCompletionRequest"]
    assert chat["required"] == ["model", "messages"]
    assert chat["properties"]["messages"]["minItems"] == 1
    roles = components["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == {"system", "user", "assistant", "tool", "developer"}
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert {"/health", "/metrics", "/v1/models"} <= set(schema["paths"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzing_the_api_finds_no_server_error(
    fuzz_server: RunningServer, api_schema: Any, mode: GenerationMode
) -> None:
    """Schema-conforming (positive) and schema-violating (negative) requests to every operation."""

    @given(case=api_schema.as_strategy(mode))
    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same examples every run: a failure here is reproducible
        database=None,
    )
    def call(case: Any) -> None:
        case.call_and_validate(checks=[not_a_server_error], timeout=30)

    call()
    fuzz_server.wait_idle()
    assert httpx.get(fuzz_server.base_url + "/health").status_code == 200
