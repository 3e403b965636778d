"""Server configuration: one pydantic model, filled from a YAML file and/or command-line flags.

Unknown keys and bad values are refused with a MedusaError that names the key, so a typo in a config file
never silently falls back to a default.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from medusa.io import read_yaml, validate
from medusa.decoding.target.hardware import check_dtype_spelling

PolicyMode = Literal["dynamic", "heads", "draft", "plain"]
# Retrieval's trees were once named suffix-N, then suffix:N; they are named as the mode is now, retrieval:N.
OLD_RETRIEVAL_TREE = re.compile(r"suffix[-:](\d+)")

log = logging.getLogger("medusa.serve.app")


class PolicyConfig(BaseModel):
    """How each engine step chooses between the runtime's heads ("heads": Medusa or feature heads,
    whichever `heads` names), a draft model and plain decoding."""

    model_config = ConfigDict(extra="forbid")

    mode: PolicyMode = "dynamic"
    # Load (running rows + queued requests) at which speculation switches off, and at which it switches
    # back on. The gap between them is the hysteresis that stops the mode flapping at one load level.
    high_watermark: int = Field(8, ge=1)
    low_watermark: int = Field(4, ge=0)
    # The heads' tree per running batch size: the largest key <= batch size applies. Medusa heads take
    # static trees (`tree-8`, `chain-K`, a path) or dynamic ones (`dynamic-N[xD[xK]]`), feature heads
    # dynamic ones only; without heads, retrieval's `retrieval:N`. Unset: the calibrated plans, else tree-8
    # (Medusa), dynamic-16x5x8 (feature) or retrieval:16 (no heads).
    trees: dict[int, str] | None = None
    # Acceptance gate (per batch-size bucket): mean tokens per row-step (tau) over the last `window`
    # speculative steps; below max(min_tau, measured spec/plain step-time ratio) speculation pauses for
    # `retry_after_steps` steps (doubling on repeated failure) and is then tried again.
    window: int = Field(16, ge=1)
    min_tau: float = Field(1.3, ge=1.0)
    retry_after_steps: int = Field(128, ge=1)
    # Evaluator cost-model JSON ({"recommendation": {"<batch size>": "heads"|"draft"|"plain"},
    # optional "best_tree": {"<batch size>": "<tree name or path>"}}); it overrides watermarks and trees.
    cost_model: str | None = None
    # Without a cost_model file, derive the watermarks and trees from this machine's calibrated pass-cost
    # curve and the heads' held-out accuracy (what `medusa generate --mode auto` does), when the heads
    # have an eval.json to predict from.
    calibrate: bool = True

    @field_validator("mode", mode="before")
    @classmethod
    def _old_mode_name(cls, mode):
        """The heads' earlier mode name, `medusa`, still works, and says what it is called now."""
        from medusa.runtime.proposers import current_spelling

        return current_spelling(mode, "policy.mode") if mode == "medusa" else mode

    @field_validator("trees")
    @classmethod
    def _old_tree_names(cls, trees: dict[int, str] | None) -> dict[int, str] | None:
        """The old spelling of retrieval's trees still works, and says what it is called now."""
        if trees is None:
            return None
        out = {}
        for size, name in trees.items():
            m = OLD_RETRIEVAL_TREE.fullmatch(name)
            if m:
                log.warning("policy.trees: %r is spelled %r now (retrieval's trees are named as its mode); "
                            "read as such", name, f"retrieval:{m.group(1)}")
                name = f"retrieval:{m.group(1)}"
            out[size] = name
        return out

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.low_watermark >= self.high_watermark:
            raise ValueError(f"low_watermark ({self.low_watermark}) must be below high_watermark "
                             f"({self.high_watermark})")
        if self.trees is not None and (not self.trees or min(self.trees) < 1):
            raise ValueError("trees needs at least one entry, keyed by batch sizes >= 1")
        return self


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    heads: str = "default"
    draft: str | None = None
    draft_k: int = Field(4, ge=1, le=16)
    # Drafts from the text itself (prompt and output so far) grafted into the heads' dynamic trees
    # (`medusa.decoding.proposers.retrieval`); false: the heads alone.
    retrieval: bool = True
    datastore: str | None = None  # a corpus retrieval also drafts from (`medusa datastore build`)
    dtype: str = "auto"  # auto: bf16 where the hardware multiplies it natively, fp32 elsewhere
    # A request's tokens never depend on the other requests in its batch (medusa.decoding.target.invariant): greedy
    # streams equal their solo runs and seeded sampling its n=1 run, in bf16 too; costs speed.
    batch_invariant: bool = False
    device: str | None = None
    # torch CPU threads of the engine. Default on CPU: all cores but one. The HTTP side (event loop,
    # SSE writes) and local clients need a core; engine threads that share cores with them stall at
    # every parallel region, which on a 2-core machine nearly halved decode speed.
    threads: int | None = Field(None, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None  # the id clients pass as `model` (default: the model's name)
    max_batch: int = Field(32, ge=1, le=1024)  # rows decoded together (KV cache slots)
    max_context: int = Field(2048, ge=16)  # prompt + completion tokens per request
    default_max_tokens: int = Field(256, ge=1)
    max_queue: int = Field(64, ge=0)  # requests waiting for a slot; beyond it new ones get 429
    queue_timeout_s: float = Field(60.0, gt=0)
    # Prompt tokens prefilled at a step boundary (medusa.serve.prefill): "auto" sizes the prefill pass to
    # take at most prefill_stall x the running rows' decode pass, so long prompts are prefilled in chunks and
    # running streams keep their pace (inter-token latency within 1 + prefill_stall of their own); N: a fixed
    # budget of N tokens per step, shared with the decode pass's tokens.
    prefill_tokens_per_step: int | Literal["auto"] = "auto"
    # The step-time target running streams keep while prompts are prefilled (medusa.serve.prefill): ms
    # ("80ms", "80", 80) or a multiple of a stream's step alone ("2x"); each step's prefill chunk fills what
    # the target leaves of it. Unset: "2x", unless prefill_stall is set (the older dial, relative to the
    # running rows' own step; the two are exclusive).
    tpot_slo: str | float | None = None
    prefill_stall: float | None = Field(None, gt=0, le=100)
    chunked_prefill: bool = True  # false: a prompt longer than the budget is prefilled whole, stalling the rest
    # Prefix cache (medusa.serve.prefix): K/V of prompt prefixes (and of finished answers) kept in blocks of
    # prefix_cache_block tokens and reused by later prompts that start with the same tokens.
    prefix_cache: bool = True
    prefix_cache_mb: float | None = Field(None, gt=0)  # its budget; unset: min(10% of available memory, 2 GiB)
    prefix_cache_block: int = Field(16, ge=1, le=4096)
    # Compiled CPU kernels kept per matrix shape, in each of oneDNN's two caches (medusa.decoding.target.hardware:
    # a few hundred KB per entry; RSS grows until they are full). Unset: the library's 1024 each.
    kernel_cache_entries: int | None = Field(None, ge=1)
    # Largest request body accepted (bytes); larger ones get 413 before they are read. 1 MiB holds any
    # prompt that fits a 2048-token context many times over.
    max_body_bytes: int = Field(1 << 20, ge=1024)
    # Connection deadlines (medusa.serve.connection): a request's headers must arrive within
    # header_timeout_s of its first byte and its body within body_timeout_s of its headers (408), and an
    # idle keep-alive connection is closed after keepalive_timeout_s.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(5.0, gt=0)
    # Largest request head (request line + headers) accepted, however its bytes arrive; larger gets 431.
    max_header_bytes: int = Field(16384, ge=1024, le=1 << 20)
    # Bound to a loopback address without an API key, requests must name this server in `Host` (localhost,
    # 127.0.0.1, [::1], or a name listed here) and any `Origin` must be the server's own or a cors_origins
    # entry (403 otherwise): a web page the user visits, or a DNS name rebound to 127.0.0.1, cannot use it.
    allowed_hosts: list[str] = Field(default_factory=list)
    # Origins (scheme://host[:port]) that pages may call this server from, with CORS headers; empty: no CORS.
    cors_origins: list[str] = Field(default_factory=list)
    # Clients must send `Authorization: Bearer <api_key>` on /v1/* (401 otherwise); /health and /metrics stay
    # open. Unset: the MEDUSA_API_KEY environment variable, if set, is the key; else no key is needed.
    api_key: str | None = Field(None, min_length=1)
    # Serve the OpenAPI schema and its pages (/openapi.json, /docs, /redoc); off so a public server does
    # not advertise itself.
    docs: bool = False
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return check_dtype_spelling(v)

    @field_validator("tpot_slo")
    @classmethod
    def _tpot_slo(cls, v: str | float | None) -> str | float | None:
        if v is not None:
            from medusa.serve.prefill import parse_tpot_slo

            parse_tpot_slo(v)  # raises ValueError naming the accepted forms
        return v

    @model_validator(mode="after")
    def _latency_dials(self) -> "ServeConfig":
        if self.tpot_slo is not None and self.prefill_stall is not None:
            raise ValueError("tpot_slo (--tpot-slo) and prefill_stall (--prefill-stall) both size the prefill "
                             "chunks; set one of them")
        return self

    @field_validator("prefill_tokens_per_step")
    @classmethod
    def _prefill_tokens(cls, v: int | str) -> int | str:
        if v != "auto" and v < 1:
            raise ValueError("must be 'auto' or a positive number of tokens")
        return v


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """Read a YAML config (optional), apply non-None overrides (flags), validate."""
    data: dict[str, Any] = {}
    source = "serve config"
    if path is not None:
        data = read_yaml(path)
        source = str(path)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return validate(ServeConfig, data, source)
