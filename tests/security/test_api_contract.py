"""The published contract (/openapi.json) against the live gateway, fuzzed by schemathesis:
no response is a server error, and every response matches its documented status, type and schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from halfmoon.deploy.local import LocalCluster
from tests.security.conftest import bearer

EXAMPLES = 30  # per operation; bounded so the whole run takes minutes on a CPU


OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
              ("/health", "GET"), ("/metrics", "GET")]


class TestContractIsPublished:
    def test_openapi_names_the_real_request_and_response_schemas(self, secure_cluster: LocalCluster) -> None:
        doc = httpx.get(f"{secure_cluster.url}/openapi.json", timeout=10).json()
        schemas = doc["components"]["schemas"]
        assert {"CompletionRequest", "ChatCompletionRequest", "Completion", "ChatCompletion", "ErrorResponse"} <= set(
            schemas)
        assert "cache_salt" in schemas["CompletionRequest"]["properties"]
        assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]


class TestFuzzedApiKeepsItsContract:
    @pytest.mark.timeout(900)
    @pytest.mark.parametrize(("path", "method"), OPERATIONS)
    def test_every_response_matches_the_schema(self, secure_cluster: LocalCluster, path: str, method: str) -> None:
        schema = schemathesis.openapi.from_url(f"{secure_cluster.url}/openapi.json")
        operation = schema[path][method]

        statuses: list[int] = []

        @given(case=operation.as_strategy())
        # derandomize: the same examples every run, so whether they reach generation is not left to chance
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:  # type: ignore[no-untyped-def]
            response = case.call(headers=bearer("tenant-a"), timeout=120)
            statuses.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     content_type_conformance, response_schema_conformance])

        call()
        assert 200 in statuses, statuses  # the fuzzer got past validation into generation, not only 4xx
