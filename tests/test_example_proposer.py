"""The worked example of docs/engine.md ("Adding a proposer"), run as the page shows it: its module, its
registry line, then a batched greedy decode by the new mode's name that must equal plain decoding token for
token."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from conftest import mixed_prompts, tiny_model
from medusa.decoding.engine import Engine
from medusa.decoding.target.transformer import Transformer
from medusa.runtime.proposers import BUILDERS, build_proposer

PAGE = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
V = 13  # a small vocabulary: random models repeat tokens, so repeating the root is sometimes right
MAX_NEW = 24


def example() -> tuple[str, str]:
    """The section's two python blocks: the module, then its line in BUILDERS."""
    section = PAGE.read_text().split("## Adding a proposer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the section shows one module and one registry line"
    return blocks[0], blocks[1].strip()


@pytest.fixture
def repeat_kind(monkeypatch):
    """The page's module loaded and its line added to the registry (for this test only)."""
    source, line = example()
    module = types.ModuleType("repeat")
    exec(compile(source, str(PAGE), "exec"), module.__dict__)
    entry = eval("{" + line + "}", dict(module.__dict__))
    assert list(entry) == ["repeat"] and "repeat" not in BUILDERS
    monkeypatch.setitem(BUILDERS, "repeat", entry["repeat"])
    return module


def test_the_documented_proposer_decodes_like_plain(repeat_kind):
    from medusa.runtime import Runtime

    model = tiny_model("llama", seed=2, vocab=V)
    engine = Engine(Transformer(model), eos_token_ids=None)
    rt = Runtime(model, None, engine.model, engine, None)
    proposer = build_proposer(rt, "repeat:3")
    assert isinstance(proposer, repeat_kind.RepeatProposer) and proposer.max_nodes == 4
    prompts = mixed_prompts(5, vocab=V, seed=7)
    plain = engine.generate(prompts, MAX_NEW)
    spec = engine.generate(prompts, MAX_NEW, proposer)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert spec.stats.tokens_per_pass == 4  # every step verified the root and its 3 candidates
    assert spec.stats.mean_accepted > 1  # and some of them were right
