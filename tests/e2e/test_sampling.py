"""Sampling through the real SDK and the OpenAI SDK: which weights, stops, seeds, log-probs."""

from __future__ import annotations

import json
import math
import threading

import anthropic
import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS
from tests.support.uploads import download, upload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]
GREEDY = types.SamplingParams(max_tokens=24, temperature=0.0)
GREEDY_ANTHROPIC = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def trained(base_url):
    """A client trained on one chat, its tokenizer, prompt and target, and a sampler of it."""
    sc = tinker.ServiceClient(base_url=base_url)
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True))
    full = tok.encode(tok.apply_chat_template(CHAT, tokenize=False).rstrip("\n"))
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )
    for _ in range(30):
        tc.forward_backward([datum] * 4, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-3))
    sampler = tc.save_weights_and_get_sampling_client().result()
    yield {"sc": sc, "tc": tc, "tok": tok, "prompt": prompt, "full": full, "sampler": sampler}
    sc.close("success").result()


def text(tok, seq) -> str:
    return tok.decode(seq.tokens)


def test_trained_adapter_answers_and_base_does_not(trained):
    tok, prompt = trained["tok"], types.ModelInput.from_ints(trained["prompt"])
    seq = trained["sampler"].sample(prompt, 1, GREEDY).result().sequences[0]
    assert text(tok, seq) == "The capital of France is Paris.<|im_end|>"
    assert seq.stop_reason == "stop" and len(seq.logprobs) == len(seq.tokens)
    base = trained["sc"].create_sampling_client(base_model=ALIAS).result()
    assert "Paris" not in text(tok, base.sample(prompt, 1, GREEDY).result().sequences[0])
    path = trained["tc"].save_weights_for_sampler("answers").result().path
    from_path = trained["sc"].create_sampling_client(model_path=path).result()
    assert from_path.sample(prompt, 1, GREEDY).result().sequences[0].tokens == seq.tokens


def test_sampler_logprobs_match_the_trainer(trained):
    tc, prompt = trained["tc"], trained["prompt"]
    seqs = (
        trained["sampler"]
        .sample(
            types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=12, temperature=1.0, seed=1, stop=[])
        )
        .result()
        .sequences
    )
    for seq in seqs:
        full = prompt + seq.tokens
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
        )
        trainer = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, trainer[len(prompt) - 1 :], atol=1e-4)
        assert len(seq.tokens) == 12 and seq.stop_reason == "length"
    # compute_logprobs: None for the first prompt token, the trainer's values after it.
    scored = trained["sampler"].compute_logprobs(types.ModelInput.from_ints(trained["full"])).result()
    assert scored[0] is None
    full = trained["full"]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
    )
    trainer = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(scored[1:], trainer, atol=1e-4)


def test_stops_seeds_and_prompt_logprobs(trained):
    tok, sampler = trained["tok"], trained["sampler"]
    prompt = types.ModelInput.from_ints(trained["prompt"])
    by_string = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, temperature=0.0, stop=" France")).result()
    assert text(tok, by_string.sequences[0]).endswith(" France") and by_string.sequences[0].stop_reason == "stop"
    comma = tok.encode(" is")[0]
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, temperature=0.0, stop=[comma])).result()
    assert by_id.sequences[0].tokens[-1] == comma and by_id.sequences[0].stop_reason == "stop"
    no_stop = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])).result()
    assert len(no_stop.sequences[0].tokens) == 12 and no_stop.sequences[0].stop_reason == "length"

    # The trained adapter is near-deterministic; the base model's spread shows the seeds at work.
    base = trained["sc"].create_sampling_client(base_model=ALIAS).result()
    params = types.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, stop=[])
    first = base.sample(prompt, 4, params).result().sequences
    again = base.sample(prompt, 4, params).result().sequences
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len({tuple(s.tokens) for s in first}) > 1  # the samples of one request differ

    scored = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    assert scored.prompt_logprobs[0] is None and all(isinstance(x, float) for x in scored.prompt_logprobs[1:])
    assert scored.topk_prompt_logprobs[0] is None and len(scored.topk_prompt_logprobs[1]) == 3
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    sequences = sampler.sample(prompt, 2, greedy, topk_sample_logprobs=3).result().sequences
    assert len(sequences) == 2 and sequences[0].tokens == sequences[1].tokens  # (vLLM is asked for one)
    for seq in sequences:
        top = seq.topk_logprobs_np  # (6, 3) each: the best first; greedy picks the best
        assert top.token_ids.shape == top.logprobs.shape == (6, 3)
        assert (np.diff(top.logprobs, axis=1) <= 0).all() and top.token_ids[:, 0].tolist() == seq.tokens
        np.testing.assert_allclose(top.logprobs[:, 0], seq.logprobs, rtol=1e-5)
    last_n = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert all(x is None for x in last_n[:-3]) and all(x is not None for x in last_n[-3:])


def test_concurrent_samples_and_refusals(trained):
    sampler, prompt = trained["sampler"], types.ModelInput.from_ints(trained["prompt"])
    futures = [sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=i, stop=[])) for i in range(16)]
    results = [f.result() for f in futures]
    assert all(len(r.sequences[0].tokens) == 8 for r in results)
    with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k"):
        sampler.sample(prompt, 1, GREEDY, prompt_alt_tokens_k=1000).result()
    with pytest.raises(tinker.BadRequestError, match="temperature"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=-1.0)).result()


def test_a_request_over_the_batch_cap_runs_alone_and_the_others_go_on(trained):
    """num_samples above the engine's rows per run (64) and below the API's cap (128): it used to
    be left waiting forever, and the engine retried it in a loop that stopped every sampler."""
    sampler, prompt = trained["sampler"], types.ModelInput.from_ints(trained["prompt"])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    large = sampler.sample(prompt, 100, params)
    others = [sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=i, stop=[])) for i in range(4)]
    assert len(large.result(timeout=120).sequences) == 100
    assert all(len(f.result(timeout=120).sequences[0].tokens) == 4 for f in others)
    again = sampler.sample(prompt, 100, params).result(timeout=120)  # the same seed, the same sequences
    assert [s.tokens for s in again.sequences] == [s.tokens for s in large.result().sequences]


def test_training_continues_while_sampling(trained, base_url):
    """Sampling of one model does not stall another model's training for long."""
    sampler, prompt = trained["sampler"], types.ModelInput.from_ints(trained["prompt"])
    stop = threading.Event()

    def sample_forever():
        while not stop.is_set():
            sampler.sample(prompt, 4, types.SamplingParams(max_tokens=32, stop=[])).result()

    worker = threading.Thread(target=sample_forever, daemon=True)
    worker.start()
    try:
        with tinker.ServiceClient(base_url=base_url) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
            datum = types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7]),
                loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
            )
            for _ in range(5):
                assert math.isfinite(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    finally:
        stop.set()
        worker.join(timeout=60)


def test_openai_sdk_base_and_adapter(trained, base_url):
    path = trained["tc"].save_weights_for_sampler("openai").result().path
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-test")
    ids = [m.id for m in client.models.list().data]
    assert ALIAS in ids and path in ids

    answer = client.chat.completions.create(
        model=path, messages=CHAT[:1], temperature=0, max_tokens=24, logprobs=True, top_logprobs=2
    )
    assert answer.choices[0].message.content == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(answer.choices[0].logprobs.content)
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    base = client.chat.completions.create(model=ALIAS, messages=CHAT[:1], temperature=0, max_tokens=24)
    assert base.choices[0].message.content != answer.choices[0].message.content

    stream = client.chat.completions.create(
        model=path, messages=CHAT[:1], temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    deltas, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(deltas) == "The capital of France is Paris." and finish == "stop"
    assert len([d for d in deltas if d]) > 3 and usage.completion_tokens == answer.usage.completion_tokens

    completion = client.completions.create(
        model=path,
        prompt=trained["tok"].decode(trained["prompt"]),
        temperature=0,
        max_tokens=24,
        stop=["."],
        n=2,
        logprobs=1,
    )
    assert [c.text for c in completion.choices] == ["The capital of France is Paris"] * 2
    streamed = client.completions.create(
        model=path,
        prompt=trained["tok"].decode(trained["prompt"]),
        temperature=0,
        max_tokens=24,
        stop=["."],
        stream=True,
    )
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed if c.choices]
    assert "".join(text for text, _ in pieces) == "The capital of France is Paris"
    assert pieces[-1][1] == "stop" and len(pieces) > 3
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT[:1])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=ALIAS, messages=CHAT[:1], temperature=5)
    # errors name the fields as each door does (OpenAI: stop; Anthropic: stop_sequences), not as Tinker does
    with pytest.raises(openai.BadRequestError) as empty_stop:
        client.chat.completions.create(model=ALIAS, messages=CHAT[:1], stop=["x", ""])
    assert empty_stop.value.body["message"].startswith("stop contains an empty string")  # the body the SDK parsed
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be between"):
        client.chat.completions.create(model=ALIAS, messages=CHAT[:1], max_completion_tokens=100_000)


def test_the_services_base_url_and_a_checkpoint_named_on_its_base(trained, base_url):
    """``/oai/api/v1``, the base URL the Tinker service documents for the OpenAI SDK, serves what
    ``/v1`` does; ``<base model>;<checkpoint path>`` is that checkpoint on that base."""
    path = trained["tc"].save_weights_for_sampler("door").result().path
    client = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key="tml-test")
    models = [m.id for m in client.models.list().data]
    assert path in models and ALIAS in models
    expected = "The capital of France is Paris."
    bases = [m.model_name for m in trained["sc"].get_server_capabilities().supported_models]
    assert len(bases) == 2  # the tiny model's own name and ALIAS: one model, either name
    for name in (path, *(f"{base};{path}" for base in bases)):
        answer = client.chat.completions.create(model=name, messages=CHAT[:1], temperature=0, max_tokens=24)
        assert (answer.choices[0].message.content, answer.model) == (expected, name)
    streamed = client.completions.create(
        model=f"{ALIAS};{path}",
        prompt=trained["tok"].decode(trained["prompt"]),
        temperature=0,
        max_tokens=24,
        stop=["."],
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[:-1]
    with pytest.raises(openai.NotFoundError, match="no-such-base"):
        client.chat.completions.create(model=f"no-such-base;{path}", messages=CHAT[:1])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"{ALIAS};{path}-gone", messages=CHAT[:1])
    # A prompt route at this door takes a prompt-sized body, not a control call's (1 MiB).
    body = {"model": f"{ALIAS};{path}", "prompt": "Paris is", "max_tokens": 2, "temperature": 0}
    padded = json.dumps(body).encode()[:-1] + b" " * (2 << 20) + b"}"
    reply = httpx.post(
        f"{base_url}/oai/api/v1/completions", content=padded, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert reply.status_code == 200 and reply.json()["model"] == body["model"], reply.text
    refused = httpx.post(f"{base_url}/oai/api/v1/completions", json=body | {"max_tokens": -1}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["message"], refused.text  # OpenAI's shape


def test_an_uploaded_export_answers_as_its_source(trained, base_url):
    """An adapter brought back (SDK 0.39's upload: the export's files PUT to signed URLs) samples
    as the run it came from, through the SDK and the OpenAI API."""
    tc, rest = trained["tc"], trained["sc"].create_rest_client()
    files = download(rest, tc.save_weights_external("to-upload").result().path)
    done = upload(base_url, "tml-test", files, lora_config={"rank": 8})
    assert done.status_code == 200, done.text
    path = done.json()["tinker_path"]
    prompt, expected = types.ModelInput.from_ints(trained["prompt"]), "The capital of France is Paris."
    sampler = trained["sc"].create_sampling_client(model_path=path).result()
    assert text(trained["tok"], sampler.sample(prompt, 1, GREEDY).result().sequences[0]).startswith(expected)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-test")
    answer = client.chat.completions.create(model=path, messages=CHAT[:1], temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == expected


def test_anthropic_sdk_messages_at_both_doors(trained, base_url):
    """The Anthropic SDK, pointed at ``<host>/anthropic/api`` (the service's base URL) or at the
    host (``/v1/messages`` beside ``/v1/chat/completions``), drives a checkpoint: messages, system
    prompt, prefill, stop sequences, max_tokens, streaming events, count_tokens, errors."""
    tok = trained["tok"]
    # The SDK (2.x) has no sampling parameters of its own: they go as extra fields, as to the service.
    path = trained["tc"].save_weights_for_sampler("anthropic").result().path
    expected = "The capital of France is Paris."
    for door in ("/anthropic/api", ""):
        client = anthropic.Anthropic(base_url=f"{base_url}{door}", api_key="tml-test", max_retries=0)
        msg = client.messages.create(model=path, max_tokens=24, **GREEDY_ANTHROPIC, messages=CHAT[:1])
        assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence, msg.model) == (
            expected,
            "end_turn",
            None,
            path,
        )
        assert msg.usage.input_tokens == len(trained["prompt"]) and msg.usage.output_tokens > 5
        assert client.messages.count_tokens(model=path, messages=CHAT[:1]).input_tokens == len(trained["prompt"])
    system = "Answer briefly."
    chat = [{"role": "system", "content": system}, CHAT[0]]
    with_system = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    counted = client.messages.count_tokens(model=ALIAS, system=[{"type": "text", "text": system}], messages=CHAT[:1])
    assert counted.input_tokens == len(with_system)

    stopped = client.messages.create(
        model=path, max_tokens=24, **GREEDY_ANTHROPIC, messages=CHAT[:1], stop_sequences=["France", "zebra"]
    )
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "The capital of ",
        "stop_sequence",
        "France",
    )
    short = client.messages.create(model=path, max_tokens=3, **GREEDY_ANTHROPIC, messages=CHAT[:1])
    assert (
        short.stop_reason == "max_tokens"
        and short.usage.output_tokens == 3
        and expected.startswith(short.content[0].text)
    )
    prefilled = client.messages.create(
        model=path,
        max_tokens=24,
        **GREEDY_ANTHROPIC,
        messages=[CHAT[0], {"role": "assistant", "content": "The capital"}],
    )
    assert "Paris" in prefilled.content[0].text and prefilled.usage.input_tokens > len(trained["prompt"])

    with client.messages.stream(model=path, max_tokens=24, **GREEDY_ANTHROPIC, messages=CHAT[:1]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.usage.output_tokens) == (
        expected,
        "end_turn",
        msg.usage.output_tokens,
    )
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert sum(kind == "text" for kind in kinds) > 3  # deltas as they were sampled, not one at the end

    with pytest.raises(anthropic.NotFoundError, match="no-such-model"):
        client.messages.create(model="no-such-model", max_tokens=4, messages=CHAT[:1])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as too_long:  # past the context
        client.messages.create(model=path, max_tokens=20_000, messages=CHAT[:1])
    assert too_long.value.body["type"] == "error" and too_long.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=path, max_tokens=4, messages=CHAT[:1], extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError) as empty_stop:
        client.messages.create(model=path, max_tokens=4, messages=CHAT[:1], stop_sequences=["x", ""])
    # the field by its own name (not OpenAI's "stop"), read from the body: SDK releases print errors differently
    assert empty_stop.value.body["error"]["message"].startswith("stop_sequences contains an empty string")
    with pytest.raises(anthropic.BadRequestError, match="tool_choice: 'any' would force a call"):
        client.messages.create(
            model=path, max_tokens=4, messages=CHAT[:1], tools=[WEATHER], tool_choice={"type": "any"}
        )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]: a image block"):
        client.messages.create(
            model=path, max_tokens=4, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
        )


WEATHER = {"name": "weather", "description": "Today's weather in a city", "input_schema": {"type": "object"}}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_use_round_trip_through_both_sdks(base_url):
    """An adapter trained to call a tool (the tiny model's template writes calls as Qwen's do):
    the Anthropic SDK gets the call as a tool_use block, the OpenAI SDK as a tool call, streamed
    or not, and its result goes back."""
    sc = tinker.ServiceClient(base_url=base_url)
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": WEATHER["description"], "parameters": {"type": "object"}},
        }
    ]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.encode(tok.apply_chat_template(ask, tools=tools, tokenize=False, add_generation_prompt=True))
    full = prompt + tok.encode(CALL + "<|im_end|>")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt)),
        },
    )
    for _ in range(30):
        tc.forward_backward([datum] * 4, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-3))
    path = tc.save_weights_for_sampler("tools").result().path
    client = anthropic.Anthropic(base_url=f"{base_url}/anthropic/api", api_key="tml-test", max_retries=0)
    asked = {"model": path, "max_tokens": 96, "tools": [WEATHER], "messages": ask, **GREEDY_ANTHROPIC}

    msg = client.messages.create(**asked)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"], msg
    [use] = msg.content
    assert (use.name, use.input) == ("weather", {"city": "Paris"}) and use.id.startswith("toolu_")
    with client.messages.stream(**asked) as stream:
        kinds = [(event.type, getattr(getattr(event, "content_block", None), "type", None)) for event in stream]
        final = stream.get_final_message()
    assert ("content_block_start", "tool_use") in kinds and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [("weather", {"city": "Paris"})]
    # Without the tools the same adapter's call is only text.
    plain = client.messages.create(**{k: v for k, v in asked.items() if k != "tools"})
    assert plain.stop_reason != "tool_use" and all(b.type == "text" for b in plain.content)

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    turns = ask + [{"role": "assistant", "content": msg.content}, {"role": "user", "content": [result]}]
    counted = client.messages.count_tokens(model=path, tools=[WEATHER], messages=turns).input_tokens
    again = client.messages.create(**asked | {"messages": turns})
    assert again.usage.input_tokens == counted > len(prompt) and again.content

    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-test", max_retries=0)
    offered = {"model": path, "max_tokens": 96, "temperature": 0, "messages": ask, "tools": tools}
    answer = oai.chat.completions.create(**offered)
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("weather", {"city": "Paris"})
    pieces = list(oai.chat.completions.create(**offered, stream=True))
    streamed = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [("weather", {"city": "Paris"})]
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    back = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    assert oai.chat.completions.create(**offered | {"messages": back}).usage.prompt_tokens == counted
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(**offered, tool_choice="required")

    # JSON the body parser takes, nested deeper than the prompt can be written: a 400, not a 500.
    deep: dict = {"a": 1}
    for _ in range(900):
        deep = {"a": deep}
    use = {"type": "tool_use", "id": "t", "name": "weather", "input": deep}
    result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    nested = {"model": path, "tools": [WEATHER], "messages": [*ask, {"role": "assistant", "content": [use]}]}
    nested["messages"].append({"role": "user", "content": [result]})
    reply = httpx.post(f"{base_url}/anthropic/api/v1/messages/count_tokens", json=nested, timeout=60)
    assert reply.status_code == 400 and "nested too deep" in reply.json()["error"]["message"], reply.text
    deep_call = {"type": "function", "function": {"name": "weather", "arguments": "[" * 3000 + "]" * 3000}}
    body = offered | {"messages": [*ask, {"role": "assistant", "tool_calls": [deep_call]}]}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "arguments" in reply.json()["error"]["message"], reply.text
    sc.close("success").result()
