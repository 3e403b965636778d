"""Request bodies of the OpenAI API subset we serve, validated by pydantic.

Unknown fields are refused rather than ignored: a client that sends `logprobs` or `n=3` expecting them to
work should hear that they do not. Every number has bounds and every string a length limit, so nothing a
client sends can reach the engine as a value it cannot handle (a seed torch refuses, a NaN temperature).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256
MAX_TOKENS = 1 << 20  # far above any context; the server's own context check gives the precise limit
MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 64) - 1  # OpenAI documents seed as an integer; we accept the unsigned 64-bit range
MAX_MESSAGES = 1024
TOKEN_ID_MAX = (1 << 31) - 1  # the vocabulary check against the model comes after

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


def torch_seed(seed: int) -> int:
    """A request seed in [0, 2**64 - 1] as a seed `torch.Generator.manual_seed` accepts: the same bits.

    torch takes [-2**63, 2**64 - 1], so this is the identity on validated input; the mask keeps an
    unvalidated caller (a test, a future field) from reaching torch with a value it raises on."""
    return seed & MAX_SEED


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
    n: int | None = Field(None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None

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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId]

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
