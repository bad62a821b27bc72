"""Pure rules of the gateway: routing, stream and structured-output flags, the queued line."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import health, queued
from gateway.classify import (
    BodyTraits,
    Endpoint,
    RouteKind,
    body_traits,
    classify_request,
    classify_route,
)

SEED_ENDPOINTS = [
    "chat/completions",
    "completions",
    "embeddings",
    "responses",
    "messages",
    "chat/completions/batch",
    "audio/transcriptions",
    "audio/translations",
    "rerank",
    "score",
]
PROBE = [(b"x-dgxmm-health-check", b"1")]


@pytest.mark.parametrize("endpoint", SEED_ENDPOINTS)
def test_every_seed_inference_endpoint_is_inference_when_posted(endpoint: str) -> None:
    route = classify_route(b"POST", f"/v1/{endpoint}", [])
    assert route.kind is RouteKind.INFERENCE
    assert route.endpoint is not None and route.endpoint.value == endpoint


@pytest.mark.parametrize(
    ("method", "path"),
    [
        (b"GET", "/health"),
        (b"GET", "/v1/health"),
        (b"GET", "/metrics"),
        (b"POST", "/tokenize"),
        (b"POST", "/v1/tokenize"),
        (b"POST", "/detokenize"),
        (b"POST", "/v1/messages/count_tokens"),
        (b"POST", "/v1/load_lora_adapter"),
        (b"POST", "/v1/unload_lora_adapter"),
        (b"GET", "/v1/responses/resp_123"),
        (b"POST", "/v1/responses/resp_123/cancel"),
        (b"POST", "/sleep"),
        (b"POST", "/wake_up"),
        (b"GET", "/is_sleeping"),
        (b"POST", "/reset_prefix_cache"),
        (b"POST", "/collective_rpc"),
        (b"GET", "/v1/chat/completions"),
        (b"POST", "/v1/models"),
        (b"GET", "/v1/models/"),
        (b"POST", "/v1/chat/completions/"),
        (b"DELETE", "/v1/models/x"),
        (b"POST", "/chat/completions"),
        (b"HEAD", "/v1/chat/completions"),
    ],
)
def test_everything_else_is_not_found(method: bytes, path: str) -> None:
    assert classify_route(method, path, []).kind is RouteKind.NOT_FOUND


def test_models_list_and_model_get_are_routed_by_method_and_path() -> None:
    assert classify_route(b"GET", "/v1/models", []).kind is RouteKind.MODELS_LIST
    route = classify_route(b"GET", "/v1/models/meta-llama/Llama-3-8B", [])
    assert route.kind is RouteKind.MODEL_GET
    assert route.model_id == "meta-llama/Llama-3-8B"


def test_head_is_routed_as_get() -> None:
    assert classify_route(b"HEAD", "/v1/models", []).kind is RouteKind.MODELS_LIST
    assert classify_route(b"HEAD", "/v1/models/m", []).kind is RouteKind.MODEL_GET


def test_health_check_header_marks_the_route() -> None:
    assert classify_route(b"POST", "/v1/chat/completions", PROBE).health_check
    assert not classify_route(b"POST", "/v1/chat/completions", []).health_check
    assert not classify_route(
        b"POST", "/v1/chat/completions", [(b"x-dgxmm-health-check", b"0")]
    ).health_check


@pytest.mark.parametrize(
    ("body", "stream"),
    [
        (b'{"stream": true}', True),
        (b'{"stream":true,"messages":[]}', True),
        (b'{"stream": false}', False),
        (b'{"stream": "true"}', False),
        (b'{"stream": null}', False),
        (b"{}", False),
        (b"not json", False),
        (b"[1,2]", False),
        (b"", False),
    ],
)
def test_stream_flag_is_the_top_level_boolean(body: bytes, stream: bool) -> None:
    assert body_traits(Endpoint.CHAT, body).stream is stream


@pytest.mark.parametrize(
    "field",
    [
        '"response_format": {"type": "json_object"}',
        '"tools": [{"type": "function", "function": {"name": "f"}}]',
        '"tool_choice": "auto"',
        '"functions": []',
        '"function_call": "auto"',
        '"structured_outputs": {"json": {}}',
        '"guided_json": {"type": "object"}',
        '"guided_regex": "a+"',
        '"guided_choice": ["a", "b"]',
        '"guided_grammar": "root ::= x"',
        '"guided_decoding_backend": "xgrammar"',
        '"extra_body": {"guided_json": {}}',
    ],
)
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES])
def test_structured_output_fields_are_detected(field: str, endpoint: Endpoint) -> None:
    body = ('{"model": "m", "stream": true, ' + field + "}").encode()
    traits = body_traits(endpoint, body)
    assert traits == BodyTraits(stream=True, structured=True)


def test_null_structured_fields_do_not_count() -> None:
    body = b'{"response_format": null, "tools": null, "guided_json": null}'
    assert not body_traits(Endpoint.CHAT, body).structured


@pytest.mark.parametrize(
    ("text", "structured"),
    [
        ({"format": {"type": "text"}}, False),
        ({"verbosity": "low"}, False),
        ({"format": {"type": "json_schema", "name": "x", "schema": {}}}, True),
        ({"format": {"type": "json_object"}}, True),
        ({"format": "weird"}, True),
    ],
)
def test_responses_text_format_other_than_plain_text_is_structured(
    text: dict[str, object], structured: bool
) -> None:
    body = json.dumps({"model": "m", "input": "hi", "text": text}).encode()
    assert body_traits(Endpoint.RESPONSES, body).structured is structured


def test_text_field_of_chat_is_not_a_format() -> None:
    assert not body_traits(Endpoint.CHAT, b'{"text": {"format": {"type": "json"}}}').structured


def test_audio_uploads_are_not_parsed() -> None:
    assert body_traits(Endpoint.TRANSCRIPTIONS, b'{"stream": true}') == BodyTraits()


def test_classify_request_combines_route_and_body() -> None:
    c = classify_request(b"POST", "/v1/completions", PROBE, b'{"stream": true}')
    assert c.kind is RouteKind.INFERENCE
    assert c.endpoint is Endpoint.COMPLETIONS
    assert c.stream and not c.structured and c.health_check


@given(st.binary(max_size=300))
def test_body_traits_never_raise_on_any_bytes(body: bytes) -> None:
    for endpoint in Endpoint:
        body_traits(endpoint, body)


@given(
    st.dictionaries(
        st.text(max_size=12),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    )
)
def test_body_traits_agree_with_a_plain_reading_of_the_rules(body: dict[str, object]) -> None:
    traits = body_traits(Endpoint.CHAT, json.dumps(body).encode())
    assert traits.stream is (body.get("stream") is True)
    expected = any(
        (
            k in {"response_format", "tools", "tool_choice", "functions", "function_call"}
            or k == "structured_outputs"
            or k.startswith("guided_")
        )
        and v is not None
        for k, v in body.items()
    )
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        expected = expected or any(
            (k.startswith("guided_") or k in queued_keys()) and v is not None
            for k, v in extra.items()
        )
    assert traits.structured is expected


def queued_keys() -> set[str]:
    """The structured-output keys of the seed."""
    return {
        "response_format",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "structured_outputs",
    }


# --- the queued line -------------------------------------------------------------------------

LINE = (
    "⏳ Your message is queued — waiting for memory to free up for big-model. "
    "It will start automatically.\n\n"
)


def test_queued_text_is_exactly_the_seed_line_and_a_blank_line() -> None:
    assert queued.queued_text("big-model") == LINE


def test_queued_chat_chunk_is_one_chat_completion_chunk_event() -> None:
    raw = queued.queued_chunk(Endpoint.CHAT, "big-model", "served", "7", 123)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
    event = json.loads(raw[len(b"data: ") :])
    assert event["object"] == "chat.completion.chunk"
    assert event["created"] == 123 and event["model"] == "served"
    assert event["choices"][0]["delta"] == {"role": "assistant", "content": LINE}
    assert event["choices"][0]["finish_reason"] is None


def test_queued_completions_chunk_is_a_text_completion_event() -> None:
    raw = queued.queued_chunk(Endpoint.COMPLETIONS, "big-model", "served", "7", 123)
    event = json.loads(raw[len(b"data: ") :])
    assert event["object"] == "text_completion"
    assert event["choices"][0]["text"] == LINE


def test_prefix_goes_in_front_of_chat_message_content() -> None:
    answer = {"choices": [{"message": {"role": "assistant", "content": "Hi"}}], "usage": {"x": 1}}
    out = queued.prefix_answer(Endpoint.CHAT, json.dumps(answer).encode(), "big-model")
    assert out is not None
    assert json.loads(out) == {
        "choices": [{"message": {"role": "assistant", "content": LINE + "Hi"}}],
        "usage": {"x": 1},
    }


def test_prefix_goes_in_front_of_completion_text() -> None:
    answer = {"choices": [{"text": "Hi"}, {"text": "other"}]}
    out = queued.prefix_answer(Endpoint.COMPLETIONS, json.dumps(answer).encode(), "big-model")
    assert out is not None
    assert json.loads(out)["choices"] == [{"text": LINE + "Hi"}, {"text": "other"}]


def test_prefix_goes_in_front_of_the_first_output_text_of_a_response() -> None:
    answer = {
        "output": [
            {"type": "reasoning", "summary": []},
            {"type": "message", "content": [{"type": "refusal", "refusal": "no"}]},
            {
                "type": "message",
                "content": [
                    {"type": "output_text", "text": "A"},
                    {"type": "output_text", "text": "B"},
                ],
            },
        ]
    }
    out = queued.prefix_answer(Endpoint.RESPONSES, json.dumps(answer).encode(), "big-model")
    assert out is not None
    content = json.loads(out)["output"][2]["content"]
    assert content == [
        {"type": "output_text", "text": LINE + "A"},
        {"type": "output_text", "text": "B"},
    ]


@pytest.mark.parametrize("endpoint", [Endpoint.EMBEDDINGS, Endpoint.MESSAGES, Endpoint.RERANK])
def test_other_answers_are_never_changed(endpoint: Endpoint) -> None:
    assert queued.prefix_answer(endpoint, b'{"choices": [{"text": "x"}]}', "m") is None


def test_unparseable_answers_are_left_alone() -> None:
    assert queued.prefix_answer(Endpoint.CHAT, b"not json", "m") is None
    assert queued.prefix_answer(Endpoint.CHAT, b'{"choices": []}', "m") is None
    assert queued.prefix_answer(Endpoint.RESPONSES, b'{"output": []}', "m") is None


# --- errors ----------------------------------------------------------------------------------


def test_error_body_is_the_seed_shape_byte_for_byte() -> None:
    assert queued.queue_timeout("m").body() == (
        b'{"error":{"message":"model m is busy; try again later",'
        b'"type":"server_error","code":"ondemand_queue_timeout"}}'
    )
    assert queued.queue_timeout("m").status == 503
    assert (b"retry-after", b"60") in queued.queue_timeout("m").headers()


def test_stream_error_ends_with_done() -> None:
    raw = queued.sse_error("start_failed", "m could not start: boom")
    events = raw.split(b"\n\n")
    assert json.loads(events[0][len(b"data: ") :])["error"]["code"] == "start_failed"
    assert events[1] == b"data: [DONE]" and events[2] == b""


def test_gateway_error_texts_never_say_rate_limit_nor_a_5xx_invalid_request_error() -> None:
    # LiteLLM maps a body that says "rate limit" to 429 and one that says
    # invalid_request_error to 400: a 503 must say neither; a 4xx is the client's error,
    # typed as OpenAI types it.
    unavailable = [queued.queue_timeout("m"), queued.not_ready("m")]
    for reply in unavailable:
        text = reply.body().lower()
        assert b"rate limit" not in text and b"invalid_request_error" not in text
    refused = [
        queued.too_large(16 * 1024 * 1024),
        queued.deployment_not_found("d"),
        queued.route_not_found("GET", "/x"),
        queued.model_not_found("x", "m"),
    ]
    for reply in refused:
        text = reply.body().lower()
        assert b"rate limit" not in text
        assert b'"type":"invalid_request_error"' in text


def test_not_ready_and_too_large_have_the_seed_codes() -> None:
    assert (queued.not_ready("m").status, queued.not_ready("m").code) == (
        503,
        "ondemand_not_ready",
    )
    assert queued.not_ready("m").retry_after is None
    assert (queued.too_large(1 << 24).status, queued.too_large(1 << 24).code) == (
        413,
        "request_too_large",
    )


# --- health answers --------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_endpoint_has_an_empty_json_answer(endpoint: Endpoint) -> None:
    assert isinstance(json.loads(health.empty_answer(endpoint, "m", 1)), dict)


def test_empty_chat_answer_has_empty_content() -> None:
    answer = json.loads(health.empty_answer(Endpoint.CHAT, "m", 1))
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == ""


@pytest.mark.parametrize(
    "endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES]
)
def test_empty_streams_are_complete_event_streams(endpoint: Endpoint) -> None:
    raw = health.empty_stream(endpoint, "m", 1)
    assert raw.endswith(b"\n\n")
    for event in raw.split(b"\n\n")[:-1]:
        data = [line for line in event.split(b"\n") if line.startswith(b"data: ")]
        assert len(data) == 1
        payload = data[0][len(b"data: ") :]
        if payload != b"[DONE]":
            json.loads(payload)
