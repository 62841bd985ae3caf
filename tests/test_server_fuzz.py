"""Schemathesis over the server's own OpenAPI schema: every operation, valid and invalid inputs, no 5xx.

The app serves a tiny random model in memory (tests/tiny.py), so each example costs milliseconds. Examples are
derandomised (the same inputs on every run, so a failure reproduces) and bounded per operation and mode to
keep the suite fast; `LMHEAD_FUZZ_EXAMPLES=150` runs a longer search by hand. Schemathesis draws from the
schema: values inside and outside the bounds, missing and unknown fields, wrong types (negative mode). The
guard's own cases (NaN, lone surrogates, huge bodies, slow bodies, foreign Host headers) have their own tests
in test_server_guard.py.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from server_harness import tiny_served_model

from lmhead.server import create_app

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("LMHEAD_FUZZ_EXAMPLES", "20"))
MAX_TOKENS = 8  # long generations are the load tests' business; here they would only cost time


def short_generation(case):
    """The case with at most MAX_TOKENS new tokens (a chat with no max_tokens would generate 256)."""
    body = case.body
    if isinstance(body, dict) and case.path in ("/v1/chat/completions", "/v1/completions", "/api/generate"):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if case.path == "/v1/chat/completions" and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
    return case


@pytest.fixture(scope="module")
def api_schema():
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(tiny_served_model()))


def fuzz(operation, mode, tried: list) -> None:
    """Up to EXAMPLES requests of `mode` to one operation; fails on the first answer ≥ 500 (shrunk)."""

    @given(case=operation.as_strategy(generation_mode=mode).map(short_generation))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call()
        tried.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.query, case.body, response.text[:500])

    try:
        run()
    except Unsatisfiable:
        if mode == schemathesis.GenerationMode.POSITIVE:
            raise  # an operation with no parameters has no invalid input: only then is negative mode empty


@pytest.mark.slow
def test_no_request_the_schema_allows_or_breaks_is_a_server_error(api_schema):
    GenerationMode = schemathesis.GenerationMode
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/api/predict", "/api/generate", "/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths
    tried: list[int] = []
    start = time.perf_counter()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode, tried)
    counts = {s: tried.count(s) for s in sorted(set(tried))}
    print(f"\nfuzz: {len(tried)} requests over {len(operations)} operations in "
          f"{time.perf_counter() - start:.1f} s; status counts {counts}")
    assert all(s < 500 for s in tried)
