import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = 97):
    """A small random decoder whose logits are peaked enough that fp32 argmax has no near-ties."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.3, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "qwen3":  # per-head q/k norms, explicit head_dim
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    else:
        raise ValueError(arch)
    return model.eval().requires_grad_(False)


def random_heads(model, num_heads: int = 4, num_layers: int = 1, std: float = 0.3, seed: int = 0,
                 own: bool = False, candidates: torch.Tensor | None = None):
    """Medusa heads for `model` with N(0, std) weights, attached: unlike zero-initialised ones they propose
    something other than the model's own next token. `own`: a projection per head; `candidates`: a
    candidate vocabulary."""
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads

    torch.manual_seed(seed)
    cfg = HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads, num_layers, own_lm_head=own)
    heads = MedusaHeads(cfg, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=std)
    if candidates is not None:
        heads.set_candidates(candidates)
    return heads.attach(model)


def mixed_prompts(batch: int, vocab: int = 97, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (7 * i + 3) % 19 for i in range(batch)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: a tiny model's ops are too small to share, and on a busy machine two
    threads wait for each other at every op (thousands of tiny passes ran seven times slower on two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def accepted_drafts(stats) -> int:
    """Draft tokens accepted over a run (`Stats.accept_hist`): an equality with plain decoding says something
    about speculation only where this is above zero."""
    return sum(a * c for a, c in enumerate(stats.accept_hist))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    tokens = out[0, len(prompt):].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


@pytest.fixture(scope="session", autouse=True)
def calibrations_stay_in_the_session(tmp_path_factory):
    """Tests calibrate tiny models saved under temporary paths: their pass-cost curves go to a directory
    of the session's own, not into the user's cache (where nothing would ever read them again)."""
    from medusa.runtime import calibrate

    where = tmp_path_factory.mktemp("calibration")
    original = calibrate.calibration_path
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "calibration_path", lambda key: where / original(key).name)
        yield


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2 in fp32 with the shipped Medusa heads, loaded once per test session (converted
    once per machine)."""
    from medusa.runtime import Runtime

    return Runtime.load("default", heads="medusa", dtype="fp32", device="cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, saying why, on a machine where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False); "
                                   "`bash scripts/gpu_check.sh` runs these on a GPU machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (the server tests' tiny runtimes speak it)."""
    from test_serve import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="module")
def rt(tokenizer):
    """A tiny random runtime with random Medusa heads, one per test module."""
    from test_serve import tiny_runtime

    return tiny_runtime(tokenizer)


def without_gate(auto) -> None:
    """Auto mode that never pauses speculation: its gate times steps, and on a busy machine a slow step may
    pause it, which tests of what auto mode plans and decodes do not check."""
    from medusa.runtime.gate import AcceptanceGate

    auto.gate = AcceptanceGate(window=1 << 20, min_tau=0.0, retry_after_steps=1)
