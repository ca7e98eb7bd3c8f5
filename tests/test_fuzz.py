"""Fuzzing the server with schemathesis, from its own /openapi.json (issue 21).

schemathesis reads the schema the server publishes, generates request bodies that follow it (and
bodies that break it), sends them to the app in-process over ASGI, and checks every answer: no
5xx, the response matches its documented schema, the status is one the route documents, and data
that breaks the schema is refused. Since the schema is what the server validates, this also
checks that the two agree. Examples are bounded and the model is tiny, so it takes seconds.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from reference import add_word_tokenizer  # noqa: E402

from minicb import Engine, EngineConfig  # noqa: E402
from minicb.model_executor.loader import load_model, save_tiny_model  # noqa: E402
from minicb.serve.app import build_app  # noqa: E402
from minicb.serve.engine_loop import AsyncEngine  # noqa: E402


def make_app():
    import tempfile
    from pathlib import Path

    path = save_tiny_model(
        Path(tempfile.mkdtemp(prefix="minicb-fuzz-")), seed=9, max_position_embeddings=48
    )
    loaded = load_model(add_word_tokenizer(path), torch.float64)
    engine = Engine(
        EngineConfig(
            model=loaded.name, dtype="float64", block_size=4, num_blocks=256, max_num_seqs=4
        ),
        loaded,
    )
    return build_app(AsyncEngine(engine, max_waiting=64), served_model_name="tiny")


schema = schemathesis.openapi.from_asgi("/openapi.json", make_app())
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.specs.openapi.checks.response_schema_conformance,
    schemathesis.specs.openapi.checks.status_code_conformance,
    schemathesis.specs.openapi.checks.negative_data_rejection,
]


@schema.include(method="POST").parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_post_routes_survive_their_own_schema(case):
    response = case.call_and_validate(checks=CHECKS)
    SEEN.setdefault(case.path, []).append(response.status_code)


SEEN: dict[str, list[int]] = {}  # path -> statuses answered, filled by the test above


def test_fuzzing_generated_real_bodies():
    """The fuzzer must reach the engine (200s) and the validation (400s) on both routes: a schema
    that documented no body would give only empty requests."""
    if not SEEN:
        pytest.skip("run together with test_post_routes_survive_their_own_schema")
    for path in ("/v1/completions", "/v1/chat/completions"):
        statuses = SEEN.get(path, [])
        print(path, {s: statuses.count(s) for s in sorted(set(statuses))})
        assert statuses.count(200) >= 5 and statuses.count(400) >= 5, (path, statuses)
