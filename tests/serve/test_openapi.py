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
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from densa.openai.protocol import ChatCompletionRequest, CompletionRequest
from densa.serve.auth import ApiKeys

from .support import RunningServer, engine_client, running_server

FUZZ_MAX_MODEL_LEN = 64  # short generations keep a fuzzing run to seconds
FUZZ_KEY = "fuzz-key"
FUZZ_EXAMPLES = 100  # per generation mode, spread over every operation
# Beyond "no 5xx": every status is one the schema lists, every body matches its schema, and
# schema-violating requests (negative mode) are refused with a 4xx.
_CONFORMANCE = [not_a_server_error, status_code_conformance, response_schema_conformance,
                content_type_conformance]  # fmt: skip
CHECKS = {
    GenerationMode.POSITIVE: _CONFORMANCE,
    GenerationMode.NEGATIVE: [*_CONFORMANCE, negative_data_rejection],
}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    engine = engine_client(tiny_model_dir, max_model_len=FUZZ_MAX_MODEL_LEN, max_num_seqs=4)
    # With a key, a request without one (negative mode drops the header) must be a 401.
    with running_server(engine, api_keys=ApiKeys([FUZZ_KEY])) as running:
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
        # A valid key, so the body is what gets tested -- except where negative mode dropped
        # the header on purpose (then the answer must be 401).
        headers = dict(case.headers or {})
        if "Authorization" in headers or mode == GenerationMode.POSITIVE:
            headers["Authorization"] = f"Bearer {FUZZ_KEY}"
        case.call_and_validate(checks=CHECKS[mode], timeout=30, headers=headers)

    call()
    fuzz_server.wait_idle()
    assert httpx.get(fuzz_server.base_url + "/health").status_code == 200


# ---- the edges of every published bound ---------------------------------------------------------
def _bounded_fields(schema: dict[str, Any], name: str) -> list[tuple[str, int, int]]:
    """(field, minimum, maximum) of the integer fields the schema bounds on both sides, array
    items included (`prompt[]`, `stop_token_ids[]`)."""
    fields = []
    for field, prop in schema["components"]["schemas"][name]["properties"].items():
        for option in [prop, *prop.get("anyOf", [])]:
            items = option.get("items", {}) if option.get("type") == "array" else {}
            for target, suffix in ((option, ""), (items, "[]")):
                if target.get("type") == "integer" and "maximum" in target:
                    fields.append((field + suffix, target.get("minimum", 0), target["maximum"]))
    return sorted(set(fields))


def test_every_published_bound_is_enforced_exactly(fuzz_server: RunningServer) -> None:
    """Values at each bound are accepted, one past it refused with a 400 -- the token-id range of
    `prompt` included, which the random fuzzing above rarely reaches."""
    base = fuzz_server.base_url
    schema = httpx.get(base + "/openapi.json").json()
    fields = _bounded_fields(schema, "CompletionRequest")
    assert {"prompt[]", "stop_token_ids[]", "max_tokens"} <= {f for f, _, _ in fields}
    for field, low, high in fields:
        for value, ok in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
            body: dict[str, Any] = {"model": "tiny", "prompt": [7, 8], "max_tokens": 1}
            if field.endswith("[]"):
                body[field[:-2]] = [7, value] if field == "prompt[]" else [value]
            else:
                body[field] = value
            if field == "max_tokens" and ok:
                body["prompt"] = [7]  # the longest answer still needs room for the prompt
                body["echo"] = value == 0  # nothing generated: only to score the prompt
            auth = {"Authorization": f"Bearer {FUZZ_KEY}"}
            response = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=30)
            assert response.status_code == (200 if ok else 400), (field, value, response.text)
    fuzz_server.wait_idle()
