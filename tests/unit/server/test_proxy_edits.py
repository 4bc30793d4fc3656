"""What the /v1 proxy changes in vLLM's answers (``serving.openai_proxy_edits``), on vLLM's own
bytes: the usage meter, greedy copies and vLLM's routing taken out. Through vLLM itself: ``tests/e2e/test_vllm.py``."""

from __future__ import annotations

import json

import pytest

from hosted_tinker.server.serving.openai_proxy_edits import (
    GreedyCopies,
    Meter,
    asks_routing,
    least_routing,
    without_routing,
)
from hosted_tinker.server.serving.usage import Charge

pytestmark = pytest.mark.fast

CHARGE = Charge("key", "", "base")
CHAT = "chat/completions"


class Ledger:
    def __init__(self) -> None:
        self.counted: list[tuple[int, int]] = []

    def sampled(self, charge: Charge, prompt_tokens: int, sampled_tokens: int) -> None:
        assert charge == CHARGE
        self.counted.append((prompt_tokens, sampled_tokens))


def event(**fields) -> bytes:
    # vLLM's spelling: pydantic's compact JSON, one event per "data:" line and a blank line
    return b"data: " + json.dumps(fields, separators=(",", ":")).encode() + b"\n\n"


TOKEN = event(id="c", choices=[{"index": 0, "text": "hi"}], usage=None)
USAGE = event(id="c", choices=[], usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
DONE = b"data: [DONE]\n\n"


def test_a_stream_the_client_asked_no_usage_of_is_counted_and_shows_none():
    ledger = Ledger()
    meter = Meter(ledger, CHARGE, {"stream": True}, CHAT)
    assert meter.asks == {"stream_options": {"include_usage": True}}
    assert meter.count_events(TOKEN + USAGE + DONE) == TOKEN + DONE
    assert ledger.counted == [(3, 5)]


def test_a_stream_that_asked_for_usage_keeps_it_and_counts_the_final_event_only():
    ledger = Ledger()
    options = {"include_usage": True, "continuous_usage_stats": True}
    meter = Meter(ledger, CHARGE, {"stream": True, "stream_options": options}, CHAT)
    assert meter.asks == {}
    running = event(id="c", choices=[{"index": 0, "text": "hi"}], usage={"prompt_tokens": 3, "completion_tokens": 1})
    lines = running + USAGE + DONE
    assert meter.count_events(lines) == lines
    assert ledger.counted == [(3, 5)]


def test_a_whole_answer_is_counted_from_its_usage():
    ledger = Ledger()
    Meter(ledger, CHARGE, {}, CHAT).count_answer(json.dumps({"choices": [{}], "usage": {"prompt_tokens": 4}}).encode())
    Meter(ledger, CHARGE, {}, CHAT).count_answer(b'{"choices": [{"text": "\\"usage\\":{"}]}')  # text, not usage
    assert ledger.counted == [(4, 0)]


def test_greedy_copies_index_each_prompts_choices_and_count_usage_as_for_n():
    copies = GreedyCopies({"n": 3, "temperature": 0}, "completions")
    assert copies.asks == {"n": 1}
    answer = {
        "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
        "usage": {"completion_tokens": 2, "total_tokens": 5},
    }
    out = json.loads(copies.answer(json.dumps(answer).encode()))
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "a"),
        (1, "a"),
        (2, "a"),
        (3, "b"),
        (4, "b"),
        (5, "b"),
    ]
    assert out["usage"] == {"completion_tokens": 6, "total_tokens": 9}
    streamed = copies.events(TOKEN + DONE).split(b"\n")
    assert [c["index"] for c in json.loads(streamed[0][len(b"data: ") :])["choices"]] == [0, 1, 2]
    assert streamed[1:] == [b"", b"data: [DONE]", b"", b""]


NOT_COPIED = [
    {"n": 3, "temperature": 0.7},
    {"n": 3},
    {"n": 1, "temperature": 0},
    {"n": 2, "temperature": -1},
    {"n": 200_000, "temperature": 0},  # left for vLLM to refuse: copies would be gigabytes
    {"n": 4, "temperature": 0, "use_beam_search": "true"},  # n is the beam width
    {"n": 2, "temperature": 0, "best_of": 3},
]


@pytest.mark.parametrize("payload", NOT_COPIED)
def test_only_greedy_requests_for_several_choices_are_copied(payload: dict):
    copies = GreedyCopies(payload, CHAT)
    assert copies.n == 1 and copies.asks == {}
    assert GreedyCopies({"n": 2, "temperature": 0}, "responses").n == 1  # OpenAI's n is the completions'


def test_a_stream_is_metered_as_vllm_reads_its_flags():
    ledger = Ledger()
    assert Meter(ledger, CHARGE, {"stream": "true"}, CHAT).asks == {"stream_options": {"include_usage": True}}
    asked_no = Meter(ledger, CHARGE, {"stream": 1, "stream_options": {"include_usage": "false"}}, CHAT)
    assert asked_no.asks == {"stream_options": {"include_usage": True}} and asked_no.hide
    assert Meter(ledger, CHARGE, {"stream": True, "stream_options": "x"}, CHAT).asks == {}  # vLLM refuses it
    assert Meter(ledger, CHARGE, {"stream": True}, "responses").asks == {}  # not OpenAI's completions


def test_a_response_is_counted_from_its_input_and_output_tokens():
    ledger = Ledger()
    meter = Meter(ledger, CHARGE, {"stream": True}, "responses")
    usage = {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
    delta = event(type="response.output_text.delta", delta="hi")
    done = event(type="response.completed", response={"id": "r", "usage": usage})
    assert meter.count_events(delta + done) == delta + done
    meter.count_answer(json.dumps({"id": "r", "usage": usage}).encode())
    assert ledger.counted == [(7, 2), (7, 2)]


def test_routing_vllm_returns_for_replay_is_taken_out_of_an_answer_unless_asked_for():
    """A vLLM started with --enable-return-routed-experts (``--vllm-routing record``) puts each
    choice's routed experts in every whole answer: base64, layers x top_k bytes a token."""
    routed = {"index": 0, "text": "hi", "routed_experts": "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJyw="}
    answer = {"id": "c", "choices": [routed, routed | {"index": 1}], "usage": {"prompt_tokens": 3}}
    content = json.dumps(answer, separators=(",", ":")).encode()
    taken = json.loads(without_routing(content))
    assert taken == answer | {"choices": [{"index": 0, "text": "hi"}, {"index": 1, "text": "hi"}]}
    # an answer without it (or with vLLM's null) is passed on byte for byte, not parsed
    plain = json.dumps({"choices": [{"index": 0, "text": "routed_experts", "routed_experts": None}]}).encode()
    assert without_routing(plain) == plain
    assert without_routing(b"not json") == b"not json"
    # a client that names vLLM's own field wants the array
    assert asks_routing({"prompt": "x", "routed_experts_prompt_start": 0}) and not asks_routing({"prompt": "x"})


def test_a_token_prompt_that_asks_no_routing_asks_vllm_for_the_least():
    assert least_routing({"prompt": [5, 6, 7]}, "completions") == {"routed_experts_prompt_start": 3}
    # its length in tokens unknown here, or the client's own choice: left as sent
    for payload, path in [
        ({"prompt": "text"}, "completions"),
        ({"prompt": [[5, 6], [7]]}, "completions"),
        ({"prompt": [5, True]}, "completions"),
        ({"prompt": []}, "completions"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat/completions"),
        ({"prompt": [5, 6], "routed_experts_prompt_start": 0}, "completions"),
    ]:
        assert least_routing(payload, path) == {}, payload
