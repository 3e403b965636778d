"""FasterDecoding/Medusa's released loader (medusa-llm 0.1 on PyPI) reading a `--format medusa` export.

Runs in the `medusa` side environment. Request: heads (the export's directory), hidden [T, H] (the target's
last hidden states, computed by the test), prompts (token id lists), new_tokens, choices (medusa_choices).
Answer: keys (how medusa_lm_head.pt fits the heads it builds), head_logits [num_heads, T, V], base_hidden
(its base model's last hidden states for prompts[0]) and, per prompt, the tokens its medusa_generate wrote.

Only their public entry points are called: MedusaModel.from_pretrained (which reads config.json, builds the
base model from base_model_name_or_path and loads medusa_lm_head.pt), its medusa_head modules, its base
model, its tokenizer and medusa_generate. Their loader loads non-strictly and returns nothing about it, so
the key check compares the file it read with the modules it built."""

import os

import torch

from common import key_report, run


def main(req: dict) -> dict:
    from medusa.model.medusa_model import MedusaModel

    heads_dir = req["heads"]
    model = MedusaModel.from_pretrained(heads_dir, torch_dtype=torch.float32)
    model.eval()
    given = torch.load(os.path.join(heads_dir, "medusa_lm_head.pt"), map_location="cpu")
    expected = model.medusa_head.state_dict()
    keys = key_report(expected, given)
    keys["loaded_equal"] = sorted(k for k in set(expected) & set(given) if torch.equal(expected[k], given[k]))

    with torch.inference_mode():
        hidden = req["hidden"].to(torch.float32)
        head_logits = torch.stack([head(hidden) for head in model.medusa_head])
        ids = torch.tensor([req["prompts"][0]])
        base_hidden = model.base_model.model(input_ids=ids)[0][0]

    tok = model.get_tokenizer()
    generated, steps = [], []
    for prompt in req["prompts"]:
        n_steps, text = 0, ""
        for n_steps, out in enumerate(model.medusa_generate(torch.tensor([prompt]), temperature=0.0,
                                                            max_steps=req["new_tokens"],
                                                            medusa_choices=req["choices"]), 1):
            text = out["text"]
            if len(tok(text, add_special_tokens=False).input_ids) >= req["new_tokens"]:
                break
        # medusa_generate yields decoded text; the word-level test tokenizer maps it back to ids exactly
        generated.append(tok(text, add_special_tokens=False).input_ids)
        steps.append(n_steps)
    return {"keys": keys, "head_logits": head_logits, "base_hidden": base_hidden, "generated": generated,
            "steps": steps, "num_heads": len(model.medusa_head)}


if __name__ == "__main__":
    run(main)
