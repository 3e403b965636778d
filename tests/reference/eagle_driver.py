"""SafeAILab/EAGLE's released EAGLE-1 code (eagle-llm 1.2.1 on PyPI) reading a `--format eagle` export.

Runs in the `eagle` side environment. Request: head (the export's directory), base (the target folder
`medusa export --base-model` wrote), features [T, H] (the target's last hidden states at positions 0..T-1,
computed by the test) with tokens [T] (the token at position s+1 for each s: what EAGLE-1 pairs them with),
prompts, new_tokens. Answer: keys (how model.safetensors fits the draft layer it builds), draft_logits [T, V],
base_hidden (its base model's last hidden states for prompts[0]) and, per prompt, what eagenerate wrote.

Calls: their Llama KV model's from_pretrained for the base, the EaModel constructor (it reads config.json,
including `bias`, builds the draft layer `cnets.Model`, and moves it to the base model's dtype and device),
load_state_dict on that layer, its forward, and EaModel.eagenerate. EaModel.from_pretrained itself is not
called: in this release it reads only pytorch_model.bin (else it asks the hub), and loads strictly a state
that includes `embed_tokens.weight`, a copy of the target's input embeddings; the export stores neither. The
draft layer's embeddings are the target's by design (their training code fills them from the base model's
`model.embed_tokens.weight`, and later EAGLE releases load them from the base model), so this driver fills
that one key from the base model and requires every other key to load strictly."""

import os

import torch

from common import key_report, run

FILLED = {"embed_tokens.weight"}  # filled from the target by design


def main(req: dict) -> dict:
    from safetensors.torch import load_file

    from eagle.model.ea_model import EaModel
    from eagle.model.modeling_llama_kv import LlamaForCausalLM as KVLlamaForCausalLM

    base_dir, head_dir = req["base"], req["head"]
    base = KVLlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    base.eval()
    model = EaModel(base, base_dir, os.path.join(head_dir, "config.json"))
    state = load_file(os.path.join(head_dir, "model.safetensors"))
    keys = key_report(model.ea_layer.state_dict(), state, FILLED)
    result = model.ea_layer.load_state_dict(state, strict=False)
    keys["load_missing"] = sorted(result.missing_keys)
    keys["load_unexpected"] = sorted(result.unexpected_keys)
    with torch.no_grad():
        model.ea_layer.embed_tokens.weight.copy_(base.model.embed_tokens.weight)
    model.eval()

    with torch.inference_mode():
        feats = req["features"].to(torch.float32)[None]
        tokens = torch.as_tensor(req["tokens"])[None]
        out = model.ea_layer(feats, input_ids=tokens)
        draft_logits = base.lm_head(out)[0]
        base_hidden = base.model(input_ids=torch.tensor([req["prompts"][0]]))[0][0]

    # The target passes each call makes (a forward hook counts them: one for the prompt, one per step).
    passes = [0]
    hook = base.model.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    generated, steps = [], []
    for prompt in req["prompts"]:
        passes[0] = 0
        ids = model.eagenerate(torch.tensor([prompt]), temperature=0.0, max_new_tokens=req["new_tokens"])
        generated.append(ids[0, len(prompt):].tolist())
        steps.append(passes[0] - 1)
    hook.remove()
    return {"keys": keys, "draft_logits": draft_logits, "base_hidden": base_hidden, "generated": generated,
            "steps": steps, "bias": model.ea_layer.fc.bias is not None}


if __name__ == "__main__":
    run(main)
