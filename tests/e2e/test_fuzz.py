"""Property-based fuzzing of every operation in the server's OpenAPI schema (Schemathesis).

Whatever the generator sends, valid by the schema or deliberately not, the answer must never
be a 5xx, and every answer must conform to the response schema its operation declares (JSON
bodies to their models, 4xx to the error shapes). The run is bounded (``MAX_EXAMPLES`` per
operation and mode, derandomized) so CI is reproducible and quick. Operations are driven one
by one with Hypothesis directly rather than through Schemathesis's pytest plugin, which does
not support this pytest.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.support.server import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory, tiny_model_dir):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), "--max-seq-len", "64")
    yield srv
    srv.stop()


def test_no_operation_answers_5xx(fuzzed_server):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    sent: dict[str, int] = {}
    server_errors: list[str] = []
    nonconforming: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
            )
            def fuzz(case) -> None:
                response = case.call(timeout=60)
                label = case.operation.label
                sent[label] = sent.get(label, 0) + 1
                if response.status_code >= 500:
                    server_errors.append(f"{label} -> {response.status_code}: {response.text[:300]}")
                try:
                    case.validate_response(response, checks=[response_schema_conformance])
                except Exception as e:  # one failure per kind, not one per example
                    nonconforming.append(f"{label} -> {response.status_code}: {str(e)[:600]}")

            try:
                fuzz()
            except Unsatisfiable:  # an operation without inputs has no invalid form
                assert mode == GenerationMode.NEGATIVE
    print(f"fuzzed {len(operations)} operations with {sum(sent.values())} requests")
    assert len(operations) >= 30 and sum(sent.values()) >= 1500
    assert not server_errors, "\n".join(dict.fromkeys(server_errors))
    assert not nonconforming, "\n".join(dict.fromkeys(nonconforming))
    assert httpx.get(f"{fuzzed_server.base_url}/healthz", timeout=10).json()["status"] == "ok"


def test_every_json_operation_declares_its_response_schema(fuzzed_server):
    """Each operation's success answer is documented: a JSON schema for a JSON body (a named
    model, not an empty ``{}``), a media type for the others (protobuf, SSE, files), or no body
    (204); and its 4xx answers are documented as the error shape."""
    spec = httpx.get(f"{fuzzed_server.base_url}/openapi.json", timeout=10).json()
    missing = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            ok = {code: r for code, r in op["responses"].items() if code.startswith("2")}
            if not ok:
                missing.append(f"{method.upper()} {path}: no 2xx response")
                continue
            for code, response in ok.items():
                content = response.get("content", {})
                if code == "204":
                    assert not content, f"{path}: 204 with a body"
                    continue
                if not content:
                    missing.append(f"{method.upper()} {path}: {code} has no content")
                for media, body in content.items():
                    if media == "application/json" and not body.get("schema"):
                        missing.append(f"{method.upper()} {path}: {code} JSON without a schema")
            for code in ("400", "401", "404", "422"):
                if path.startswith(("/api/v1/", "/v1/")) and not path.endswith(("healthz", "{file_name}")):
                    assert code in op["responses"], f"{method.upper()} {path}: {code} is not declared"
    assert not missing, "\n".join(missing)
