"""Request schemas and validation errors in OpenAI's error body shape.

Bodies are parsed with ``model_validate_json(strict=True)``: malformed JSON, wrong types
(``"max_tokens": "5"``), out-of-range values and unknown fields all become an
``ApiError`` (HTTP 400) whose body is ``{"error": {"message", "type", "param", "code"}}``,
as OpenAI answers. Fields OpenAI accepts but eyas cannot honour are accepted at their
neutral value and refused otherwise, with a message saying so.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Stop = str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class _Sampling(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's convention)
    seed: int | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=1)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # eyas extension: false = plain decoding for this request (compare with and without the drafter)
    speculate: bool = True
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


class TritonParameters(_Strict):
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    stop: Stop = None
    stream: bool | None = None
    exclude_input_in_output: bool | None = None
    speculate: bool = True  # eyas extension, as on the OpenAI endpoints


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
    seed: int | None = None
    stream: bool | None = None
    bad_words: Literal[""] | list[None] | None = None
    stop_words: str | list[str] | None = None

    def merged(self) -> TritonParameters:
        top = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stream")}
        if self.stop_words:
            top["stop"] = [self.stop_words] if isinstance(self.stop_words, str) else self.stop_words
        given = self.parameters.model_dump(exclude_none=True)
        return TritonParameters.model_validate({**{k: v for k, v in top.items() if v is not None}, **given})


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body; any problem -> ApiError 400 naming the field and what is wrong."""
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
