"""What an OpenAI ``model`` name stands for (``serving.openai.OpenAIService.resolve``): the
service's ``<base model>;<checkpoint path>`` among them, over a real store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.serving.openai import OpenAIService
from hosted_tinker.server.serving.tenancy import Tenancy

pytestmark = pytest.mark.fast

SERVED = ["hosted-tinker/tiny-qwen3", "Qwen/Qwen3-8B-Base"]  # two names of the one model served


@pytest.fixture
def service(tmp_path: Path) -> OpenAIService:
    store = Store(tmp_path / "db.sqlite")
    for session, owner in (("s1", "alice"), ("s2", "bob")):
        store.add_session(
            session, owner=owner, tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
        )
    # alice's run on a served base, and one left in this data directory by a server of another model
    for run, base in (("s1:train:0", SERVED[1]), ("s1:train:1", "meta-llama/Llama-3.2-1B")):
        store.add_model(run, session_id="s1", model_seq_id=int(run[-1]), base_model=base, lora={}, user_metadata={})
        store.put_checkpoint(run, "sampler_weights", "final", size_bytes=1, ttl_seconds=None, user_metadata={})
    sampling = SimpleNamespace(tokenizer=None, files=SimpleNamespace(encrypted=lambda path: False))  # sampler_weights
    return OpenAIService(sampling, store, Tenancy(store), SERVED)  # type: ignore[arg-type]


MINE = "tinker://s1:train:0/sampler_weights/final"
ELSEWHERE = "tinker://s1:train:1/sampler_weights/final"


@pytest.mark.parametrize("base", SERVED)
def test_a_checkpoint_named_on_its_base_is_that_checkpoint(service: OpenAIService, base: str) -> None:
    alone = service.resolve(MINE, "alice")
    assert service.resolve(f"{base};{MINE}", "alice") == alone
    assert alone.key == str(alone.path) == MINE


@pytest.mark.parametrize(
    ("name", "status", "says"),
    [
        (f"no/such-base;{MINE}", 404, "'no/such-base' does not exist"),
        (f"{SERVED[0]};tinker://s1:train:0/sampler_weights/nope", 404, "does not exist"),
        (f"{SERVED[0]};not-a-path", 404, "does not exist"),
        (f"{SERVED[0]};{SERVED[1]}", 404, "does not exist"),
        (f"{SERVED[0]};{ELSEWHERE}", 400, f"trained on 'meta-llama/Llama-3.2-1B', not on '{SERVED[0]}'"),
        (ELSEWHERE, 400, "trained on 'meta-llama/Llama-3.2-1B': this server serves"),
    ],
)
def test_names_that_are_not_a_checkpoint_on_a_served_base(
    service: OpenAIService, name: str, status: int, says: str
) -> None:
    with pytest.raises(ApiError) as refused:
        service.resolve(name, "alice")
    assert refused.value.status == status and says in str(refused.value)


def test_another_keys_checkpoint_is_not_found_whatever_base_is_named(service: OpenAIService) -> None:
    for name in (MINE, f"{SERVED[0]};{MINE}", f"{SERVED[0]};{ELSEWHERE}"):
        with pytest.raises(ApiError) as refused:
            service.resolve(name, "bob")
        assert refused.value.status == 404  # not a 400 naming alice's base model
