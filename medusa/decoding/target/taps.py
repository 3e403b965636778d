"""Taps on the target's layers for fused-feature (eagle3) heads: a layer wrapped so that it keeps its last output,
and `LayerTaps`, which reads the fused features of a pass from them. A target with taps runs no pass of several
parts (`medusa.decoding.target.transformer.Transformer.fuses_parts`): the taps hold one pass's outputs."""

from __future__ import annotations

import torch
from torch import nn

from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError


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
