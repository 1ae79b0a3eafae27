"""OpenAI chat-completions request schema, the OpenAI error format, and the JSON response every answer uses."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# Unknown fields are kept (``model_extra``) and refused by the server unless it allows them
# (:func:`unknown_field`), so that a typo such as ``max_toknes`` is a 400, not silently ignored.
_STRICT = ConfigDict(strict=True, extra="allow")


def _valid_unicode(value: str) -> str:
    """Refuse strings that cannot be encoded as UTF-8 (lone surrogates such as a JSON ``"\\ud800"``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text holds invalid Unicode (a lone surrogate code point)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class APIError(Exception):
    """An error answered in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False


class AligntaxOptions(BaseModel):
    """The ``aligntax`` extension field (the openai client sends it with ``extra_body``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    strength: float | None = Field(
        None,
        ge=-1000,
        le=1000,
        allow_inf_nan=False,
        description="Steering strength for the steered model (default 1.0).",
    )
    options: dict[str, Any] | None = Field(
        None,
        description="Options of the steered model's method for this request (e.g. {'eta': 0.2}); the "
        "allowed keys are listed by GET /v1/models (aligntax.serve.options).",
    )


class ChatCompletionRequest(BaseModel):
    model_config = _STRICT

    model: Text
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Text | list[Text] | None = Field(None)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    user: Text | None = None
    aligntax: AligntaxOptions | None = None


_TYPE_WORDS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "literal",
    "function-after",
    "function-before",
    "function-plain",
    "tagged-union",
    "union",
}


def loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        part = str(part)
        if part.lower() in _TYPE_WORDS or "[" in part or "(" in part or part[:1].isupper():
            continue  # a union branch or model name, not a field
        out += f".{part}" if out else part
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400."""
    if not errors:
        return invalid("Invalid request.")
    err = errors[0]
    kind = err.get("type", "")
    loc = err.get("loc", ())
    if kind == "json_invalid":
        return invalid(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
            None,
            "invalid_json",
        )
    param = loc_to_param(loc)
    not_object = "The request body must be a JSON object, sent with Content-Type: application/json."
    if kind == "missing":
        if param is None:
            return invalid(not_object, None, "invalid_json")
        return invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if param is None:
        return invalid(not_object, None, "invalid_json")
    if kind == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: '{param}'.", param, "unknown_parameter")
    code = (
        "invalid_type"
        if kind.endswith("_type") or kind in {"model_attributes_type", "is_instance_of"}
        else "invalid_value"
    )
    got = err.get("input")
    got_s = repr(got) if isinstance(got, (int, float, str, bool)) or got is None else type(got).__name__
    if len(got_s) > 60:
        got_s = got_s[:57] + "..."
    return invalid(f"Invalid value for '{param}': {err.get('msg', 'invalid')} (got {got_s}).", param, code)


# Fields of OpenAI's API that this server accepts and ignores, and ones it accepts only when empty
# (their features are not supported); anything else unknown is refused unless the server allows it.
_IGNORED = {
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
    "reasoning_effort",
    "verbosity",
}
_UNSUPPORTED = {"functions", "function_call", "audio", "modalities", "prediction", "web_search_options"}
_MESSAGE_IGNORED = {"refusal", "annotations", "tool_call_id"}
_MESSAGE_UNSUPPORTED = {"tool_calls", "function_call", "audio"}


def unknown_field(body: ChatCompletionRequest, allow_unknown: bool = False) -> APIError | None:
    """The 400 for the first unknown (e.g. misspelt) field of a request, or for a known OpenAI field
    whose feature this server lacks; None when the request has neither."""

    def check(
        extra: dict[str, Any] | None, where: str, ignored: set[Any], unsupported: set[Any]
    ) -> APIError | None:
        for key, value in (extra or {}).items():
            param = f"{where}{key}"
            if key in ignored:
                continue
            if key in unsupported:
                if value in (None, False, [], {}, "", ["text"]):
                    continue
                return invalid(f"'{param}' is not supported by this server.", param, "unsupported_value")
            if not allow_unknown:
                return invalid(
                    f"Unrecognized request argument supplied: '{param}'.", param, "unknown_parameter"
                )
        return None

    err = check(body.model_extra, "", _IGNORED, _UNSUPPORTED)
    if err is None and body.stream_options is not None:
        err = check(body.stream_options.model_extra, "stream_options.", set(), set())
    for i, m in enumerate(body.messages):
        if err is not None:
            break
        err = check(m.model_extra, f"messages[{i}].", _MESSAGE_IGNORED, _MESSAGE_UNSUPPORTED)
        if err is None and isinstance(m.content, list):
            for k, part in enumerate(m.content):
                if part.type == "text":  # other part types are refused as unsupported later
                    err = err or check(
                        part.model_extra, f"messages[{i}].content[{k}].", {"cache_control"}, set()
                    )
    return err


class SafeJSONResponse(JSONResponse):
    """JSON that cannot fail to encode: text that is not valid UTF-8 (a lone surrogate echoed back in an
    error message) is written as a JSON escape instead of raising."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
