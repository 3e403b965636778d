"""One place that turns user choices (model, heads, tree, dtype) into a ready engine.

The CLI, the evaluator and the server all build their engine here, so a flag means the same everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from medusa.decoding.target.chat import chat_ids
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.decoding.target.hardware import DtypeChoice, Machine, machine, resolve_dtype
from medusa.decoding.proposers.heads import SHIPPED_DIR, SHIPPED_NAMES, MedusaHeads
from medusa.decoding.target.model import DEFAULT_MODEL, default_device, load_target
from medusa.decoding.proposers import MedusaProposer, Proposer
from medusa.decoding.target.transformer import Transformer
from medusa.decoding.trees.tree import Tree, load_tree
from medusa.runtime.proposers import ProposerSpec, build_proposer

if TYPE_CHECKING:
    from medusa.runtime.auto import AutoSpeculation
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.proposers.retrieval import Retriever
    from medusa.decoding.proposers.suffix import Datastore


@dataclass
class Runtime:
    hf_model: torch.nn.Module
    tokenizer: object
    model: Transformer
    engine: Engine
    heads: MedusaHeads | None
    dtype: DtypeChoice | None = None  # None: the dtype the model was built in
    feature: "FeatureHead | None" = None  # feature heads (EAGLE-style) when --heads names them
    # Auto mode drafts from the text itself too: retrieval merged into the feature heads' trees, or alone
    # when there are no heads (`--retrieval off`: heads alone, or plain decoding without heads).
    retrieval: bool = True
    datastore: "Datastore | None" = None  # a corpus retrieval also drafts from (`--datastore DIR`)

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = resolve_dtype(self.model.dtype)

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, heads: str | None = "default", dtype: str = "auto",
             device: str | None = None, retrieval: bool = True, datastore: str | None = None,
             batch_invariant: bool = False) -> "Runtime":
        """The model, its heads (`--heads`), dtype and device; `retrieval`: auto mode also drafts from the
        text itself; `datastore`: a corpus retrieval drafts from too (`medusa datastore build`);
        `batch_invariant`: a row's tokens never depend on the pass it is in (`medusa.decoding.target.invariant`)."""
        device = torch.device(device or default_device())
        choice = resolve_dtype(dtype, device, announce=True)
        hf_model, tokenizer = load_target(model, choice.torch, device)
        transformer = Transformer(hf_model)
        if batch_invariant:
            from medusa.decoding.target.invariant import probe

            why = probe(str(device), choice.torch)
            if why is not None:
                raise MedusaError(f"--batch-invariant on: {why}; run without it (the default)")
            transformer.invariant = True
        from medusa.runtime.feature import resolve_feature

        feature = resolve_feature(heads, hf_model)
        # `default` with preferred feature heads keeps the shipped Medusa heads beside them: a static tree
        # (`--tree tree-8`) still names those, and benchmarks time both kinds.
        medusa = load_heads(heads, hf_model) if feature is None or heads == "default" else None
        rt = cls(hf_model, tokenizer, transformer, Engine(transformer, eos_ids(hf_model, tokenizer)),
                 medusa, choice, feature, retrieval)
        rt.use_datastore(datastore)
        return rt

    @property
    def machine(self) -> Machine:
        return machine(self.model.device)

    def auto(self, batch_size: int, progress: bool = True) -> "AutoSpeculation | None":
        """Auto mode for up to `batch_size` rows (None without heads: plain decoding). Calibrates the pass
        cost on first use of this model/dtype/machine; later starts read the cached curve."""
        from medusa.runtime.auto import AutoSpeculation, Plan, candidate_trees, plan, read_accuracy
        from medusa.runtime.calibrate import load_or_measure
        from medusa.runtime.gate import bucket

        if self.feature is not None:
            from medusa.runtime.feature import feature_auto

            return feature_auto(self, batch_size, progress)
        if self.heads is None:
            if not self.retrieval:
                return None
            from medusa.runtime.retrieval import retrieval_auto

            return retrieval_auto(self, batch_size, progress)
        cal = load_or_measure(self, [1 << i for i in range(bucket(batch_size).bit_length())], progress=progress)
        accuracy = read_accuracy(self.heads)
        default = self.heads.tree()
        if accuracy is None:  # nothing to predict from: the default tree, judged by measurement alone
            fixed = Plan(0, default, 0.0, 0.0, "heads without eval.json: default tree, checked by measurement")
            trees = [default]
            plans = lambda rows: fixed  # noqa: E731
        else:
            own = [load_tree(p) for p in sorted(self.heads.trees_dir.glob("*.yaml"))] if self.heads.trees_dir else []
            trees = candidate_trees(accuracy, [default, *own], self.heads.config.num_heads,
                                    self.heads.config.candidates or None)
            plans = functools.lru_cache(maxsize=None)(
                lambda rows, realised=1.0: plan(cal, accuracy, trees, rows, realised))
        return AutoSpeculation(plans, lambda tree: MedusaProposer(self.heads, tree, projection=self.model.lm_head),
                               max(t.size for t in trees), predicted=accuracy is not None, plain_scale=cal.plain_scale)

    def use_datastore(self, directory: str | None) -> None:
        """Draft from the datastore at `directory` too (None: the row's own text only)."""
        from medusa.decoding.proposers.retrieval import load_datastore

        self.datastore = None if directory is None else load_datastore(directory, self.model.config.vocab_size)

    def retriever(self) -> "Retriever":
        """Retrieval as configured: the row's own text, and the datastore when one is loaded."""
        from medusa.decoding.proposers.retrieval import Retriever

        return Retriever(store=self.datastore)

    def proposer(self, mode: "str | ProposerSpec", tree: str | list | Tree | None = None) -> Proposer | None:
        """The proposer a mode names (`--mode`, with `--tree`): see `medusa.runtime.proposers`."""
        return build_proposer(self, mode, tree)

    def encode(self, prompts: list[str], raw: bool = False) -> list[list[int]]:
        """Token ids per prompt: chat messages through the chat template, or raw text."""
        out = []
        for i, text in enumerate(prompts):
            if not text or not text.strip():
                raise MedusaError(f"--prompt {i + 1} is empty")
            out.append(chat_ids(self.tokenizer, text, raw=raw))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def eos_ids(hf_model, tokenizer) -> list[int]:
    ids = getattr(hf_model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def load_heads(spec: str | None, hf_model) -> MedusaHeads | None:
    """`none` -> no heads; `default` or `medusa` -> the shipped Medusa heads (if any for this model); else a
    directory in any layout MedusaHeads.load reads, or a hub id (fetched when online)."""
    if spec in (None, "none"):
        return None
    if spec in SHIPPED_NAMES:
        if not (SHIPPED_DIR / "heads.json").exists():
            return None
        heads = MedusaHeads.load(SHIPPED_DIR)
        if heads.config.hidden_size != hf_model.config.hidden_size:
            return None  # the shipped heads belong to the embedded model, not to a user's --model
        return heads.attach(hf_model)
    return MedusaHeads.load(spec).attach(hf_model)
