"""The published contract (/openapi.json) against the live gateway, fuzzed by schemathesis:
no response is a server error, and every response matches its documented status, type and schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from halfmoon.deploy.local import LocalCluster
from tests.security.conftest import bearer

EXAMPLES = 30  # per operation; bounded so the whole run takes minutes on a CPU


@pytest.fixture(scope="session")
def api_schema(secure_cluster: LocalCluster):  # type: ignore[no-untyped-def]
    return schemathesis.openapi.from_url(f"{secure_cluster.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


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
    @schema.parametrize()
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def test_every_response_matches_the_schema(self, case, secure_cluster: LocalCluster) -> None:  # type: ignore[no-untyped-def]
        response = case.call(headers=bearer("tenant-a"), timeout=120)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance])
