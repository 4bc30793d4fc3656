"""Tool calls as chat templates write them (``serving.tool_calls``), and Anthropic requests as the
model's chat template takes them (``serving.anthropic.chat``), over the tiny model's template."""

from __future__ import annotations

import re

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.core.tiny_model import CHATML_TEMPLATE, build_tokenizer
from hosted_tinker.server.protocol.anthropic_types import CountTokensRequest
from hosted_tinker.server.protocol.openai_types import ChatCompletionRequest
from hosted_tinker.server.serving.anthropic import chat
from hosted_tinker.server.serving.openai_chat import chat_messages
from hosted_tinker.server.serving.tool_calls import ToolCall, parse, schemas, tool_form

pytestmark = pytest.mark.fast

PLAIN_CHATML = (  # the tiny model's template before it took tools
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"name": "weather", "description": "Today's weather", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_the_forms_templates_write_calls_in() -> None:
    assert tool_form(CHATML_TEMPLATE) == "hermes"
    assert tool_form(PLAIN_CHATML) is None and tool_form(None) is None
    coder = "{% if tools %}...<tool_call>\n<function={{ name }}>\n<parameter=x>...{% endif %}"
    assert tool_form(coder) == "qwen3_coder"


@pytest.mark.parametrize(
    ("text", "form", "expected"),
    [
        ("No call.", "hermes", ("No call.", [])),
        (
            'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "hermes",
            ("Let me look.", [ToolCall("weather", {"city": "Paris"})]),
        ),
        (  # two calls; arguments written as a JSON string
            '<tool_call>{"name": "a", "arguments": "{\\"n\\": 1}"}</tool_call>\n<tool_call>{"name": "b"}</tool_call>',
            "hermes",
            ("", [ToolCall("a", {"n": 1}), ToolCall("b", {})]),
        ),
        (
            "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            "qwen3_coder",
            ("", [ToolCall("weather", {"city": "Paris", "days": 3})]),
        ),
    ],
)
def test_calls_are_read_out_of_sampled_text(text: str, form, expected) -> None:
    assert parse(text, form) == expected


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Par',  # cut off by max_tokens
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a"}</tool_call> and then more words',
    ],
)
def test_a_call_that_does_not_parse_leaves_the_text_as_text(text: str) -> None:
    assert parse(text, "hermes") == (text, [])


def test_without_tools_the_tiny_template_is_the_chatml_it_was(tok) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "A"},
    ]
    for generation in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        assert ours == tok.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False, chat_template=PLAIN_CHATML
        )


def _render(tok, request: dict) -> str:
    turns = chat(CountTokensRequest(**request), tool_form(tok.chat_template))
    text = tok.apply_chat_template(turns.messages, tools=turns.tools, add_generation_prompt=True, tokenize=False)
    return text + turns.prefill


def test_a_tool_conversation_renders_as_the_template_writes_calls_and_results(tok) -> None:
    request = {
        "model": "m",
        "system": "Be brief.",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
    }
    assert _render(tok, request) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "weather", "description": "Today\'s weather", '
        '"parameters": {"type": "object"}}}\n</tools>\n'
        'To call one, answer <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\nLooking.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    failed = request["messages"][2]["content"][0] | {"is_error": True, "content": [{"type": "text", "text": "no"}]}
    request["messages"][2]["content"] = [failed, {"type": "text", "text": "Try again?"}]
    assert "<tool_response>\nError: no\n</tool_response><|im_end|>\n<|im_start|>user\nTry again?" in _render(
        tok, request
    )


def test_turns_of_one_role_join_and_a_final_assistant_turn_is_a_prefill(tok) -> None:
    request = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
            {"role": "assistant", "content": "The answer"},
        ],
    }
    assert _render(tok, request) == "<|im_start|>user\na\n\nbc<|im_end|>\n<|im_start|>assistant\nThe answer"
    assert _render(tok, request | {"tool_choice": {"type": "none"}, "tools": [WEATHER]}).startswith("<|im_start|>user")


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice: 'any' would force a call"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: extended thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]: 'web_search_20250305'"),
        ({"tools": [WEATHER | {"strict": True}]}, "tools[0]: a tool has"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content[0]: a image block"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
            "a tool_use block belongs in an assistant turn",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}]}]}, "no field 'extra'"),
        ({"messages": [{"role": "assistant", "content": "trailing "}]}, "cannot end with white space"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 7}]}]},
            "content[0].content: a string or a list of text blocks, not int",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [7]}]}]},
            "content[0].content[0]: only text blocks are read here, not 'int'",
        ),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(tok, request_: dict, says: str) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | request_
    with pytest.raises(ApiError) as refused:
        chat(CountTokensRequest(**request), tool_form(tok.chat_template))
    assert refused.value.status == 400 and says in str(refused.value)


def test_a_template_without_tools_refuses_them() -> None:
    request = CountTokensRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    with pytest.raises(ApiError, match="takes no tools"):
        chat(request, None)


# ---- the OpenAI chat door (serving.openai_chat) ----------------------------------------------

FUNCTION = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def test_an_openai_tool_conversation_renders_as_the_anthropic_one(tok) -> None:
    """The two doors give the template the same turns: the same prompt for the same conversation."""
    openai_request = ChatCompletionRequest(
        model="m",
        tools=[FUNCTION],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    messages, tools = chat_messages(openai_request, tool_form(tok.chat_template))
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    anthropic_request = {
        "model": "m",
        "tools": [{"name": "weather", "description": "", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Paris"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
        ],
    }
    assert ours == _render(tok, anthropic_request).replace('"description": "", ', "")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice: only auto and none"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls: false"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]: a tool is"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments: a JSON object",
        ),
    ],
)
def test_what_the_openai_door_refuses_it_names(tok, fields: dict, says: str) -> None:
    request = ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields))
    with pytest.raises(ApiError, match=re.escape(says)):
        chat_messages(request, tool_form(tok.chat_template))
    with pytest.raises(ApiError, match="tools|tool calls"):  # a template without tools refuses them all
        chat_messages(
            ChatCompletionRequest(model="m", messages=[{"role": "tool", "content": "x"}], tools=[FUNCTION]), None
        )


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("<tool_call>" * 200_000, "hermes"),  # every opener unclosed: a lazy regex rescans to the end each time
        ("<tool_call><function=f>\n" + "<parameter=x>" * 200_000 + "</function></tool_call>", "qwen3_coder"),
        ("<tool_call>{}</tool_call>" * 65, "hermes"),  # more calls than any client asks for
    ],
)
def test_whatever_the_model_writes_is_read_in_one_pass(text: str, form) -> None:
    assert parse(text, form) == (text, [])


@pytest.mark.parametrize(
    "arguments",
    ['{"x": NaN}', '{"x": Infinity}', '{"x": 1e400}', "[" * 5000 + "]" * 5000, '"not an object"'],
)
def test_arguments_that_are_not_finite_json_objects_leave_the_text_as_text(arguments: str) -> None:
    text = f'<tool_call>{{"name": "a", "arguments": {arguments}}}</tool_call>'
    assert parse(text, "hermes") == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call><function=f>\n<parameter=x>\n1\n</parameter>\nstray words\n</function></tool_call>",
        "<tool_call><function=f\nbroken>\n</function></tool_call>",
        "<tool_call><parameter=x>1</parameter></tool_call>",
    ],
)
def test_a_malformed_qwen3_coder_call_is_text(text: str) -> None:
    assert parse(text, "qwen3_coder") == (text, [])


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": [{"type": [], "text": "x"}]}], "content[0].type: a string"),
        ([{"role": "assistant", "content": "Once upon"}], "a turn to answer before the final assistant turn"),
    ],
)
def test_malformed_turns_are_400s(tok, messages: list, says: str) -> None:
    with pytest.raises(ApiError, match=re.escape(says)):
        chat(CountTokensRequest(model="m", messages=messages), tool_form(tok.chat_template))


def test_a_tool_whose_schema_or_description_is_not_one_is_a_400(tok) -> None:
    for bad in ({"input_schema": "object"}, {"description": ["a"]}):
        request = CountTokensRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER | bad])
        with pytest.raises(ApiError, match=r"tools\[0\]: input_schema is an object"):
            chat(request, tool_form(tok.chat_template))


def test_a_qwen3_coder_value_reads_as_its_parameters_schema_says() -> None:
    """As vLLM's parser: a parameter the tool declares a string keeps the text as written
    (``123``, ``true`` stay strings); others read as JSON where they parse."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "book",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string"},
                        "note": {"type": ["string", "null"]},
                        "seats": {"type": "integer"},
                        "tags": {"type": "array"},
                    },
                },
            },
        }
    ]
    call = (
        "<tool_call>\n<function=book>\n<parameter=code>\n123\n</parameter>\n<parameter=note>\ntrue\n</parameter>\n"
        "<parameter=seats>\n2\n</parameter>\n<parameter=tags>\n[1]\n</parameter>\n<parameter=other>\n3\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, (read,) = parse(call, "qwen3_coder", schemas(tools))
    assert read.arguments == {"code": "123", "note": "true", "seats": 2, "tags": [1], "other": 3}
    _, (untyped,) = parse(call, "qwen3_coder")  # no schemas: JSON where it parses
    assert untyped.arguments["code"] == 123 and untyped.arguments["note"] is True
    null = call.replace("<parameter=note>\ntrue", "<parameter=note>\nnull")
    assert parse(null, "qwen3_coder", schemas(tools))[1][0].arguments["note"] is None
    assert schemas([{"type": "function", "function": {"name": "f"}}, {"oops": 1}]) == {"f": {}}
    for kind in (["string", {"a": 1}], ["string", ["x"]], 3, None):  # a client's schema, whatever it holds
        odd = {"name": "book", "parameters": {"properties": {"code": {"type": kind}}}}
        assert (
            parse(call, "qwen3_coder", schemas([{"type": "function", "function": odd}]))[1][0].arguments["code"] == 123
        )
