"""Training configuration: YAML validated by pydantic, every error names the offending key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from medusa.io import read_yaml, validate
from medusa.errors import MedusaError


class StrictConfig(BaseModel):
    """A config section that refuses unknown keys (a typo is an error, not a silently ignored key)."""

    model_config = ConfigDict(extra="forbid")


class SelfPromptsConfig(StrictConfig):
    """How the target writes its own training prompts (the source `self:N`, medusa.train.self_prompts)."""

    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = 0
    max_tokens: int = Field(default=128, gt=0)        # a prompt still unfinished at this length is dropped
    topics: str | None = None                         # a YAML list of topics or task kinds to spread over
    similarity: float = Field(default=0.7, gt=0.0, le=1.0)  # word 3-gram Jaccard of a near duplicate


SELF_SOURCE = re.compile(r"self:(\d+)")


def self_count(source: str) -> int | None:
    """N of a `self:N` source, None for any other source."""
    m = SELF_SOURCE.fullmatch(source)
    return int(m.group(1)) if m else None


class DataConfig(StrictConfig):
    # Prompt sources: "sharegpt", a local json/jsonl/parquet/txt file, a hub dataset id, or "self:N" (N
    # prompts the target writes itself, see self_prompts). "mtbench" is refused: it is the evaluation set.
    sources: list[str] = Field(default_factory=lambda: ["sharegpt"], min_length=1)
    self_prompts: SelfPromptsConfig = Field(default_factory=SelfPromptsConfig)
    limit: int | None = Field(default=None, gt=0)       # prompts to distil / to train on, over all sources
    max_prompt_tokens: int = Field(default=256, gt=0)   # longer prompts are skipped, not cut
    max_new_tokens: int = Field(default=192, gt=0)      # length of each distilled answer
    # Rows decoded at once by `medusa distill`; auto: the batch size of highest answer tokens per second on
    # this machine's measured pass-cost curve (medusa.train.distill.distill_batch_size).
    distill_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    shard_size: int = Field(default=64, gt=0)           # prompts per saved (resumable) shard
    distill_dir: str | None = None                      # default: <cache>/distill/<model>-<hash>
    # Training on the distilled answers (the target's own greedy outputs) or on the source's answers.
    use: Literal["distilled", "source"] = "distilled"
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    max_seq_tokens: int = Field(default=512, gt=8)

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[str]) -> list[str]:
        selfs = [s for s in v if s.startswith("self")]
        for s in selfs:
            if s != "self" and not s.startswith("self:"):
                continue  # a file or dataset whose name starts with "self"
            if self_count(s) is None or self_count(s) < 1:
                raise ValueError(f"{s!r}: write self:N with N a positive number of prompts, e.g. self:1000")
        if sum(self_count(s) is not None for s in v) > 1:
            raise ValueError("at most one self:N source")
        return v


class HeadsSection(StrictConfig):
    num_heads: int = Field(default=4, gt=0, le=16)
    num_layers: int = Field(default=1, gt=0, le=8)
    own_lm_head: bool = False
    # Export heads that propose only the N most frequent answer tokens (a cheaper proposal step).
    candidates: int | None = Field(default=None, gt=0)


class LossConfig(StrictConfig):
    decay: float = Field(default=0.8, gt=0.0, le=1.0)    # w_k = decay ** k
    weights: list[float] | None = None                  # explicit w_k, overrides decay
    kind: Literal["ce", "kl"] = "ce"                    # hard tokens, or the base's own distribution
    kl_temperature: float = Field(default=1.0, gt=0.0)
    # Training softmax over the answer tokens plus ids below this bound (None: the whole vocabulary).
    vocab_subset: int | None = Field(default=None, ge=0)


class OptimConfig(StrictConfig):
    lr: float = Field(default=1e-3, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(default=1.0, ge=0.0)       # 0 disables
    warmup_steps: int = Field(default=20, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)


class Medusa2Config(StrictConfig):
    enabled: bool = False
    lora_r: int = Field(default=8, gt=0)
    lora_alpha: int = Field(default=16, gt=0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    heads_only_steps: int = Field(default=20, ge=0)     # warm-up: only the heads train
    base_loss_weight: float = Field(default=1.0, ge=0.0)
    head_loss_weight: float = Field(default=0.2, ge=0.0)
    lora_lr: float | None = Field(default=None, gt=0.0)


class WandbConfig(StrictConfig):
    mode: Literal["offline", "disabled", "online"] = "offline"
    project: str = "medusa"
    name: str | None = None


class RunConfig(StrictConfig):
    """What every training run names first: the target, its dtype, the seed, where it writes, its data."""

    model: str = "default"
    # auto: bf16 where the hardware multiplies it natively, fp32 elsewhere; resolved when the config is read,
    # so caches keyed by the dtype (distilled data, hidden states) name the dtype really used.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    seed: int = 0
    run_dir: str = "runs/medusa"
    data: DataConfig = Field(default_factory=DataConfig)


class TrainConfig(RunConfig):
    heads: HeadsSection = Field(default_factory=HeadsSection)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    medusa2: Medusa2Config = Field(default_factory=Medusa2Config)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    cache_hidden: bool = True             # Medusa-1 fast path: hidden states computed once, reused
    batch_size: int = Field(default=256, gt=0)   # positions per step (cached) or sequences (plain), global
    grad_accum: int = Field(default=1, gt=0)
    epochs: float = Field(default=1.0, gt=0.0)
    max_steps: int | None = Field(default=None, gt=0)
    checkpoint_every: int = Field(default=200, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every: int = Field(default=10, gt=0)
    evaluate: bool = True                 # held-out accuracy (and trees) at the end of training
    eval_topk: int = Field(default=10, gt=0, le=50)
    # Trees written to <run_dir>/heads/trees/tree-{budget}.yaml; DEFAULT_TREE's budget (8) must be among them
    # for the heads to be exported to the shipped place.
    tree_budgets: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    deepspeed: str | None = None          # DeepSpeed JSON config, used when launched with several processes

    @field_validator("dtype")
    @classmethod
    def _resolve_dtype(cls, v: str) -> str:
        if v != "auto":
            return v
        from medusa.decoding.target.hardware import resolve_dtype
        from medusa.decoding.target.model import default_device

        return resolve_dtype("auto", default_device()).name

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if "mtbench" in self.data.sources:
            raise ValueError("data.sources: 'mtbench' is the evaluation set and cannot be trained on")
        if self.loss.weights is not None and len(self.loss.weights) != self.heads.num_heads:
            raise ValueError(f"loss.weights: {len(self.loss.weights)} weights for {self.heads.num_heads} heads")
        if self.medusa2.enabled and self.cache_hidden:
            raise ValueError("cache_hidden: the hidden-state cache needs a frozen base; set it to false "
                             "for medusa2")
        return self

    def head_weights(self) -> list[float]:
        if self.loss.weights is not None:
            return list(self.loss.weights)
        return [self.loss.decay ** k for k in range(self.heads.num_heads)]


# Keys that once made a run write outside its run_dir (into the shipped heads and trees).
REMOVED_KEYS = {
    "export_heads": "copy a run's heads with `medusa export --heads RUN_DIR/heads --out DIR` (or --to-shipped)",
    "write_trees": "trees are written to RUN_DIR/heads/trees; copy them with `medusa export`",
}


def parse_config(data: dict, where: str = "config") -> TrainConfig:
    for key, instead in REMOVED_KEYS.items():
        if isinstance(data, dict) and key in data:
            raise MedusaError(f"{where}: {key}: no longer a config key (a run writes only under its run_dir); "
                              f"{instead}")
    return validate(TrainConfig, data, where)


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Set `a.b=value` strings (value parsed as YAML) into a config's data, in place."""
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise MedusaError(f"--set: {item!r} must look like key.sub=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise MedusaError(f"--set: {key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config; `overrides` are `a.b=value` strings (value parsed as YAML)."""
    return parse_config(apply_overrides(read_yaml(path), overrides), str(path))
