"""Request bodies of the OpenAI API subset we serve, validated by pydantic.

Unknown fields are refused rather than ignored: a client that sends a field expecting it to work should hear
that it does not. OpenAI fields this server does not implement are accepted at their neutral value (the one
that leaves the output as it is: `presence_penalty: 0`, `logit_bias: {}`, `echo: false` ...), which many
clients send by default, and refused with a 400 naming the field at any other value. Every number has
bounds and every string a length limit, so nothing a client sends can reach the engine as a value it
cannot handle (a seed torch refuses, a NaN temperature).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256
MAX_TOKENS = 1 << 20  # far above any context; the server's own context check gives the precise limit
MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 64) - 1  # OpenAI documents seed as an integer; we accept the unsigned 64-bit range
MAX_MESSAGES = 1024
MAX_N = 16  # choices per request; each is a batch row
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for chat)
MAX_METADATA = 16
TOKEN_ID_MAX = (1 << 31) - 1  # the vocabulary check against the model comes after

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


def torch_seed(seed: int) -> int:
    """A request seed in [0, 2**64 - 1] as a seed `torch.Generator.manual_seed` accepts: the same bits.

    torch takes [-2**63, 2**64 - 1], so this is the identity on validated input; the mask keeps an
    unvalidated caller (a test, a future field) from reaching torch with a value it raises on."""
    return seed & MAX_SEED


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n` > 1: the request's own for choice 0 (so n = 1 is
    unchanged), a hash of (seed, index) for the others, so choices differ yet the request reproduces."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _only(value: Any, neutral: tuple, field: str, what: str) -> Any:
    """Accept a field this server does not implement only at a value that leaves the output unchanged."""
    if value is None or value in neutral:
        return value
    raise ValueError(f"{field} is not supported by this server; only {what} is accepted")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Name | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(_Strict):
    model: Name
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K, description="0 or absent: no top-k cut")
    stop: StopString | list[StopString] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM's extensions: the prompt's and each choice's token ids in the response; tokens in logprobs
    # written as "token_id:<id>".
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Accepted at their neutral values only (see the module docstring).
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[Name, float] | None = None
    service_tier: Name | None = None  # scheduling only: no effect on the output

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: Any) -> float | None:
        return _only(v, (0,), info.field_name, "0")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        return _only(v, ({},), "logit_bias", "an empty object (or null)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(items)}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Accepted at their neutral values only.
    tools: list[dict[Name, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "auto" with no tools calls none
    parallel_tool_calls: bool | None = None  # only meaningful with tools
    response_format: dict[Name, Any] | None = None
    store: bool | None = None  # this server stores nothing; the output is the same either way
    metadata: dict[Name, Name] | None = Field(None, max_length=MAX_METADATA)
    modalities: list[Literal["text"]] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        return _only(v, ([],), "tools", "an empty list (or null)")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        return _only(v, ({"type": "text"},), "response_format", '{"type": "text"}')

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprobs_k(self) -> int | None:
        """None when no log-probabilities are wanted, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Accepted at their neutral values only.
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Name | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        return _only(v, (False,), "echo", "false")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None, info: Any) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v != n:
            raise ValueError(f"best_of is not supported by this server; only best_of = n ({n}) is accepted")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        return _only(v, ("",), "suffix", "an empty string (or null)")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError(f"exactly one prompt per request is supported, got {len(v)}")
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (OpenAI's shape)."""

    error: ErrorDetail
