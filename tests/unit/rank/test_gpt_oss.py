"""gpt-oss's attention in packed rows (``rank.attention``): attention sinks and sliding windows,
each sequence as transformers' eager attention computes it alone; its MXFP4 checkpoints loaded
dequantized, so that LoRA trains on dense experts. Packed == padded for every loss:
``tests/unit/rank/test_packing.py``; through the SDK (export, the cookbook's merge, sampling, resume):
``tests/e2e/test_moe_sdk.py``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.rank import attention
from hosted_tinker.rank.model import load_base

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "gpt_oss", family="gpt_oss", hidden_size=64)


def test_packed_sinks_and_windows_are_each_sequences_own(model_dir):
    """Both layer kinds (sliding window of 16, full): a packed row of sequences shorter and longer
    than the window equals transformers' eager attention over each sequence alone (float32: the
    experts' grouped product takes no float64)."""
    base = load_base(str(model_dir), torch.device("cpu"), "float32")
    packed = copy.deepcopy(base)
    packed.set_attn_implementation(attention.implementation(torch.device("cpu"), torch.float32, sinks=True))
    assert attention.has_sinks(base) and base.config.layer_types == ["sliding_attention", "full_attention"]
    lengths = [3, 40, 1, 17]
    sequences = [torch.randint(5, 500, (n,)) for n in lengths]
    cuts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        row = packed.model(
            input_ids=torch.cat(sequences)[None],
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
            use_cache=False,
            **attention.packing_kwargs(cuts, max(lengths), attention.PACKED, torch.device("cpu")),
        ).last_hidden_state[0]
        alone = [base.model(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in sequences]
    torch.testing.assert_close(row, torch.cat(alone), rtol=0, atol=1e-5)


def test_sinks_keep_flash_attention_off_on_cuda(monkeypatch):
    """transformers' flash-attn path has no sinks: a model with them trains on packed attention."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a)
    )
    cuda = torch.device("cuda", 0)
    assert attention.implementation(cuda, torch.bfloat16, sinks=False) == "flash_attention_2"
    assert attention.implementation(cuda, torch.bfloat16, sinks=True) == attention.PACKED


def test_an_mxfp4_checkpoint_loads_dequantized(model_dir, tmp_path, monkeypatch):
    """gpt-oss's published checkpoints hold MXFP4 experts: they load dequantized, whatever kernels
    are installed (packed MXFP4 experts do not train). No MXFP4 file is built here: the loader is
    checked to ask transformers for that."""
    import transformers

    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    for f in model_dir.iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    asked = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(path, **options):
        asked.update(options)
        options.pop("quantization_config")  # the file holds dense weights: load them as they are
        options["config"].quantization_config = None
        return real(path, **options)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_base(str(quantized), torch.device("cpu"), "float32")
    assert isinstance(asked["quantization_config"], transformers.Mxfp4Config)
    assert asked["quantization_config"].dequantize is True


def test_long_sequences_go_in_blocks_of_queries_with_the_same_result(monkeypatch):
    """Sinks and windows make the scores explicit: queries go in blocks of bounded scores, each
    against the keys it can see, recomputed in the backward pass; the values and gradients are
    those of one block (a tenant's long sequence cannot make the worker hold n² scores)."""
    torch.manual_seed(0)
    query = torch.randn(1, 4, 50, 8, requires_grad=True)
    key, value = torch.randn(1, 2, 50, 8, requires_grad=True), torch.randn(1, 2, 50, 8, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    bounds = [0, 7, 50]
    for window in (None, 5):
        whole = attention.packed_attention_with_sinks(query, key, value, bounds, None, sinks, window)
        grads = torch.autograd.grad(whole.square().sum(), (query, key, value, sinks))
        blocks = []
        monkeypatch.setattr(attention, "_sink_block", _counting(attention._sink_block, blocks))
        monkeypatch.setattr(attention, "BLOCK_BYTES", 2 * 4 * 8 * 4)  # a few rows of scores per block
        blocked = attention.packed_attention_with_sinks(query, key, value, bounds, None, sinks, window)
        blocked_grads = torch.autograd.grad(blocked.square().sum(), (query, key, value, sinks))
        monkeypatch.undo()
        assert len(blocks) > 10 and (window is None or max(blocks) <= 5 + 8)  # keys a block sees
        torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-6)
        for got, want in zip(blocked_grads, grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _counting(block, seen: list[int]):
    def counted(q, k, *rest):
        seen.append(k.shape[2])
        return block(q, k, *rest)

    return counted
