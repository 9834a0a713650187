"""OpenAI request shapes for /v1/completions and /v1/chat/completions, and the error body.

Known fields are parsed strictly: `"5"` is not an integer and `1` is not a boolean, so a wrong value
answers 400 instead of silently falling back to a default. Unknown top-level fields are ignored (the
app logs their names, ddtree.server.ignored_fields), as OpenAI clients send fields of their own; inside
messages an unknown key stays an error, since dropping part of a message would change the prompt.
Fields OpenAI defines but ddtree does not implement (penalties, echo, ...) are accepted only at their
neutral value.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ddtree.config import DDTreeError, SamplingParams, shown
from ddtree.logprobs import MAX_LOGPROBS

MAX_SEED = 2**64 - 1  # the largest seed torch.Generator accepts


def _integral_float_to_int(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; strings and booleans stay errors.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**bounds: int) -> Any:
    """An integer type with bounds; JSON's 5.0 is read as 5, as JSON Schema reads it."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float_to_int)]


Int = integer()
PositiveInt = integer(ge=1)
TopK = integer(ge=-1)
Seed = integer(ge=0, le=MAX_SEED)
TopLogprobs = integer(ge=0, le=MAX_LOGPROBS)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LenientModel(BaseModel):
    """Strict about the fields it knows; ignores the others (the app logs them)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(LenientModel):
    include_usage: bool = False


class SamplingFields(LenientModel):
    """Fields shared by both endpoints."""

    model: Optional[str] = Field(None, description="the served model name (default: the only one served)")
    max_tokens: Optional[PositiveInt] = Field(None, description="tokens to generate at most")
    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="0 is greedy; default 1.0 as in OpenAI")
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[TopK] = Field(None, description="0 or -1 disables it")
    seed: Optional[Seed] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[Int]] = None
    ignore_eos: bool = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Int] = Field(1, description="only 1 is supported")
    tree_budget: Union[Int, str, None] = Field(
        None, description="'ar', 'chain' or an integer >= 1 (default: the server's --tree-budget)")
    return_token_ids: bool = Field(False, description="add the prompt and output token ids to the response")
    # Accepted for compatibility, only at their neutral values.
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def neutral_only(self) -> dict[str, tuple[Any, tuple]]:
        """field -> (value, the values ddtree accepts for it)."""
        return {
            "presence_penalty": (self.presence_penalty, (None, 0, 0.0)),
            "frequency_penalty": (self.frequency_penalty, (None, 0, 0.0)),
            "repetition_penalty": (self.repetition_penalty, (None, 1, 1.0)),
            "logit_bias": (self.logit_bias, (None, {})),
        }

    def check_supported(self) -> None:
        n = 1 if self.n is None else self.n
        if n > 1:
            raise DDTreeError(f"n > 1 is not supported: ddtree returns one choice per request; send {n} "
                              "requests instead (with different seeds when sampling)", "n")
        if n < 1:
            raise DDTreeError(f"n must be 1, got {n}", "n")
        if self.stream_options is not None and not self.stream:
            raise DDTreeError("stream_options is only allowed when stream is true", "stream_options")
        for name, (value, allowed) in self.neutral_only().items():
            if value not in allowed:
                raise DDTreeError(f"{name} is not supported by ddtree (only its neutral value {allowed[-1]!r})", name)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for this request (validated; raises DDTreeError)."""
        self.check_supported()
        return SamplingParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=[] if self.stop is None else self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
        )

    def requested_logprobs(self) -> int | None:
        """None, or how many top alternatives each emitted token's log-prob comes with."""
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_stop_limits(self, max_stop: int, max_stop_chars: int) -> None:
        """Refuse stop lists that would cost every decoded token more than a bounded check."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > max_stop:
            raise DDTreeError(f"stop holds {len(stops)} strings; this server takes at most {max_stop} (--max-stop)",
                              "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > max_stop_chars:
            raise DDTreeError(f"stop strings may be at most {max_stop_chars} characters long (--max-stop-chars), "
                              f"got one of {longest}", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > max_stop:
            raise DDTreeError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; this server takes at most "
                              f"{max_stop} (--max-stop)", "stop_token_ids")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[Int], list[str], list[list[Int]]] = Field(
        ..., description="text or token ids; a list holding one prompt is accepted too")
    echo: bool = False
    logprobs: Optional[TopLogprobs] = Field(None, description="the emitted tokens' log-probs and this many top alternatives")
    best_of: Optional[Int] = None
    suffix: Optional[str] = None

    def neutral_only(self) -> dict[str, tuple[Any, tuple]]:
        return {**super().neutral_only(), "echo": (self.echo, (False,)), "best_of": (self.best_of, (None, 1)), "suffix": (self.suffix, (None,))}

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids; a batch of several prompts is rejected."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise DDTreeError(f"one prompt per request is supported, got a batch of {len(prompt)}; "
                                  "send one request per prompt", "prompt")
            prompt = prompt[0]
        return prompt


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[PositiveInt] = Field(None, description="preferred over max_tokens when both are set")
    logprobs: Optional[bool] = Field(False, description="return the emitted tokens' log-probs")
    top_logprobs: Optional[TopLogprobs] = Field(None, description="with logprobs: this many top alternatives")

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise DDTreeError("top_logprobs needs logprobs: true", "top_logprobs")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


# -- errors ------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


MAX_PARAM_CHARS = 100  # a field path longer than this (a megabyte-long unknown key) is cut, not echoed


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    if param is not None and len(param) > MAX_PARAM_CHARS:
        param = param[: MAX_PARAM_CHARS - 3] + "..."
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Union member tags pydantic puts in error locations; they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "StreamOptions", "ChatMessage"}


def _field_path(loc) -> list[str]:
    return [str(p) for p in loc if isinstance(p, int) or (p not in _TYPE_TAGS and "[" not in str(p))]


def validation_error_body(errors: list[dict]) -> dict:
    """pydantic's list of errors -> one OpenAI error body naming the first problem."""
    first = errors[0] if errors else {"type": "missing", "loc": (), "msg": "request body is required"}
    kind = first.get("type", "")
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:  # FastAPI's prefix
        loc = loc[1:]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return error_body(f"request body is not valid JSON: {reason}", code="invalid_json")
    # An unknown key is the last element of its location, whatever it is called ("", "str", ...).
    path = _field_path(loc[:-1]) + [str(loc[-1])] if kind == "extra_forbidden" and loc else _field_path(loc)
    param = ".".join(path) if path else None
    if not path:
        if kind == "missing":
            return error_body("request body is required: a JSON object", code="invalid_value")
        return error_body("request body must be a JSON object", code="invalid_value")
    named = shown(param)[1:-1]  # cut, if it is a megabyte-long key
    if kind == "extra_forbidden":
        return error_body(f"unsupported field '{named}'", param=param, code="unsupported_parameter")
    if kind == "missing":
        return error_body(f"{named} is required", param=param, code="missing_required_parameter")
    return error_body(f"{named}: {first.get('msg', 'invalid value')}, got {shown(first.get('input'))}", param=param,
                      code="invalid_value")
