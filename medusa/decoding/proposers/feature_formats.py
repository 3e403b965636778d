"""Feature heads in the EAGLE checkpoint layouts that SafeAILab/EAGLE, vLLM and SGLang read.

EAGLE-1 (`style: eagle1`): `config.json` is the target's config cut to one layer (a Llama config);
`model.safetensors` holds
    fc.weight [h, 2h], fc.bias [h]                      (input: [embedding, feature])
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight             (layer 0 has no input_layernorm)
and the reader uses the target's own embeddings and full lm_head (a draft vocabulary is ours only).

EAGLE-3 (`style: eagle3`): `config.json` adds `draft_vocab_size`; the weights are
    fc.weight [h, k*h] (no bias; k fused target layers), midlayer.self_attn.{q,k,v}_proj.weight [*, 2h],
    midlayer.self_attn.o_proj.weight, midlayer.mlp.*, midlayer.{input_layernorm,hidden_norm,
    post_attention_layernorm}.weight, norm.weight, lm_head.weight [draft_vocab, h],
    d2t [draft_vocab] long (full id = draft index + d2t[index]), t2d [vocab] bool (id is in the draft vocab).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.errors import MedusaError

WEIGHTS = "model.safetensors"
# Our layer's parameter names -> the layouts' (the prefix differs, the rest is the HF Llama layer's).
EAGLE1_PREFIX, EAGLE3_PREFIX = "layers.0.", "midlayer."


def _layer_state(head, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in head.layer.state_dict().items():
        if head.config.style == "eagle1" and k.startswith("input_layernorm."):
            continue
        out[prefix + k] = v
    return out


def rope_fields(cfg: dict) -> dict:
    """`rope_theta` and `rope_scaling` as transformers 4.x configs (and the readers written for them) spell
    them; transformers 5 keeps both under `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.pop("rope_theta", None))
    params.pop("rope_theta", None)
    if theta is None:
        raise MedusaError("the target's config has no rope_theta (nor rope_parameters.rope_theta)")
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = cfg.get("rope_scaling")
    if scaling is None and kind != "default":
        scaling = {**params, "type": kind, "rope_type": kind}
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def eagle_config(head, draft_vocab: bool) -> dict:
    """The one-layer Llama config.json of the layouts, with the keys SafeAILab/EAGLE's reader takes from it:
    the layer sizes, `rope_theta` / `rope_scaling` (the target's rotary base), `bias` (fc has one in
    EAGLE-1) and, for EAGLE-3, `draft_vocab_size`."""
    cfg = head.layer_config.to_dict()
    for key in ("quantization_config", "transformers_version", "_name_or_path", "layer_types", "dtype"):
        cfg.pop(key, None)
    cfg.update(rope_fields(cfg))
    cfg.update(num_hidden_layers=1, model_type="llama", torch_dtype="float32")
    if draft_vocab:
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["draft_vocab_size"] = head.config.draft_vocab
        cfg["eagle_feature_layers"] = list(head.config.feature_layers)
        cfg["bias"] = False
    else:
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["bias"] = True
    return cfg


def eagle1_state(head) -> dict[str, torch.Tensor]:
    if head.config.style != "eagle1":
        raise MedusaError(f"--format eagle: needs an eagle1-style head, this one is {head.config.style}")
    return {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias, **_layer_state(head, EAGLE1_PREFIX)}


def eagle3_state(head) -> dict[str, torch.Tensor]:
    if head.config.style != "eagle3":
        raise MedusaError(f"--format eagle3: needs an eagle3-style head, this one is {head.config.style}")
    ids = head.draft_ids.cpu()
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"fc.weight": head.fc.weight, **_layer_state(head, EAGLE3_PREFIX),
            "midlayer.hidden_norm.weight": head.hidden_norm.weight, "norm.weight": head.norm.weight,
            "lm_head.weight": head.lm_head.weight, "d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def save_eagle(head, directory: str | Path, layout: str) -> Path:
    """Write `head` as an EAGLE-1 (`eagle`) or EAGLE-3 (`eagle3`) checkpoint directory."""
    from medusa.io import write_atomic, write_json_atomic

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = eagle1_state(head) if layout == "eagle" else eagle3_state(head)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    cfg = eagle_config(head, draft_vocab=layout == "eagle3")
    write_atomic(directory / WEIGHTS, lambda p: save_file(tensors, str(p)))
    write_json_atomic(directory / "config.json", cfg)
    return directory


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    if (d / WEIGHTS).exists():
        return load_file(str(d / WEIGHTS))
    if (d / "pytorch_model.bin").exists():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise MedusaError(f"--heads: {d} has a config.json but no model.safetensors / pytorch_model.bin")


def load_eagle(directory: str | Path, target: nn.Module):
    """A FeatureHead from an EAGLE-1 or EAGLE-3 checkpoint directory (detected from the weight names)."""
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig

    d = Path(directory)
    meta = json.loads((d / "config.json").read_text())
    state = _read_weights(d)
    h = target.config.hidden_size
    vocab = target.get_output_embeddings().weight.shape[0]
    if EAGLE3_PREFIX + "self_attn.q_proj.weight" in state:
        ids = torch.arange(len(state["d2t"])) + state["d2t"].long()
        n = len(target.model.layers)
        layers = meta.get("eagle_feature_layers") or [2, n // 2, n - 3]
        if state["fc.weight"].shape[1] != h * len(layers):
            raise MedusaError(f"--heads: {d}: fc takes {state['fc.weight'].shape[1]} inputs, expected "
                              f"{len(layers)} x {h}")
        config = FeatureHeadConfig(h, vocab, len(ids), style="eagle3", feature_layers=list(layers),
                                   own_lm_head=True, base_model=str(meta.get("_name_or_path", "")))
        head = FeatureHead(config, target, ids)
        own = {k[len(EAGLE3_PREFIX):]: v for k, v in state.items()
               if k.startswith(EAGLE3_PREFIX) and not k.startswith(EAGLE3_PREFIX + "hidden_norm.")}
        _load_into(head.layer, own, d)
        with torch.no_grad():
            head.hidden_norm.weight.copy_(state["midlayer.hidden_norm.weight"])
            head.norm.weight.copy_(state["norm.weight"])
            head.lm_head.weight.copy_(state["lm_head.weight"])
            head.fc.weight.copy_(state["fc.weight"])
        return head
    if "fc.weight" in state and any(k.startswith(EAGLE1_PREFIX) for k in state):
        if state["fc.weight"].shape != (h, 2 * h):
            raise MedusaError(f"--heads: {d}: fc.weight is {tuple(state['fc.weight'].shape)}, the model needs "
                              f"({h}, {2 * h})")
        config = FeatureHeadConfig(h, vocab, vocab, style="eagle1", base_model=str(meta.get("_name_or_path", "")))
        head = FeatureHead(config, target)
        own = {k[len(EAGLE1_PREFIX):]: v for k, v in state.items() if k.startswith(EAGLE1_PREFIX)}
        own["input_layernorm.weight"] = head.layer.input_layernorm.weight.detach().clone()
        _load_into(head.layer, own, d)
        with torch.no_grad():
            head.fc.weight.copy_(state["fc.weight"])
            if "fc.bias" in state:
                head.fc.bias.copy_(state["fc.bias"])
            else:
                head.fc.bias.zero_()
        return head
    raise MedusaError(f"--heads: {d} holds neither an EAGLE-1 (fc + layers.0) nor an EAGLE-3 (fc + midlayer) head")


def _load_into(layer: nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    expected = layer.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or bad:
        raise MedusaError(f"--heads: {where} does not fit this model (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}, wrong shape {bad[:3]})")
    layer.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
