"""Build a tiny random causal LM (Qwen3, or another family of the lineup) and a ChatML tokenizer, offline.

The result loads with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(dir)`` under
``HF_HUB_OFFLINE=1``. ``initializer_range=0.1`` (not the default 0.02) lets a frozen tied
embedding reach logits large enough for SFT to drive the loss near zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<|endoftext|>",  # 0: pad
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2: eos
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

# ChatML; given tools, Hermes-style tool calls as Qwen's templates write them: the tools listed in a
# system turn (with the chat's own system prompt), a call as <tool_call>{"name", "arguments"}</tool_call>,
# a result as a user turn's <tool_response>. Without tools it is plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'To call one, answer <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>\n"
    '{"name": {{ call["function"]["name"] | tojson }}, "arguments": {{ call["function"]["arguments"] | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "User: Tell me a story.\n\nAssistant: Once upon a time there was a small model that learned.",
    "system\nYou are a helpful assistant.\nuser\nHi there!\nassistant\nHello! How can I help you today?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation . , ; : ! ? ' \" ( ) [ ] { } - + = * /",
    "The answer is 42. Training a LoRA adapter on a tiny model is fast on a CPU.",
] + [f"User: What is {a} + {b}?\n\nAssistant: {a + b}\n\n" for a in range(0, 101, 9) for b in range(0, 101, 13)]


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# what ``family`` may name
FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5", "qwen3_5_moe", "gpt_oss", "qwen3_vl_moe", "qwen3_vl")
# built as vision-language models, as their checkpoints are
VISION_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe", "qwen3_vl")
# Qwen3.5's vision tokens: an image is <|vision_start|> <|image_pad|>… <|vision_end|> in its chat template
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_config(family: str, *, vocab_size: int, hidden_size: int, num_layers: int, initializer_range: float, tok):
    """The transformers config of a tiny random model of ``family`` (one of ``FAMILIES``): the
    same attention shape for all, and for mixture-of-experts families 8 routed experts, 2 per
    token, as the lineup's reference configs (``../shared/reference/model-lineup.md``)."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        initializer_range=initializer_range,
        dtype="float32",
    )
    head_dim = hidden_size // 4  # Qwen3's configs default to 128 whatever the hidden size
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common,
            intermediate_size=3 * hidden_size,
            num_key_value_heads=2,
            head_dim=head_dim,
            tie_word_embeddings=True,
        )
    if family == "qwen3_moe":
        # head_dim is not in its signature, but the config keeps it (and its attention reads it)
        return transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
            **common,
            intermediate_size=3 * hidden_size,
            num_key_value_heads=2,
            head_dim=head_dim,
            moe_intermediate_size=hidden_size // 2,
            num_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    if family in ("qwen3_vl_moe", "qwen3_vl"):  # Qwen3-VL-30B-A3B's (or the dense 8B's): a deepstack tower
        text = dict(
            common,
            intermediate_size=3 * hidden_size,
            num_key_value_heads=2,
            head_dim=head_dim,
            # interleaved M-RoPE over the head's (time, row, column) thirds, as the real configs
            rope_parameters=dict(
                rope_type="default",
                rope_theta=5e6,
                mrope_section=[head_dim // 4, head_dim // 8, head_dim // 8],
                mrope_interleaved=True,
            ),
        )
        if family == "qwen3_vl_moe":
            # not hidden_size // 2: a square fused gate_up (experts, 2I, H) would leave the cookbook's
            # merge no way to tell which axis is fused (it decides by shape; the real models' differ)
            text |= dict(moe_intermediate_size=hidden_size // 4, num_experts=8, num_experts_per_tok=2)
        # each of its two blocks' output also feeds a decoder layer
        vision = _vision_tower(hidden_size, initializer_range, depth=2, deepstack_visual_indexes=[0, 1])
        config = transformers.Qwen3VLMoeConfig if family == "qwen3_vl_moe" else transformers.Qwen3VLConfig
        return config(text_config=text, vision_config=vision, tie_word_embeddings=False, **_vision_tokens(tok))
    if family == "deepseek_v3":  # MLA; a dense MLP in layer 0, routed + shared experts after
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=3 * hidden_size,
            moe_intermediate_size=hidden_size // 2,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,  # group-limited routing, as DeepSeek-V3's (8 groups, the top 4): the best group's two
            topk_group=1,
            q_lora_rank=hidden_size // 2,
            kv_lora_rank=hidden_size // 4,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=head_dim,
            tie_word_embeddings=False,
        )
    if family == "gpt_oss":  # attention sinks, a sliding window every other layer, interleaved experts
        return transformers.GptOssConfig(
            **common,
            num_key_value_heads=2,
            head_dim=head_dim,
            intermediate_size=hidden_size // 2,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,  # shorter than the tests' sequences, so that it cuts
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            tie_word_embeddings=False,
        )
    if family in ("qwen3_5", "qwen3_5_moe"):  # Gated-DeltaNet layers, then gated full attention
        hybrid = dict(
            common,
            intermediate_size=3 * hidden_size,
            num_key_value_heads=2,
            head_dim=head_dim,
            layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=family == "qwen3_5",  # as Qwen3.5-4B; the MoE models keep their own head
        )
        # Every Qwen3.5 / 3.6 checkpoint is a vision-language model (its language model's weights
        # under model.language_model.): so is this one, with a vision tower of one small block.
        vision = _vision_tower(hidden_size, initializer_range)
        tied = hybrid.pop("tie_word_embeddings")
        tokens = _vision_tokens(tok)
        if family == "qwen3_5":
            return transformers.Qwen3_5Config(
                text_config=hybrid, vision_config=vision, tie_word_embeddings=tied, **tokens
            )
        moe = dict(
            moe_intermediate_size=hidden_size // 2,
            shared_expert_intermediate_size=hidden_size // 2,
            num_experts=8,
            num_experts_per_tok=2,
        )
        return transformers.Qwen3_5MoeConfig(
            text_config=hybrid | moe, vision_config=vision, tie_word_embeddings=tied, **tokens
        )
    raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")


def _vision_tower(hidden_size: int, initializer_range: float, depth: int = 1, **extra) -> dict:
    """A vision config of small blocks (Qwen3.5's and Qwen3-VL's take the same fields), its output
    the language model's width."""
    return dict(
        depth=depth,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        initializer_range=initializer_range,
        **extra,
    )


def _vision_tokens(tok) -> dict[str, Any]:  # spread into a config's keywords (ints all)
    start, end, image, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    return dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video)


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    family: str = "qwen3",
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 512,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write the model and tokenizer into ``out_dir`` atomically and return its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))

    tok = build_tokenizer(vocab_size)
    if family in VISION_FAMILIES:
        tok.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], *VISION_TOKENS]})
    cfg = tiny_config(
        family,
        vocab_size=max(vocab_size, len(tok)),
        hidden_size=hidden_size,
        num_layers=num_layers,
        initializer_range=initializer_range,
        tok=tok,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # a vision-language config builds the whole model (tower and all), as its checkpoints hold it
        auto = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
        model = auto.from_config(cfg)
        if family == "deepseek_v3":
            # a real router's correction bias, learned for balance, shifts which experts are chosen
            # (not their weights); transformers starts it at zero, which would leave it untested
            for layer in model.model.layers[cfg.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp, save_jinja_files=False)
    if family in VISION_FAMILIES:
        image_processor(cfg.vision_config).save_pretrained(tmp)

    # transformers 5 writes "TokenizersBackend", a class 4.x cannot load.
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2))

    try:
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
        # else another process won the race: keep theirs
    return out


def image_processor(vision):
    """Qwen3.5's image processor for ``vision`` (a vision config), with small images' bounds: an
    image of a few dozen pixels a side is a few tokens (the real ones take 256² to 16 M pixels)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def weights_sha256(model_dir: str | os.PathLike) -> str:
    """The SHA-256 of a built tiny model's weights: what a node that builds it again must get."""
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()
