"""The evaluation config: which methods run, on which prompts, batch sizes and sampling, and the cost-model
grid; read from YAML with command-line overrides and validated so an error names the bad key."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from medusa.decoding.target.hardware import check_dtype_spelling
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.trees.tree import DEFAULT_TREE
from medusa.errors import MedusaError
from medusa.io import read_yaml, validate
from medusa.runtime.proposers import MODES, current_spelling

OURS = MODES  # our engine's methods: the mode names of `medusa.runtime.proposers`
HF = ("hf", "hf_assisted", "hf_lookup")
BATCH_ONE_ONLY = ("hf_assisted", "hf_lookup")  # HF runs these for batch size 1 only


class MethodSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # auto: default flags (`medusa generate` without --mode): auto mode's planned trees behind its gate
    method: Literal[(*OURS, "auto", *HF)]
    label: str | None = None
    tree: str | None = None           # heads: tree file or shipped name
    draft: str | None = None          # draft / hf_assisted: see medusa.decoding.proposers.draft.load_draft
    k: int | None = Field(default=None, ge=1, le=64)  # draft chain length / lookup tokens / retrieval tree nodes
    max_ngram: int = Field(default=3, ge=1)
    heads: str | None = None          # feature: feature heads directory (default: the shipped ones)

    @field_validator("method", mode="before")
    @classmethod
    def _current_spelling(cls, v):
        return current_spelling(v, "methods[].method") if isinstance(v, str) else v

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.method in ("feature", "feature+retrieval"):  # tree: dynamic-N[xD[xK]], or None for the planned size
            return f"{self.method}:{self.tree or 'planned'}"
        if self.method == "heads":
            return f"heads:{Path(self.tree or DEFAULT_TREE).stem}"
        return self.method


class CostModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    tokens: list[int] = [1, 2, 4, 8, 16, 32, 64]
    prefix: int = Field(default=256, ge=1)
    repeats: int = Field(default=5, ge=1)


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "default"
    heads: str = "default"
    datastore: str | None = None      # a corpus the retrieval methods also draft from (`medusa datastore build`)
    dtype: str = "auto"               # auto (the machine's choice), bf16, fp16, fp32 (and their long names)
    device: str | None = None
    # mtbench, sharegpt or a local .txt/.json/.jsonl/.parquet file; or a list of them, `max_prompts` from each
    prompts: str | list[str] = "mtbench"
    raw_prompts: bool = False         # tokenise prompts as raw text (no chat template)
    max_prompts: int = Field(default=16, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    batch_sizes: list[int] = [1, 2, 4, 8, 16, 32, 64]
    repeats: int = Field(default=3, ge=1)
    warmup: bool = True
    threads: int | None = Field(default=None, ge=1)
    methods: list[MethodSpec] = [MethodSpec(method="plain"), MethodSpec(method="heads", tree=DEFAULT_TREE),
                                 MethodSpec(method="draft", draft="default", k=4),
                                 MethodSpec(method="lookup", k=8),
                                 MethodSpec(method="hf"), MethodSpec(method="hf_assisted", draft="default", k=4),
                                 MethodSpec(method="hf_lookup", k=10)]
    hf_batch_sizes: list[int] = [1]   # HF plain generate() is slow on CPU: only these batch sizes
    hf_repeats: int | None = Field(default=None, ge=1)  # fewer rounds for the (slow) HF anchors
    # Sampled decoding (temperature > 0): every method samples; speculative methods accept by `acceptance`
    # (rejection: the target's distribution exactly; typical: more tokens, not lossless). Outputs then
    # differ run to run, so greedy_mismatches is not computed.
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    acceptance: Literal["rejection", "typical"] = "rejection"
    seed: int = 0
    # Every method batch-invariant (`medusa generate --batch-invariant on`): in bf16 a row's tokens then do
    # not depend on its batch or tree, so greedy outputs match plain decoding's (0 mismatches).
    batch_invariant: bool = False
    cost_model: CostModelSpec = CostModelSpec()

    @property
    def sources(self) -> list[str]:
        return [self.prompts] if isinstance(self.prompts, str) else list(self.prompts)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def sampling(self, request: int) -> SamplingParams | None:
        """Request `request`'s parameters (seeded per request: the same draws whatever its batch)."""
        if not self.sampled:
            return None
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, acceptance=self.acceptance,
                              seed=self.seed * 1_000_003 + request)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return check_dtype_spelling(v)

    @field_validator("batch_sizes", "hf_batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("must be a non-empty list of positive integers")
        return sorted(set(v))


def load_config(path: str | None, overrides: dict | None = None) -> EvalConfig:
    """The config at `path` (defaults without one), with the overrides that are not None on top."""
    data: dict = read_yaml(path) if path else {}
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    cfg = validate(EvalConfig, data, "eval config")
    names = [m.name for m in cfg.methods]
    if len(set(names)) != len(names):
        raise MedusaError(f"eval config: methods: duplicate method names {names}; set 'label'")
    if "plain" not in [m.method for m in cfg.methods]:
        cfg.methods.insert(0, MethodSpec(method="plain"))  # the reference every speedup is relative to
    return cfg
