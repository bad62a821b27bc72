"""Which request bodies the simulated engine refuses with 400, in each engine's own words.

A real engine answers a body that is not a valid request (`messages` that is not a list, a
message that is not an object, no `prompt`, `max_tokens` that is not a number, `stream` that
is not a boolean) with its own 400 and keeps the connection; so does the simulator, instead of
generating from whatever it finds.  `refusal` is a pure function of the decoded body; the
server (`simulations.engine`) asks it before it generates.

The words and shapes are the real engines', observed on vLLM 0.32 (CPU build) and llama.cpp
(llama-server of llama-cpp-python 0.3.36), abridged where vLLM lists one error per branch of a
union: vLLM's schema check (pydantic) answers type "Bad Request" with the field's location as
`param` and "N validation error(s)" as the message, its own checks "BadRequestError";
llama.cpp answers `invalid_request_error` with its own sentence.  SGLang (not observed) gets
vLLM's words in its flat error shape.  A check is made only for the engines that make it: vLLM
takes a user message without `content` (llama.cpp does not), llama.cpp takes `max_tokens` of
-1 (no limit) or 1.5 (vLLM does not).  Two refusals are the simulator's own, kept from before:
an empty `messages` list (llama.cpp would generate from the bare chat template) and a body that
is not JSON (`simulations.engine`: 400 for every flavour, where llama.cpp answers 500).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from simulations.answers import Flavour, Full, error

# What a message's `content` may be, in both engines: text, a list of parts, or nothing.
_CONTENT = (str, list, type(None))
_LLAMA_PROMPT = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
    "string, or a list of mixed strings & tokens."
)
_VLLM_EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class _Problem:
    """What is wrong with a body, as each engine says it.

    `llama`: llama.cpp's message (None: llama.cpp takes the body).  vLLM: its own message
    `vllm` (a "BadRequestError" naming `param`), else its schema check of `field` on `value`
    (`schema`: pydantic's error type and message), else (neither) vLLM takes the body.
    """

    field: str
    llama: str | None
    value: object = None
    schema: tuple[str, str] | None = None
    vllm: str | None = None
    param: str | None = None

    def answer(self, flavour: Flavour) -> Full | None:
        """The flavour's 400, or None when this engine takes the body."""
        if flavour == "llamacpp":
            return None if self.llama is None else error(flavour, 400, self.llama)
        if self.vllm is not None:
            return error(flavour, 400, self.vllm, "BadRequestError", self.param)
        if self.schema is None:
            return None
        kind, msg = self.schema
        shown = _shown(self.value)
        found = (
            f"{{'type': '{kind}', 'loc': 'body.{self.field}', 'msg': '{msg}', 'input': {shown}}}"
        )
        message = f"1 validation error:\n  {found}"
        if flavour == "sglang":
            return error(flavour, 400, message)
        return error(flavour, 400, message, "Bad Request", f"body.{self.field}")


def refusal(flavour: Flavour, kind: str, body: dict[str, Any]) -> Full | None:
    """The flavour's 400 for a `kind` request ("chat", "messages", "completions",
    "responses", ...) whose decoded `body` is not a valid request; None when it is."""
    for problem in _problems(kind, body):
        answer = None if problem is None else problem.answer(flavour)
        if answer is not None:
            return answer  # the first this engine refuses; one it takes may hide no other
    return None


def _problems(kind: str, body: dict[str, Any]) -> Iterator[_Problem | None]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        yield _Problem(
            "stream",
            _llama_type("stream", "boolean", stream),
            stream,
            ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
        )
    for field in _LIMITS:
        yield _limit(field, body.get(field))
    match kind:
        case "chat" | "messages":
            yield from _messages(kind, body)
        case "completions":
            yield _prompt(body)
        case "responses":
            yield _input(body)


def _limit(field: str, value: object) -> _Problem | None:
    """`max_tokens` and its kin: an integer (null: none) of at least 1 for vLLM; any number
    for llama.cpp (-1: no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _Problem(
            field,
            _llama_type(field, "number", value),
            value,
            ("int_type", "Input should be a valid integer"),
        )
    if isinstance(value, float) and not value.is_integer():
        return _Problem(
            field,
            None,
            value,
            (
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
            ),
        )
    if value < 1:
        number = int(value)
        vllm = f"{field} must be at least 1, got {number}. (parameter={field}, value={number})"
        return _Problem(field, None, vllm=vllm, param=field)
    return None


def _messages(kind: str, body: dict[str, Any]) -> Iterator[_Problem]:
    """chat/completions and Anthropic messages: a non-empty list of message objects (each
    message's first problem, in order)."""
    messages = body.get("messages")
    if "messages" not in body:
        yield _Problem("messages", "'messages' is required", body, ("missing", "Field required"))
        return
    if not isinstance(messages, list):
        llama = "Expected 'messages' to be an array"
        if kind == "chat" and not isinstance(messages, str | dict):
            # vLLM's chat handler iterates it before any schema check sees it.
            yield _Problem(
                "messages", llama, vllm=f"'{_python_type(messages)}' object is not iterable"
            )
        else:
            yield _Problem(
                "messages", llama, messages, ("list_type", "Input should be a valid list")
            )
        return
    if not messages:
        # llama.cpp would generate from the bare template; the simulator keeps its refusal.
        yield _Problem(
            "messages",
            "messages must be a non-empty list",
            vllm="Cannot apply chat template to an empty conversation. "
            "Provide at least one message.",
        )
        return
    no_content = "All non-assistant messages must contain 'content'"
    for index, message in enumerate(messages):
        at = f"messages.{index}"
        if not isinstance(message, dict):
            yield _Problem(
                at, no_content, message, ("dict_type", "Input should be a valid dictionary")
            )
            continue
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, _CONTENT):
            yield _Problem(
                f"{at}.content",
                "Expected 'content' to be a string or an array",
                content,
                ("string_type", "Input should be a valid string"),
            )
        elif not isinstance(role, str):
            takes = "content" in message  # llama.cpp asks for the content only
            missing = ("missing", "Field required")
            yield _Problem(f"{at}.role", None if takes else no_content, message, missing)
        elif role != "assistant" and "content" not in message:
            yield _Problem(f"{at}.content", no_content)  # vLLM takes it


def _prompt(body: dict[str, Any]) -> _Problem | None:
    """completions: a string, or a list of strings, token ids or lists of token ids."""
    if "prompt" not in body:
        llama: str | None = "[json.exception.out_of_range.403] key 'prompt' not found"
        return _Problem(
            "prompt", llama, vllm=f"{_VLLM_EMPTY_PROMPT} (parameter=prompt)", param="prompt"
        )
    prompt = body["prompt"]
    if prompt is None or prompt == "" or prompt == []:
        llama = _LLAMA_PROMPT if prompt is None else None
        return _Problem(
            "prompt", llama, vllm=f"{_VLLM_EMPTY_PROMPT} (parameter=prompt)", param="prompt"
        )
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and all(_prompt_item(item) for item in prompt):
        return None
    llama = (
        None
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
        else _LLAMA_PROMPT
    )
    return _Problem("prompt", llama, prompt, ("string_type", "Input should be a valid string"))


def _prompt_item(item: object) -> bool:
    if isinstance(item, str) or (isinstance(item, int) and not isinstance(item, bool)):
        return True
    return isinstance(item, list) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in item
    )


def _input(body: dict[str, Any]) -> _Problem | None:
    """responses: `input`, a string or a list of items."""
    if "input" not in body:
        return _Problem("input", "'input' is required", body, ("missing", "Field required"))
    value = body["input"]
    if isinstance(value, str | list):
        return None
    llama = "'input' must be a string or array of objects"
    return _Problem("input", llama, value, ("string_type", "Input should be a valid string"))


def _llama_type(field: str, want: str, value: object) -> str:
    """llama.cpp's words for a field of the wrong JSON type (nlohmann::json's)."""
    return (
        f"Field '{field}': [json.exception.type_error.302] type must be {want}, "
        f"but is {_json_type(value)}"
    )


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _python_type(value: object) -> str:
    return "NoneType" if value is None else type(value).__name__


def _shown(value: object) -> str:
    """How vLLM echoes the offending value: containers described, the rest as text."""
    if isinstance(value, list | dict):
        return f"'<{type(value).__name__} of {len(value)} items>'"
    return repr(str(value))
