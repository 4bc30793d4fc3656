"""The embedded sampler on every family of the lineup, each with its own cache: full attention's
keys and values (Qwen3), sliding-window layers that keep the last positions only and attention
sinks (gpt-oss), Gated-DeltaNet's per-row convolution and recurrent state (Qwen3.5, dense and
MoE), MLA and routed experts (DeepSeek-V3). Rows of unequal prompts decode together
(left-padded), finished rows leave, a request joins mid-run: every sampled token's log-prob is
the trainer's for that sequence, under the same adapter read back from its checkpoint files."""

from __future__ import annotations

import pytest
import torch

from hosted_tinker.core.checkpoints import adapter_files, adapter_weights
from hosted_tinker.core.sampling import Admission, SampleSpec
from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank.model import HfLoraModel
from hosted_tinker.rank.serve import local_rank
from tests.support.lora_reference import datum, trained_looking

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "qwen3_vl_moe"])
def test_rows_leaving_and_joining_a_decode_score_as_the_trainer(family: str, tmp_path):
    rank = local_rank(str(build_tiny_model(tmp_path / family, family=family, hidden_size=64)))
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=5))
    tensors = {k: p.detach() for k, p in zip(handle.keys, handle.params, strict=True)}
    files = adapter_files(model.adapter_config(handle), tensors)
    rank.sampler.load_sampler(
        "trained", model.adapter_config(handle), adapter_weights(files["adapter_model.safetensors"])
    )
    first = [
        SampleSpec(prompt=list(range(10, 41)), max_tokens=3, num_samples=2, seed=1),  # leaves early
        SampleSpec(prompt=[40, 41, 42], max_tokens=25, seed=2),  # past gpt-oss's window of 16
    ]
    late = SampleSpec(prompt=list(range(100, 130)), max_tokens=20, seed=3)
    steps = []

    def admit() -> Admission:
        steps.append(None)
        return Admission([late] if len(steps) == 2 else [])  # joins after two decode steps

    outputs = rank.sampler.generate("trained", first, admit=admit)
    assert len(outputs) == 3
    with torch.no_grad():
        for spec, output in zip([*first, late], outputs, strict=True):
            for seq in output.sequences:
                assert len(seq.tokens) == spec.max_tokens
                trained = model.logprobs([handle], [datum(spec.prompt + seq.tokens)])[0][len(spec.prompt) - 1 :]
                torch.testing.assert_close(torch.tensor(seq.logprobs), trained, rtol=0, atol=1e-4)
