"""The test extra's optional modules (openai, anthropic, schemathesis, cryptography, ...): an end-to-end module
that needs one is left out of the collection without it (saying so), so that collecting the suite
never stops at an import; under ``HOSTED_TINKER_REQUIRE_TEST_EXTRAS=1`` (CI) it is collected
whatever is missing, and fails."""

from __future__ import annotations

import importlib.util

REQUIRE = "HOSTED_TINKER_REQUIRE_TEST_EXTRAS"
INSTALL = "bash scripts/install.sh --test, or pip install -e '.[test]'"

# e2e test module -> the optional modules it imports
NEEDS = {
    "test_fuzz.py": ("schemathesis", "hypothesis"),
    "test_encrypted_exports.py": ("cryptography",),
    **{f"test_{name}.py": ("openai",) for name in ("fair_sampling", "usage", "audit_log", "tenants", "backpressure")},
    **{f"test_{name}.py": ("openai", "anthropic") for name in ("sampling", "vllm")},
}


def missing(module_file: str) -> list[str]:
    """What of its optional modules the test module ``module_file`` (a file name) cannot import."""
    return [name for name in NEEDS.get(module_file, ()) if importlib.util.find_spec(name) is None]
