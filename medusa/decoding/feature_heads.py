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
in torch; at inference the same weights run through `medusa.decoding.transformer`'s fused, packed layer code and
attention). The vocabulary projection reads only the draft vocabulary (the most frequent answer tokens,
`draft_ids`), mapped back to full ids. Drafting step j at position s feeds (f^_s, drafted token) and the
head's own small KV cache keeps every committed position: one per row, ragged, like the draft model's
(`medusa.decoding.draft`): entries are exact as long as the committed tokens they came from are unchanged.

Each engine step: the head catches up on the row's newly committed positions (their true features come
from the verification pass that accepted them), then grows a dynamic tree (`medusa.decoding.dynamic_tree`) of
`nodes` candidates, `depth` draft steps deep, expanding the `topk` best frontier nodes each step.

On disk (`medusa export` / `save`): ours (`heads.json` with `"kind": "feature"` + `feature_head.safetensors`),
EAGLE-1 (`config.json` one-layer Llama config, `fc.*`, `layers.0.*`) and EAGLE-3 (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`) as SafeAILab/EAGLE, vLLM and SGLang read them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.decoding.dynamic_tree import NEG, Pool, RowTrees, expand, stand_in_tree
from medusa.errors import MedusaError
from medusa.io import ASSETS
from medusa.decoding.sampling import MODE_REJECTION, sample_from
from medusa.decoding.transformer import (FP32_ATTENTION_ROWS, SHORT_BLOCK, KVCache, RMSNorm, Transformer, _attention, _Layer,
                          _packed, _rope_, _rope_tables, _short_block_bias)
from medusa.decoding.verifier import Verdict

if TYPE_CHECKING:
    from medusa.decoding.engine import Batch

KIND = "feature"
STYLES = ("eagle1", "eagle3")
WEIGHTS = "feature_head.safetensors"
CONFIG = "heads.json"
AUX_KEY = "feature"
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
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
        """emb, x [B, T, h]; positions [B, T]; attention_mask [B, 1, T, T] additive or None (causal)."""
        layer = self.layer
        a_in = x if self.hidden_norm is None else torch.cat([layer.input_layernorm(emb), self.hidden_norm(x)], -1)
        cos, sin = self.rotary(x, positions)
        if attention_mask is None:
            t = x.shape[1]
            attention_mask = torch.zeros(t, t, dtype=x.dtype, device=x.device).masked_fill(
                ~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))[None, None]
        a = layer.self_attn(hidden_states=a_in, position_embeddings=(cos, sin), attention_mask=attention_mask)[0]
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
            from medusa.decoding.feature_formats import load_eagle

            head = load_eagle(d, target)
        head.directory = d
        return head.to(device=target.get_output_embeddings().weight.device)

    directory: Path | None = None


def _eagle_weights(d: Path) -> Path | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (d / name).exists():
            return d / name
    return None


# ---- inference: the head over its own ragged KV cache ---------------------------------------------


class _HeadLayer(_Layer):
    """`medusa.decoding.transformer._Layer` (fused, packed projections, the shared attention) with the head's
    inputs: eagle1 attends over x itself (no input norm); eagle3 over [norm(emb), norm(x)], residual x."""

    def __init__(self, head: FeatureHead, head_dim: int):
        super().__init__(head.layer, head_dim)
        self.hnorm = RMSNorm(head.hidden_norm) if head.hidden_norm is not None else None

    def forward(self, emb, x, rope, kv, row_idx, slots, mask, bias):  # noqa: D401 (same contract as _Layer)
        b, t, _ = x.shape
        d, nq, nkv = self.head_dim, self.nq, self.nkv
        a_in = x if self.hnorm is None else torch.cat([self.ln1.forward(emb), self.hnorm.forward(x)], -1)
        qkv = self.wqkv.forward(a_in).view(b, t, nq + 2 * nkv, d)
        if self.q_norm is not None:
            qkv[:, :, :nq] = self.q_norm.forward(qkv[:, :, :nq])
            qkv[:, :, nq: nq + nkv] = self.k_norm.forward(qkv[:, :, nq: nq + nkv])
        _rope_(qkv[:, :, : nq + nkv], *rope)
        kv[:, row_idx, :, slots] = qkv[:, :, nq:].unflatten(2, (2, nkv)).to(kv.dtype)
        o = _attention(qkv[:, :, :nq], kv[0], kv[1], mask, bias, self.scale)
        x = self.wo.plus(o, x)
        gate, up = self.w13.forward(self.ln2.forward(x)).chunk(2, dim=-1)
        return self.w2.plus(F.silu(gate) * up, x)


class HeadRunner(nn.Module):
    """The head's inference copy in the target's dtype: packed weights, a pass over a ragged cache."""

    def __init__(self, head: FeatureHead, dtype: torch.dtype, vocab: int | None = None):
        super().__init__()
        original, embed, borrowed = head, head.embed, head._target
        original._target = []  # the target is borrowed: never copied
        try:
            head = copy.deepcopy(original).to(dtype)
        finally:
            original._target = borrowed
        cfg = head.layer_config
        self.config = head.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer = _HeadLayer(head, self.head_dim)
        self.fc = _packed(head.fc.requires_grad_(False))
        lm = head.lm_head.requires_grad_(False)
        ids = head.draft_ids
        if vocab is not None and vocab < len(ids):  # the first `vocab` draft ids (trained heads: most frequent)
            lm = nn.Linear(lm.in_features, vocab, bias=False, dtype=dtype).requires_grad_(False)
            lm.weight.data.copy_(head.lm_head.weight[:vocab])
            ids = ids[:vocab]
        self.lm_head = _packed(lm)
        self.norm = RMSNorm(head.norm) if head.norm is not None else None
        self.rotary = head.rotary
        self._embed = [embed]
        self.register_buffer("draft_ids", ids.clone(), persistent=False)
        self.vocab = len(ids)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.draft_ids.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        kv_dtype = torch.float32 if self.device.type == "cpu" and rows <= FP32_ATTENTION_ROWS else self.dtype
        return KVCache(1, rows, self.n_kv, capacity, self.head_dim, kv_dtype, self.device)

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding of tokens, the layer's residual input) for tokens [B, T], feats [B, T, F or h]."""
        emb = self._embed[0](tokens).to(self.dtype)
        if self.config.style == "eagle1":
            return emb, self.fc.forward(torch.cat([emb, feats.to(self.dtype)], -1))
        return emb, self.fc.forward(feats.to(self.dtype)) if fused else feats

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(out if self.norm is None else self.norm.forward(out))

    def forward(self, emb: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
                used: int, visible: torch.Tensor) -> torch.Tensor:
        """One pass of t entries per row written after `used` draft entries past each row's committed length
        (cache.lens). visible [B, t, used + t]: which draft entries (and which of this block) each sees; every
        committed entry is seen. Returns the layer output [B, t, h]."""
        b, t = positions.shape
        hl = cache.lens[rows]
        span = used + t
        window = int(hl.max()) + span
        if window > cache.capacity:
            raise MedusaError(f"feature head cache of {cache.capacity} entries is too small for {window}")
        rel = torch.arange(window, device=x.device)[None, :] - hl[:, None]
        part = torch.gather(visible, 2, rel.clamp(0, span - 1)[:, None, :].expand(b, t, window))
        in_span = (rel >= 0) & (rel < span)
        mask = ((rel < 0)[:, None, :] | (in_span[:, None, :] & part))[:, None]
        bias = None
        if t <= SHORT_BLOCK:
            fp32 = cache.data.dtype == torch.float32 or (x.device.type == "cpu" and b * t <= FP32_ATTENTION_ROWS)
            bias = _short_block_bias(mask, self.n_kv, self.n_heads // self.n_kv,
                                     torch.float32 if fp32 else self.dtype)
        slots = hl[:, None] + used + torch.arange(t, device=x.device)
        rope = _rope_tables(*self.rotary(x, positions))
        kv = cache.data[0, :, rows, :, :window]
        row_idx = torch.arange(b, device=x.device)[:, None]
        return self.layer.forward(emb, x, rope, kv, row_idx, slots, mask, bias)


class _Tap(nn.Module):
    """A target layer that also keeps its last output (the residual stream after it)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inner = layer
        self.out: torch.Tensor | None = None

    def forward(self, x, *args):
        self.out = self.inner.forward(x, *args)
        return self.out


class LayerTaps:
    """Fused features for eagle3 heads: HF `hidden_states[i]` of every pass, i.e. the output of target
    layer i-1 (kept by a transparent wrapper around that layer), or the final normed hidden state for
    i = number of layers. Installed once per target; the wrappers cost one reference per layer call."""

    def __init__(self, target: Transformer, layers: list[int]):
        self.layers = list(layers)
        self.target = target

    @classmethod
    def install(cls, target: Transformer, layers: list[int]) -> "LayerTaps":
        n = len(target.layers)
        for i in layers:
            if not 1 <= i <= n:
                raise MedusaError(f"feature head fuses hidden_states[{i}]; this target has 1..{n} "
                                  f"(0, the embeddings, is not supported)")
            if i < n and not isinstance(target.layers[i - 1], _Tap):
                target.layers[i - 1] = _Tap(target.layers[i - 1])
        return cls(target, layers)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        n = len(self.target.layers)
        parts = [hidden if i == n else self.target.layers[i - 1].out for i in self.layers]
        return torch.cat([p.to(hidden.dtype) for p in parts], dim=-1)


class FeatureState:
    """Per-row state beside a batch: the head's cache, the target features of committed positions and the
    tokens both were computed from (`seq[r, s]` = x_s; the pending root included)."""

    def __init__(self, runner: HeadRunner, rows: int, capacity: int, feature_dim: int, taps: "LayerTaps | None" = None):
        self.runner = runner
        self.taps = taps  # fused multi-layer features: read from taps on the target's layers
        dev = runner.device
        self.cache = runner.new_cache(rows, capacity)
        self.seq = torch.full((rows, capacity), -1, dtype=torch.long, device=dev)
        self.feats = torch.zeros(rows, capacity, feature_dim, dtype=runner.dtype, device=dev)
        self.feat_len = torch.zeros(rows, dtype=torch.long, device=dev)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        self.cache.move_rows(src, dst)
        if src:
            s, d = torch.tensor(src, device=self.seq.device), torch.tensor(dst, device=self.seq.device)
            self.seq[d] = self.seq[s]
            self.feats[d] = self.feats[s]
            self.feat_len[d] = self.feat_len[s]

    def prefilled(self, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> None:
        """The engine's prefill of new rows: keep their prompt features (so no second pass is needed)."""
        t = tokens.shape[1]
        self.seq[rows, :t] = tokens
        self.feats[rows, :t] = self.features(hidden).to(self.feats.dtype)
        self.feat_len[rows] = lengths
        self.cache.lens[rows] = 0

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features of the target pass that just ran (its final hidden states `hidden`)."""
        return hidden if self.taps is None else self.taps.features(hidden)


@dataclass
class TreeShape:
    """A dynamic tree's budget: `nodes` candidates, `depth` draft steps, `topk` children per expansion."""

    nodes: int = 16
    depth: int = 5
    topk: int = 4

    def check(self) -> "TreeShape":
        if self.nodes < 1 or self.depth < 1 or self.topk < 1:
            raise MedusaError(f"dynamic tree needs nodes, depth and topk >= 1, got {self}")
        if self.topk + (self.depth - 1) * self.topk ** 2 < self.nodes:
            raise MedusaError(f"a dynamic tree of depth {self.depth} and top-{self.topk} generates fewer than "
                              f"{self.nodes} nodes")
        if self.nodes < self.depth:
            raise MedusaError(f"{self.nodes} nodes cannot make a tree {self.depth} deep")
        return self


class FeatureProposer:
    """Drafts a dynamic tree per row with a feature head; the engine runs `dynamic_tree.tree_step`."""

    name = "feature"
    owns_step = True

    def __init__(self, head: FeatureHead, target: Transformer, shape: TreeShape | None = None,
                 sample_chain: bool = True, vocab: int | None = None, runner: HeadRunner | None = None):
        self.head = head
        self.target = target
        self.shape = (shape or TreeShape()).check()
        # Several proposers (tree shapes) of one head share its packed inference copy.
        self.runner = runner or HeadRunner(head, target.dtype, vocab).to(target.device)
        if self.shape.topk > self.runner.vocab:
            raise MedusaError(f"top-{self.shape.topk} expansions need more than the head's "
                              f"{self.runner.vocab} draft tokens")
        self.tree = stand_in_tree(self.shape.nodes, self.shape.depth,
                                  f"dynamic-{self.shape.nodes}x{self.shape.depth}")
        # Rows sampled with rejection acceptance draft a chain sampled from the head's distribution and
        # hand it to the verifier (min(1, p/q) accepts more than a point mass when q is close to p).
        self.sample_chain = sample_chain
        self.taps = LayerTaps.install(target, head.config.feature_layers) if head.config.feature_layers else None

    # ---- engine protocol ------------------------------------------------------------------------
    def step(self, engine, batch: "Batch"):
        from medusa.decoding.dynamic_tree import tree_step

        return tree_step(engine, batch, self)

    def attach(self, batch: "Batch") -> "FeatureState":
        """Create the per-row state before rows are added, so prompt features are kept at prefill."""
        state = batch.aux.get(AUX_KEY)
        # Draft entries of any shape up to depth 8 and top-8 fit, so one state serves every planned shape.
        need = batch.cache.capacity + max(66, (self.shape.depth - 1) * self.shape.topk + self.shape.depth + 2)
        if (not isinstance(state, FeatureState) or state.runner is not self.runner
                or state.cache.rows < batch.cache.rows or state.cache.capacity < need):
            with torch.inference_mode(False):
                state = FeatureState(self.runner, batch.cache.rows, need, self.head.config.feature_dim, self.taps)
            batch.aux[AUX_KEY] = state
        return state

    @torch.inference_mode()
    def draft(self, batch: "Batch") -> RowTrees:
        n = batch.n
        rows = slice(0, n)
        state = self.attach(batch)
        lens = batch.cache.lens[rows]
        width = int(lens.max()) + 1
        ctx = batch.seq[rows, :width].clone()
        ctx.scatter_(1, lens[:, None], batch.root[rows, None])
        same = _common_prefix(state.seq[rows, :width], ctx, lens + 1)
        state.seq[rows, :width] = ctx
        state.feat_len[rows] = torch.minimum(torch.minimum(state.feat_len[rows], same), lens)
        # Entry s reads x_{s+1}; at least the last committed entry is recomputed, so its output is at hand.
        state.cache.lens[rows] = torch.minimum(torch.minimum(state.cache.lens[rows], same - 1), lens - 1).clamp(min=0)
        if bool((state.feat_len[rows] < lens).any()):
            self._fill_features(batch, state, ctx, lens)
        last = self._catch_up(state, rows, ctx, lens)
        sampled = batch.sampling.mode[rows] == MODE_REJECTION if self.sample_chain else None
        if sampled is not None and not bool(sampled.any()):
            sampled = None
        return self._grow(batch, state, rows, lens, last, sampled)

    def observe(self, batch: "Batch", hidden: torch.Tensor, tokens: torch.Tensor, verdict: Verdict) -> None:
        """Keep the true features of the positions this step commits (the accepted path, root first)."""
        state: FeatureState = batch.aux[AUX_KEY]
        n = hidden.shape[0]
        rows = torch.arange(n, device=hidden.device)[:, None]
        lens = batch.cache.lens[:n]
        j = torch.arange(verdict.path.shape[1], device=hidden.device)
        keep = j[None, :] <= verdict.accepted[:, None]
        pos = (lens[:, None] + j).clamp(max=state.feats.shape[1] - 1)
        feats = state.features(hidden)[rows, verdict.path].to(state.feats.dtype)
        state.feats[rows, pos] = torch.where(keep[:, :, None], feats, state.feats[rows, pos])
        state.seq[rows, pos] = torch.where(keep, tokens.gather(1, verdict.path), state.seq[rows, pos])
        state.feat_len[:n] = torch.where(state.feat_len[:n] >= lens, lens + verdict.accepted + 1, state.feat_len[:n])

    # ---- pieces ---------------------------------------------------------------------------------
    def _fill_features(self, batch: "Batch", state: FeatureState, ctx: torch.Tensor, lens: torch.Tensor) -> None:
        """Target features of committed positions the state never saw (rows that decoded without this
        proposer, or joined before it was attached): re-run the target over them. It rewrites the same
        K/V entries from the same tokens; entries past each row's length are scratch."""
        n = lens.shape[0]
        rows = slice(0, n)
        cache = batch.cache
        saved = cache.lens[rows].clone()
        dev = lens.device
        try:
            while True:
                start = state.feat_len[rows]
                todo = lens - start
                most = int(todo.max())
                if most <= 0:
                    return
                cache.lens[rows] = start
                t = min(most, cache.capacity - int(start.max()))
                j = torch.arange(t, device=dev)
                idx = (start[:, None] + j).clamp(max=ctx.shape[1] - 1)
                causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
                hidden = self.target(ctx.gather(1, idx), start[:, None] + j, cache, rows, causal)
                count = todo.clamp(min=0, max=t)
                take = j[None, :] < count[:, None]
                r = torch.arange(n, device=dev)[:, None]
                pos = idx.clamp(max=state.feats.shape[1] - 1)
                feats = state.features(hidden).to(state.feats.dtype)
                state.feats[r, pos] = torch.where(take[:, :, None], feats, state.feats[r, pos])
                state.feat_len[rows] = start + count
        finally:
            cache.lens[rows] = saved

    def _catch_up(self, state: FeatureState, rows: slice, ctx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Head entries for committed positions [cache.lens, lens): input (f_s, x_{s+1}); returns the output
        of entry lens-1 (the predicted feature of the root's position) [n, h]."""
        cache = state.cache
        n = lens.shape[0]
        dev = lens.device
        last = torch.zeros(n, self.head.config.hidden_size, dtype=self.runner.dtype, device=dev)
        ar = torch.arange(n, device=dev)
        while True:
            hl = cache.lens[rows]
            todo = lens - hl
            most = int(todo.max())
            if most <= 0:
                return last
            t = min(most, cache.capacity - int(hl.max()))
            j = torch.arange(t, device=dev)
            pos = hl[:, None] + j
            nxt = ctx.gather(1, (pos + 1).clamp(max=ctx.shape[1] - 1))
            feats = state.feats[ar[:, None], pos.clamp(max=state.feats.shape[1] - 1)]
            emb, x = self.runner.inputs(nxt, feats, fused=True)
            causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(n, t, t)
            out = self.runner(emb, x, pos, cache, rows, 0, causal)
            count = todo.clamp(min=0, max=t)
            done = (count > 0) & (count == todo)
            last = torch.where(done[:, None], out[ar, (count - 1).clamp(min=0)], last)
            cache.lens[rows] = hl + count

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.runner.logits(out).float(), dim=-1)

    def _full_probs(self, batch: "Batch", rows: slice, logits: torch.Tensor) -> torch.Tensor:
        """The row's sampling distribution over the full vocabulary from draft-vocabulary logits [n, Vd]."""
        full = torch.full((logits.shape[0], 1, self.head.config.vocab_size), NEG, device=logits.device)
        full[:, 0, self.runner.draft_ids] = logits.float()
        return batch.sampling.probs(full, rows)[:, 0]

    def _grow(self, batch: "Batch", state: FeatureState, rows: slice, lens: torch.Tensor, last: torch.Tensor,
              sampled: torch.Tensor | None) -> RowTrees:
        """EAGLE-2 expansion: D draft steps over the top-k frontier, then the N best nodes."""
        k, depth, nodes = self.shape.topk, self.shape.depth, self.shape.nodes
        n = lens.shape[0]
        dev = lens.device
        ids = self.runner.draft_ids
        pool = Pool([], [], [], [])
        logits = self.runner.logits(last)
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.topk(k, -1)
        tok, score = ids[top.indices], top.values
        chain_q, chain_pool = [], []
        if sampled is not None:
            q = self._full_probs(batch, rows, logits)
            pick = sample_from(q, batch.sampling.uniform(rows, 1)[:, 0])
            tok, score = _chain_first(tok, score, pick, sampled)
            chain_q.append(q)
            chain_pool.append(torch.zeros(n, dtype=torch.long, device=dev))
        start = pool.add(tok, score, torch.full_like(tok, -1), 1)
        front_tok, front_score = tok, score
        front_pool = start + torch.arange(k, device=dev).expand(n, k)
        front_in = last[:, None, :].expand(n, k, last.shape[-1])
        vis = torch.zeros(n, k, 0, dtype=torch.bool, device=dev)  # each frontier node's ancestors' entries
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(n, k, k)
        used = 0
        for d in range(2, depth + 1):
            emb, x = self.runner.inputs(front_tok, front_in, fused=False)
            block_vis = torch.cat([vis, eye], dim=2)
            pos = (lens + d - 2)[:, None].expand(n, k)
            out = self.runner(emb, x, pos, state.cache, rows, used, block_vis)
            logits = self.runner.logits(out)  # [n, k, Vd]
            logp = torch.log_softmax(logits.float(), -1)
            ct, cs, slot = expand(logp, front_score, k)
            ct = ids[ct]
            parent_pool = front_pool.gather(1, slot)
            if sampled is not None:
                q = self._full_probs(batch, rows, logits[:, 0])  # the chain node is frontier slot 0
                pick = sample_from(q, batch.sampling.uniform(rows, 1)[:, 0])
                ct, cs = _chain_first(ct, cs, pick, sampled)
            start = pool.add(ct, cs, parent_pool, d)
            if sampled is not None:
                chain_q.append(q)
                chain_pool.append(torch.full((n,), start, dtype=torch.long, device=dev))
            best = cs.topk(k, -1).indices  # sorted: a sampled row's chain node stays in slot 0
            bslot = slot.gather(1, best)
            front_tok, front_score = ct.gather(1, best), cs.gather(1, best)
            front_pool = start + best
            front_in = out.gather(1, bslot[:, :, None].expand(n, k, out.shape[-1]))
            vis = block_vis.gather(1, bslot[:, :, None].expand(n, k, block_vis.shape[2]))
            used += k
        proposal = None
        trees = pool.trees(nodes, depth)
        if sampled is not None:
            proposal = self._proposal(trees, pool, nodes, chain_q, chain_pool, sampled)
            trees.proposal = proposal
        return trees

    def _proposal(self, trees: RowTrees, pool: Pool, nodes: int, chain_q: list, chain_pool: list,
                  sampled: torch.Tensor) -> torch.Tensor:
        """q per node: the sampled chain's distributions on sampled rows, point masses elsewhere."""
        from medusa.decoding.dynamic_tree import select_nodes

        score = torch.cat(pool.scores, 1)
        par = torch.cat(pool.parents, 1)
        dep = torch.cat([torch.full_like(t, d) for t, d in zip(pool.tokens, pool.depths)], 1)
        chosen, _ = select_nodes(score, par, dep, nodes)
        q = F.one_hot(trees.tokens, self.head.config.vocab_size).float()
        cp = torch.stack(chain_pool, 1)  # [n, D]
        match = (chosen[:, :, None] == cp[:, None, :]) & sampled[:, None, None]  # [n, N, D]
        cq = torch.stack(chain_q, 1)  # [n, D, V]
        on_chain = match.any(-1)
        mixed = torch.einsum("bnd,bdv->bnv", match.float(), cq)
        return torch.where(on_chain[:, :, None], mixed, q)


def _chain_first(tok: torch.Tensor, score: torch.Tensor, pick: torch.Tensor, sampled: torch.Tensor):
    """On sampled rows, entry 0 becomes the sampled token (score 0: always kept) and the rest are dropped
    (-inf) when it descends from the chain; other rows are unchanged. Chain nodes have score 0 on every
    depth, so they are the frontier's slot 0 and a sampled row's tree is exactly the chain."""
    tok, score = tok.clone(), score.clone()
    on = sampled & (score[:, 0] > NEG)
    tok[:, 0] = torch.where(on, pick, tok[:, 0])
    score[:, 0] = torch.where(on, 0.0, score[:, 0])
    score[:, 1:] = torch.where(sampled[:, None], NEG, score[:, 1:])
    return tok, score


def _common_prefix(a: torch.Tensor, b: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(b.shape[1], device=b.device)
    differs = (a != b) | (pos[None, :] >= limit[:, None])
    return torch.where(differs.any(1), differs.long().argmax(1), limit)


def load_feature_head(spec: str | Path, target: nn.Module) -> FeatureHead:
    """A feature head for `target` from a directory (ours or an EAGLE layout) or `default` (shipped)."""
    d = SHIPPED_FEATURE_DIR if str(spec) == "default" else Path(spec)
    if not d.is_dir():
        raise MedusaError(f"--heads: {d} is not a directory")
    return FeatureHead.load(d, target)


# ---- sizing the tree from this machine's pass costs ------------------------------------------------


def draft_pass_ms(runner: HeadRunner, rows: int, tokens: int, prefix: int = 256, repeats: int = 5) -> float:
    """Fastest ms of one head pass over `tokens` entries per row for `rows` rows after a `prefix`-entry
    cache, with its draft-vocabulary log-softmax and top-k: one draft step's cost."""
    import time

    dev = runner.device
    cache = runner.new_cache(rows, prefix + tokens + 1)
    cache.lens[:rows] = prefix
    h = runner.config.hidden_size
    emb = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    x = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    pos = torch.full((rows, tokens), prefix, device=dev)
    vis = torch.ones(rows, tokens, tokens, dtype=torch.bool, device=dev)
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = runner(emb, x, pos, cache, slice(0, rows), 0, vis)
            torch.log_softmax(runner.logits(out).float(), -1).topk(min(4, runner.vocab), -1)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def shape_candidates(max_nodes: int = 64, max_depth: int = 8, topk: int = 4) -> list[TreeShape]:
    sizes = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
    out = []
    for depth in range(1, max_depth + 1):
        for n in sizes:
            if n <= max_nodes and n >= depth and topk + (depth - 1) * topk * topk >= n:
                out.append(TreeShape(n, depth, min(topk, n)))
    return out


def expected_tau_dynamic(shape: TreeShape, accuracy: list[list[float]]) -> float:
    """Expected tokens per step of a `shape` tree from per-draft-step rank accuracies (eval.json), taken
    as the best static tree of that budget: a dynamic tree, chosen per row, does at least as well."""
    from medusa.decoding.tree import build_tree, expected_tau

    acc = [row[: shape.topk] for row in accuracy[: shape.depth]]
    if not acc:
        return 1.0
    return expected_tau(build_tree(acc, shape.nodes).nodes, acc)


def plan_shape(cal, accuracy: list[list[float]], batch: int, draft_ms, shapes: list[TreeShape] | None = None):
    """The dynamic tree with the best predicted speedup at `batch` rows, or None (plain decoding):
    speedup = tau(shape) / (ratio(B, N + 1) + (catch-up + (D - 1) expansions) / one-token pass ms).

    `draft_ms(rows, tokens)` is one head pass's cost; `cal` the calibrated target pass-cost curve."""
    from medusa.runtime.auto import MARGIN, Plan

    one = cal.ms(batch, 1)
    best = None
    for shape in shapes or shape_candidates():
        tau = expected_tau_dynamic(shape, accuracy)
        drafting = draft_ms(batch, 2) + (shape.depth - 1) * draft_ms(batch, shape.topk)
        cost = cal.ratio(batch, shape.nodes + 1) + drafting / one
        speedup = tau / cost
        if best is None or speedup > best[0]:
            best = (speedup, shape, tau, cost)
    speedup, shape, tau, cost = best
    tree = stand_in_tree(shape.nodes, shape.depth, f"dynamic-{shape.nodes}x{shape.depth}")
    reason = f"tau {tau:.2f} expected, drafting and a {shape.nodes + 1}-token pass cost {cost:.2f} plain steps"
    if speedup < MARGIN:
        return Plan(batch, None, 1.0, 1.0, f"best dynamic tree {tree.name} predicts {speedup:.2f}x (< {MARGIN}x): "
                                           f"{reason}"), None
    return Plan(batch, tree, speedup, tau, reason), shape


def parse_shape(name: str) -> TreeShape:
    """`dynamic-N` (depth and top-k chosen for N) or `dynamic-NxD` or `dynamic-NxDxK`."""
    try:
        parts = [int(p) for p in name.removeprefix("dynamic-").split("x")]
    except ValueError:
        raise MedusaError(f"--tree: {name!r}: expected dynamic-N, dynamic-NxD or dynamic-NxDxK") from None
    if len(parts) == 1:
        n = parts[0]
        depth = max(1, min(6, n // 2 if n > 2 else n))
        return TreeShape(n, depth, 4 if n >= 4 else n).check()
    if len(parts) == 2:
        return TreeShape(parts[0], parts[1], 4 if parts[0] >= 4 else max(1, parts[0])).check()
    if len(parts) == 3:
        return TreeShape(*parts).check()
    raise MedusaError(f"--tree: {name!r}: expected dynamic-N, dynamic-NxD or dynamic-NxDxK")
