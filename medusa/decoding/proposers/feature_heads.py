"""Feature heads (EAGLE-style): one decoder layer that drafts autoregressively from the target's features.

Medusa heads guess tokens 2, 3, 4 ... positions ahead in parallel, so head k never learns which token was
chosen before it. A feature head drafts one position at a time, feeding back its own output:

    input at position s:  the target feature f_s (the normed last hidden state, what feeds lm_head)
                          and the embedding of token x_{s+1}
    eagle1:  x = fc([emb(x_{s+1}), f_s])  (2h -> h, bias)  -> one decoder layer (no input norm)
             -> the predicted feature f^_{s+1}; logits = lm_head(f^_{s+1}) over the draft vocabulary
    eagle3:  h_s = fc(features of several target layers) (k*h -> h, no bias); attention input
             [norm(emb(x_{s+1})), norm(h_s)] (2h), residual h_s; output o_{s+1} -> norm -> lm_head

The layer is the target's own architecture (an HF decoder layer built from the target's config, trained
in torch; at inference the same weights run through `medusa.decoding.target.transformer`'s fused, packed layer code and
attention). The vocabulary projection reads only the draft vocabulary (the most frequent answer tokens,
`draft_ids`), mapped back to full ids. Drafting step j at position s feeds (f^_s, drafted token) and the
head's own small KV cache keeps every committed position: one per row, ragged, like the draft model's
(`medusa.decoding.proposers.draft`): entries are exact as long as the committed tokens they came from are unchanged.

This module holds the head itself (config, training-side forward, saving and loading); its inference copy
over a ragged KV cache is `medusa.decoding.proposers.feature_proposer`, the proposer
`medusa.decoding.proposers.feature_proposer`.

On disk (`medusa export` / `save`): ours (`heads.json` with `"kind": "feature"` + `feature_head.safetensors`),
EAGLE-1 (`config.json` one-layer Llama config, `fc.*`, `layers.0.*`) and EAGLE-3 (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`) as SafeAILab/EAGLE, vLLM and SGLang read them.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

from medusa.errors import MedusaError
from medusa.io import ASSETS
from medusa.decoding.target.transformer import causal

KIND = "feature"
STYLES = ("eagle1", "eagle3")
# The name under which an HF attention module takes its KV cache (renamed from past_key_values in 5.x).
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"
WEIGHTS = "feature_head.safetensors"
CONFIG = "heads.json"
SHIPPED_FEATURE_DIR = ASSETS / "feature_heads"



@dataclass
class FeatureHeadConfig:
    hidden_size: int
    vocab_size: int
    draft_vocab: int                 # ids the head scores (`draft_ids`); == vocab_size for the full vocabulary
    style: str = "eagle1"
    # eagle3: indices into HF `hidden_states` (0 = embeddings, i = after layer i) fused by fc; empty: the
    # final normed feature only.
    feature_layers: list[int] = field(default_factory=list)
    own_lm_head: bool = False        # False: the target's lm_head rows for draft_ids (frozen, not stored)
    base_model: str = ""
    kind: str = KIND

    @property
    def feature_dim(self) -> int:
        return self.hidden_size * max(1, len(self.feature_layers))


def read_kind(directory: str | Path) -> str | None:
    """'feature' for a feature-head directory (ours or an EAGLE layout), 'medusa' for Medusa heads, None."""
    d = Path(directory)
    if (d / CONFIG).exists():
        try:
            return json.loads((d / CONFIG).read_text()).get("kind", "medusa")
        except ValueError:
            return None
    if (d / "config.json").exists():
        try:
            meta = json.loads((d / "config.json").read_text())
        except ValueError:
            return None
        if "medusa_num_heads" in meta or meta.get("model_type") == "medusa":  # FasterDecoding's / vLLM's Medusa
            return "medusa"
        if _eagle_weights(d) is not None:
            return KIND
    return None


class FeatureHead(nn.Module):
    """The trainable head over a frozen target (an HF causal LM whose embeddings it borrows)."""

    def __init__(self, config: FeatureHeadConfig, target: nn.Module, draft_ids: torch.Tensor | None = None):
        super().__init__()
        if config.style not in STYLES:
            raise MedusaError(f"feature head style must be one of {', '.join(STYLES)}, got {config.style!r}")
        self.config = config
        h = config.hidden_size
        tcfg = copy.deepcopy(target.config)
        tcfg.num_hidden_layers = 1
        if getattr(tcfg, "layer_types", None):
            tcfg.layer_types = tcfg.layer_types[:1]
        self.layer_config = tcfg
        layer = type(target.model.layers[0])(tcfg, layer_idx=0)
        norm_cls = type(layer.input_layernorm)
        eps = getattr(tcfg, "rms_norm_eps", 1e-6)
        if config.style == "eagle3":
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
            self.hidden_norm = norm_cls(h, eps=eps)
            self.norm = norm_cls(h, eps=eps)
            self.fc = nn.Linear(config.feature_dim, h, bias=False)
        else:
            self.hidden_norm = None
            self.norm = None
            self.fc = nn.Linear(2 * h, h, bias=True)
            layer.input_layernorm.requires_grad_(False)  # eagle1 drops it: the fc output goes straight in
        self.layer = layer
        self.rotary = type(target.model.rotary_emb)(config=tcfg)
        ids = torch.arange(config.vocab_size) if draft_ids is None else draft_ids.long()
        if len(ids) != config.draft_vocab:
            raise MedusaError(f"draft vocabulary of {len(ids)} ids, config says {config.draft_vocab}")
        self.register_buffer("draft_ids", ids.clone())
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        self._target = [target]  # borrowed, never saved or trained
        self.bind(target)
        self._init_identity()

    def _init_identity(self) -> None:
        """Start as 'the next feature is the current one' (a useful prior; the layer adds a residual)."""
        h = self.config.hidden_size
        with torch.no_grad():
            if self.config.style == "eagle1":
                self.fc.weight.mul_(0.1)
                self.fc.weight[:, h:] += torch.eye(h)
                self.fc.bias.zero_()
            self.layer.self_attn.o_proj.weight.mul_(0.1)
            self.layer.mlp.down_proj.weight.mul_(0.1)

    def bind(self, target: nn.Module) -> "FeatureHead":
        """Use `target`'s embeddings (and, unless the head has its own, its lm_head rows for draft_ids)."""
        c = self.config
        w = target.get_output_embeddings().weight
        if (c.hidden_size, c.vocab_size) != (target.config.hidden_size, w.shape[0]):
            raise MedusaError(f"feature head made for hidden size {c.hidden_size} and vocabulary {c.vocab_size}, "
                              f"the model has {target.config.hidden_size} and {w.shape[0]}")
        if int(self.draft_ids.max()) >= w.shape[0] or int(self.draft_ids.min()) < 0:
            raise MedusaError("feature head draft_ids reach outside the model's vocabulary")
        n = len(target.model.layers)
        if any(not 0 <= i <= n for i in c.feature_layers):
            raise MedusaError(f"feature head fuses layers {c.feature_layers}, the model has {n}")
        self._target = [target]
        if not c.own_lm_head:
            with torch.no_grad():
                self.lm_head.weight.copy_(w.detach()[self.draft_ids.to(w.device)].to(self.lm_head.weight.dtype))
            self.lm_head.requires_grad_(False)
        return self

    @property
    def embed(self) -> nn.Module:
        return self._target[0].get_input_embeddings()

    # ---- training-side forward (plain torch over the HF modules) ----------------------------------
    def inputs(self, emb: torch.Tensor, hid: torch.Tensor, fused: bool) -> torch.Tensor:
        """The layer's residual input: eagle1 fc([emb, feature]); eagle3 fc(fused features) or, for a
        drafted step, the head's own previous output."""
        if self.config.style == "eagle1":
            return self.fc(torch.cat([emb, hid], dim=-1))
        return self.fc(hid) if fused else hid

    def layer_forward(self, emb: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """emb, x [B, T, h]; positions [B, T]; attention_mask [B, 1, T, K] additive, or None: causal (only
        while `cache` is empty). `cache`: a transformers `Cache` holding the keys and values of earlier blocks
        (K - T of them), which this block's are appended to (training's unrolled steps)."""
        layer = self.layer
        a_in = x if self.hidden_norm is None else torch.cat([layer.input_layernorm(emb), self.hidden_norm(x)], -1)
        cos, sin = self.rotary(x, positions)
        if attention_mask is None and self.layer_config._attn_implementation != "sdpa":
            t = x.shape[1]  # SDPA alone takes no mask as causal (its fast path); other kernels need one
            attention_mask = torch.zeros(t, t, dtype=x.dtype, device=x.device).masked_fill(
                ~causal(t, x.device), float("-inf"))[None, None]
        a = layer.self_attn(hidden_states=a_in, position_embeddings=(cos, sin), attention_mask=attention_mask,
                            **({CACHE_ARGUMENT: cache} if cache is not None else {}))[0]
        x = x + a
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer output [..., h] -> [..., draft_vocab]."""
        return self.lm_head(out if self.norm is None else self.norm(out))

    # ---- saving and loading ---------------------------------------------------------------------
    def own_state(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        if not self.config.own_lm_head:
            state.pop("lm_head.weight")
        if self.config.style == "eagle1":
            state.pop("layer.input_layernorm.weight", None)
        return state

    def save(self, directory: str | Path, meta: dict | None = None) -> Path:
        """Our layout, atomically: heads.json (kind: feature) + feature_head.safetensors (fp32 as trained)."""
        from medusa.io import write_atomic, write_json_atomic

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.own_state().items()}
        info = {**asdict(self.config), **(meta or {})}
        write_atomic(directory / WEIGHTS, lambda p: save_file(tensors, str(p)))
        write_json_atomic(directory / CONFIG, info)
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: nn.Module) -> "FeatureHead":
        """Ours or an EAGLE-1 / EAGLE-3 layout (detected from the files)."""
        d = SHIPPED_FEATURE_DIR if str(directory) == "default" else Path(directory)
        if (d / CONFIG).exists():
            info = json.loads((d / CONFIG).read_text())
            if info.get("kind") != KIND:
                raise MedusaError(f"--heads: {d} holds {info.get('kind', 'medusa')} heads, not feature heads")
            known = set(FeatureHeadConfig.__dataclass_fields__)
            config = FeatureHeadConfig(**{k: v for k, v in info.items() if k in known})
            state = load_file(str(d / WEIGHTS))
            head = cls(config, target, state["draft_ids"])
            missing, unexpected = head.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("rotary.") and k != "layer.input_layernorm.weight"
                       and (config.own_lm_head or k != "lm_head.weight")]
            if missing or unexpected:
                raise MedusaError(f"--heads: {d} does not match its heads.json (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
            head.bind(target)
        else:
            from medusa.decoding.proposers.feature_formats import load_eagle

            head = load_eagle(d, target)
        head.directory = d
        return head.to(device=target.get_output_embeddings().weight.device)

    directory: Path | None = None


def _eagle_weights(d: Path) -> Path | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (d / name).exists():
            return d / name
    return None
