"""A LoRA flag that finds nothing to train on the served model is refused at create_model with
a 400 naming it, never accepted and ignored: GPT-2's attention and MLP are ``Conv1D`` layers,
which this server does not put LoRA on, so only its unembedding can be trained."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def gpt2_server(tmp_path_factory):
    import transformers

    from hosted_tinker.core.tiny_model import build_tokenizer

    root = tmp_path_factory.mktemp("gpt2")
    tok = build_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=None, eos_token_id=None
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    server = start_server(root / "data", "--model", str(root / "model"), alias="tiny-gpt2")
    yield server
    server.stop()


def test_a_flag_that_finds_no_layer_is_a_400_naming_it(gpt2_server):
    health = httpx.get(f"{gpt2_server.base_url}/healthz", timeout=10).json()
    assert health["capabilities"]["lora_groups"] == ["unembed"]
    with tinker.ServiceClient(base_url=gpt2_server.base_url) as sc:
        with pytest.raises(tinker.BadRequestError, match="lora_config.train_attn: GPT2LMHeadModel has no attn layer"):
            sc.create_lora_training_client(base_model="tiny-gpt2", rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="lora_config.train_mlp"):
            sc.create_lora_training_client(base_model="tiny-gpt2", rank=4, train_attn=False).result()
        tc = sc.create_lora_training_client(base_model="tiny-gpt2", rank=4, train_attn=False, train_mlp=False).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(5, 25))),
            loss_fn_inputs={"target_tokens": list(range(6, 26)), "weights": [1.0] * 20},
        )
        first = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] < first
