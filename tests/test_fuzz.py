"""Property-based fuzzing of every operation in the server's OpenAPI schema (Schemathesis).

Whatever the generator sends, valid by the schema or deliberately not, the answer must never
be a 5xx. The run is bounded (``MAX_EXAMPLES`` per operation and mode, derandomized) so CI is
reproducible and quick. Operations are driven one by one with Hypothesis directly rather than
through Schemathesis's pytest plugin, which does not support this pytest.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_EXAMPLES = 40


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
                fuzz()
            except Unsatisfiable:  # an operation without inputs has no invalid form
                assert mode == GenerationMode.NEGATIVE
    print(f"fuzzed {len(operations)} operations with {sum(sent.values())} requests")
    assert len(operations) >= 30 and sum(sent.values()) >= 1500
    assert not server_errors, "\n".join(dict.fromkeys(server_errors))
    assert httpx.get(f"{fuzzed_server.base_url}/healthz", timeout=10).json()["status"] == "ok"
