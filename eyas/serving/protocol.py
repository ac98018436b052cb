"""Request schemas and validation errors in OpenAI's error body shape.

Bodies are parsed with ``model_validate_json(strict=True)``: malformed JSON, duplicate keys
(which JSON parsers disagree on: pydantic keeps the last, so ``model`` could be smuggled),
wrong types (``"max_tokens": "5"``), out-of-range values (a ``seed`` outside a signed 64-bit
integer, an empty stop string) and unknown fields all become an ``ApiError`` (HTTP 400) whose
body is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers; on ``/v2`` the
app renders the same error in Triton's shape, ``{"error": "message"}``. Fields OpenAI accepts
but eyas cannot honour are accepted at their neutral value and refused otherwise, with a
message saying so. A valid request becomes one typed ``RequestSettings`` (``settings``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eyas.types import SEED_MAX, SEED_MIN, RequestSettings, SamplingParams

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
StopString = Annotated[str, Field(min_length=1)]  # "" would end every generation at once
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]  # what torch.Generator takes (vLLM's range)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers  # extra response headers (WWW-Authenticate, Connection: close)

    def body(self) -> dict:
        """OpenAI's error shape (``/v1``)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def triton_body(self) -> dict:
        """Triton's error shape (``/v2``): one string."""
        return {"error": self.message}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Decoding(_Strict):
    """The fields every generation route shares; ``settings`` types them for the decoder."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's convention)
    seed: Seed | None = None
    stop: Stop = None
    # eyas extension: false = plain decoding for this request (compare with and without the drafter)
    speculate: bool = True

    def settings(self, max_new_tokens: int) -> RequestSettings:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        sampling = SamplingParams(
            temperature=self.temperature or 0.0, top_k=max(self.top_k or 0, 0), top_p=self.top_p or 1.0
        )
        return RequestSettings(max_new_tokens, sampling, self.seed, self.speculate, stop)


class _Sampling(_Decoding):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted at their neutral values only (checked in ``unsupported``)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[tuple[str, object]]:
        """(field, value) pairs set to something eyas cannot honour."""
        bad = [(k, getattr(self, k)) for k in ("presence_penalty", "frequency_penalty") if getattr(self, k)]
        if self.logit_bias:
            bad.append(("logit_bias", self.logit_bias))
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "only allowed when stream is true"))
        return bad


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )
    echo: Literal[False] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    logprobs: None = None
    suffix: None = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def token_limit(self) -> int | None:
        return self.max_tokens

    def token_limit_name(self) -> str:
        return "max_tokens"


class TritonParameters(_Decoding):
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    exclude_input_in_output: bool | None = None


class TritonRequest(_Strict):
    """Triton's generate extension: ``{"text_input": ..., "parameters": {...}}``.

    TensorRT-LLM ensembles send parameters as top-level fields (``max_tokens``,
    ``bad_words``, ``stop_words``); those are accepted too, ``parameters`` wins.
    """

    text_input: Annotated[str, Field(min_length=1)]
    parameters: TritonParameters = Field(default_factory=TritonParameters)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    bad_words: Literal[""] | list[None] | None = None
    stop_words: Stop = None  # as ``stop``: at most 4, none empty

    def merged(self) -> TritonParameters:
        """Top-level fields under ``parameters`` (which wins); a bad combination is an ApiError 400."""
        top = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stream")}
        if self.stop_words:
            top["stop"] = self.stop_words
        given = self.parameters.model_dump(exclude_none=True, exclude_unset=True)
        try:
            return TritonParameters.model_validate({**{k: v for k, v in top.items() if v is not None}, **given})
        except ValidationError as e:  # every field was checked above; this is a safety net, never a 500
            raise _to_api_error(e) from None


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body; any problem -> ApiError 400 naming the field and what is wrong."""
    check_json(body)
    try:
        req = model.model_validate_json(body or b"", strict=True)
    except ValidationError as e:
        raise _to_api_error(e) from None
    bad = req.unsupported() if hasattr(req, "unsupported") else []
    if bad:
        field_, value = bad[0]
        raise ApiError(
            400, f"{field_}={value!r} is not supported by this server", field_, "unsupported_parameter"
        )
    return req


class _DuplicateKey(Exception):
    pass


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def check_json(body: bytes) -> None:
    """ApiError 400 unless ``body`` is one strict JSON document whose objects never repeat a key.

    Python's parser is the judge of syntax: pydantic's accepts trailing data after the document
    (``{} x``) and ``NaN``; duplicate keys are caught here, pydantic keeps the last one silently.
    """
    try:
        json.loads(body, object_pairs_hook=_unique_pairs, parse_constant=_no_constant)
    except _DuplicateKey as e:
        key = str(e.args[0])
        raise ApiError(
            400, f"Duplicate key '{key}' in the JSON body: send each parameter once.", key, "duplicate_key"
        ) from None
    except RecursionError:
        raise ApiError(
            400, "The JSON body is nested too deeply. Send a valid JSON object.", None, "invalid_json"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise ApiError(
            400,
            f"We could not parse the JSON body of your request ({e}). Send a valid JSON object.",
            None,
            "invalid_json",
        ) from None


def _to_api_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x))
    kind = err["type"]
    if kind == "json_invalid":
        return ApiError(
            400,
            f"We could not parse the JSON body of your request ({err['msg']}). Send a valid JSON object.",
            None,
            "invalid_json",
        )
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {loc}", loc, "unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{loc}'.", loc, "missing_required_parameter")
    if not loc:
        return ApiError(400, f"The request body must be a JSON object ({err['msg']}).", None, "invalid_body")
    more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
    return ApiError(400, f"Invalid value for '{loc}': {err['msg']}{more}.", loc, "invalid_value")


def _is_type_tag(x: object) -> bool:
    """Union branch names pydantic puts in error locations, e.g. 'str' or 'list[str]'."""
    return isinstance(x, str) and (
        x in {"str", "int", "float", "bool", "none"}
        or "[" in x
        or x.startswith(("function-", "constrained-", "literal["))
    )
