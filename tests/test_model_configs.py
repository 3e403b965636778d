"""The shipped configs for the models people serve, end to end on a tiny random model of each
architecture (llama3 rope scaling, q/k/v biases, q/k norms, their GQA ratios): the answers distilled from
`medusa serve`, the feature head trained in 2 processes with features online, exported in EAGLE's layout,
and decoding with it is token-identical to plain decoding (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from medusa.cli import main

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "llama-3.1-8b-instruct": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2.5-7b-instruct": ("qwen2", dict(num_attention_heads=7, num_key_value_heads=1, hidden_size=112)),
    "qwen3-8b": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "mistral-7b-instruct-v0.3": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1)),
}


def byte_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer (Qwen2's class, as those architectures' own loaders expect) over printable
    ASCII with no merges, plus an end-of-turn token and a chat template: any token sequence decodes to text
    that tokenises back to the same ids, as a real model's answers do. Returns its size."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    directory.mkdir(parents=True, exist_ok=True)
    chars = bytes_to_unicode()
    vocab = {chars[b]: i for i, b in enumerate(range(32, 127))}
    end = len(vocab)
    vocab["<|end|>"] = end
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    special = {"content": "<|end|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False,
               "single_word": False}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|end|>", "pad_token": "<|end|>",
        "added_tokens_decoder": {str(end): special},
        "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>"
                         "{% endif %}"}))
    AutoTokenizer.from_pretrained(directory).save_pretrained(directory)  # adds tokenizer.json
    return len(vocab)


def tiny_of(arch: str, extra: dict, directory: Path) -> Path:
    """A random model of `arch` with `byte_tokenizer`, saved as a user's checkpoint."""
    import transformers

    vocab = byte_tokenizer(directory)
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[arch]
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False, eos_token_id=vocab - 1)
    config = getattr(transformers, f"{names}Config")(**{**kw, **extra})
    torch.manual_seed(0)
    getattr(transformers, f"{names}ForCausalLM")(config).eval().save_pretrained(directory)
    return directory


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    from test_serve import free_port  # noqa: F401 (the same helpers the server tests use)

    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_end_to_end_on_a_tiny_model_of_its_architecture(name, tmp_path, capsys):
    from medusa.runtime import Runtime
    from medusa.train.feature import load_feature_config
    from test_serve import free_port, serve

    arch, extra = CONFIGS[name]
    model = tiny_of(arch, extra, tmp_path / "model")
    shipped = load_feature_config(REPO / "configs" / "feature" / f"{name}.yaml")
    assert shipped.features == "online" and shipped.head.style == "eagle1"
    g = torch.Generator().manual_seed(1)
    words = ["tree", "blue", "seven", "river", "code", "quiet", "lamp", "stone"]
    prompts = [" ".join(words[int(t)] for t in torch.randint(0, len(words), (2 + i % 5,), generator=g))
               for i in range(16)]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cfg = yaml.safe_load((REPO / "configs" / "feature" / f"{name}.yaml").read_text())
    cfg.update(model=str(model), dtype="fp32", precision="fp32", run_dir=str(tmp_path / "run"), threads=1,
               batch_size=4, chunk=8, max_steps=4, checkpoint_every=2, log_every=1, eval_every=2,
               eval_examples=2, measure_tau_prompts=2, measure_tau_tokens=8, wandb={"mode": "disabled"},
               other_prompts=str(tmp_path / "prompts.txt"), other_prompts_count=2, other_answer_tokens=4)
    cfg["data"].update(sources=[str(tmp_path / "prompts.txt")], distill_dir=str(tmp_path / "distilled"),
                       max_new_tokens=12, shard_size=8, eval_fraction=0.2, max_prompt_tokens=64, max_seq_tokens=64)
    cfg["head"]["draft_vocab"] = 48
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))

    # 1. Distil from `medusa serve` serving the tiny model.
    served = Runtime.load(str(model), heads="none", dtype="fp32", device="cpu")
    with serve(served, policy={"mode": "plain"}) as url:
        assert main(["distill", "--config", str(config), "--server", url, "--no-progress"]) == 0, \
            capsys.readouterr().err
    rows = sum(json.loads(p.read_text())["rows"] for p in (tmp_path / "distilled").glob("shard-*/count.json"))
    assert rows == 16
    # 2. Train in two processes, features online.
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                 "-m", "medusa.cli", "train-feature", "--config", str(config), "--no-progress"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "world size 2" in out and "expected tau" in out and not (tmp_path / "run" / "features").exists()
    assert "prompts.txt prompts" in out  # the second prediction, on prompts beside the training data
    # 3. Export in EAGLE's layout; decode with it: the tokens of plain decoding.
    exported = tmp_path / "eagle"
    assert main(["export", "--heads", str(tmp_path / "run" / "head"), "--format", "eagle", "--out", str(exported)]) == 0
    capsys.readouterr()
    texts = []
    for mode in (["--mode", "plain"], ["--mode", "feature", "--heads", str(exported), "--tree", "dynamic-8x3"]):
        args = ["generate", "--model", str(model), "--dtype", "fp32", "--device", "cpu", "--raw", "--json",
                "--max-new-tokens", "16", *[a for p in prompts[:3] for a in ("--prompt", p)], *mode]
        assert main(args) == 0, capsys.readouterr().err
        texts.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    plain, feature = texts
    assert [o["token_ids"] for o in feature["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
    assert feature["stats"]["mode"].startswith("feature") and feature["stats"]["forward_passes"] > 0
