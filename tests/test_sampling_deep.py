"""Rejection sampling deep in the tree: the exact joint distribution of five sampled tokens.

The first token comes from the prefill and the next four from verification, so a step that accepts d
candidates decides tokens 2..d+1: the joint distribution of five tokens holds acceptance and rejection at
depths 1-4, over as many steps as the rows take. Rows are unseeded, so every one is verified by rejection
(seeded rows are verified by matching keyed samples: `test_sampling.py`). A three-token vocabulary keeps
the joint small (243 cells) and makes random drafts right often enough that rows accept deep."""

from __future__ import annotations

import pytest
import torch

from conftest import random_heads
from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer, TreeShape
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.proposers import MedusaProposer, StaticProposer
from medusa.decoding.proposers.retrieval import MergedProposer, Retriever, RetrievalProposer
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import Transformer
from medusa.decoding.trees.tree import Tree, chain
from medusa.decoding.verifier import RowTrees
from test_sampling import chi_square_pvalue

V, L, ROWS = 3, 5, 2000
PROMPT = [1, 2, 0, 1, 2, 0, 1, 2]  # repeats: retrieval drafts from the text
PARAMS = SamplingParams(temperature=1.0, acceptance="rejection")
# Four deep, at most two children per node: with three tokens a node can reject all of its children.
DEEP = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]], "deep-10")
SHAPE = TreeShape(10, 4, 2)


def small_model():
    """One layer, 32 wide: the sampling tests decode thousands of rows, and the model's size does not matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # every token keeps real probability mass
    return model


def exact_sequences(model) -> torch.Tensor:
    """Probability of every sequence of L output tokens under plain sampling: [V**L], in base-V order."""
    probs, seqs = torch.ones(1, dtype=torch.double), [[]]
    for _ in range(L):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + s for s in seqs])).logits[:, -1] / PARAMS.temperature
        probs = (probs[:, None] * torch.softmax(logits.double(), -1)).flatten()
        seqs = [s + [a] for s in seqs for a in range(V)]
    return probs


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Thousands of rows of a tiny model: see `conftest.one_thread`."""


@pytest.fixture(scope="module")
def setup():
    model = small_model()
    return model, Engine(Transformer(model), eos_token_ids=None), exact_sequences(model)


def sample_sequences(engine, proposer, seed: int = 0):
    """Counts of every sequence of L tokens over ROWS unseeded rows, and the run's stats. The batch's shared
    generator is seeded: the test draws the same numbers on every run, so it cannot fail by chance."""
    gen = engine.generate([PROMPT] * ROWS, L, proposer, PARAMS, seed=seed)
    tokens = torch.tensor([o.tokens for o in gen.outputs])
    index = (tokens * V ** torch.arange(L - 1, -1, -1)).sum(1)
    return torch.bincount(index, minlength=V ** L).double(), gen.stats


def feature_head(model, seed: int = 3) -> FeatureHead:
    torch.manual_seed(seed)
    c = model.config
    head = FeatureHead(FeatureHeadConfig(c.hidden_size, V, V), model)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.3)
    return head


PROPOSERS = {
    "medusa tree": lambda m, e: MedusaProposer(random_heads(m, num_heads=4, seed=1), DEEP),
    "feature tree": lambda m, e: FeatureProposer(feature_head(m), e.model, SHAPE, sample_chain=False),
    "feature chain": lambda m, e: FeatureProposer(feature_head(m), e.model, SHAPE, sample_chain=True),
    "retrieval": lambda m, e: RetrievalProposer(10, Retriever(3, 4)),
    "feature tree+retrieval": lambda m, e: MergedProposer(
        FeatureProposer(feature_head(m), e.model, SHAPE, sample_chain=False), Retriever(3, 4)),
    "medusa dynamic+retrieval": lambda m, e: MergedProposer(
        MedusaDynamicProposer(random_heads(m, num_heads=4, seed=1), 10, 4, 2), Retriever(3, 4)),
}


@pytest.mark.parametrize("name", PROPOSERS)
def test_rejection_keeps_the_joint_distribution_of_five_tokens(setup, name):
    """Medusa trees (point masses), feature-head trees (point masses) and sampled chains (with their q),
    retrieval trees and trees merged with retrieval: five tokens jointly as plain sampling draws them,
    with many rows accepting two, three and four candidates in a step."""
    model, engine, exact = setup
    counts, stats = sample_sequences(engine, PROPOSERS[name](model, engine))
    assert chi_square_pvalue(counts, exact) > 1e-3, name
    hist = stats.accept_hist + [0] * 5
    assert sum(hist[2:]) >= ROWS // 10, (name, hist)  # deep acceptance, often: depths 2-4 were exercised
    assert hist[3] > 0 and hist[4] > 0, (name, hist)
    assert hist[0] > 0, (name, hist)  # and rows that rejected everything


class LyingChain(StaticProposer):
    """A chain of 4 drawn from q, reporting q truthfully at depth 1 and a different distribution below."""

    name = "lying-chain"

    def __init__(self):
        self.tree = chain(4)
        self.gen = torch.Generator().manual_seed(0)

    def draft(self, batch):
        n = batch.n
        q = torch.softmax(torch.randn(n, 4, V, generator=self.gen) * 1.5, -1)
        tokens = torch.multinomial(q.view(-1, V), 1, generator=self.gen).view(n, 4)
        told = q.clone()
        told[:, 1:] = torch.softmax(torch.randn(n, 3, V, generator=self.gen) * 1.5, -1)
        return RowTrees.shared(tokens, self.tree.buffers(), told)


def test_the_joint_test_notices_a_rejection_wrong_only_below_depth_1(setup):
    """Acceptance that is exact at depth 1 and wrong deeper moves the joint far enough that the test above
    fails it: it measures depths 2-4, not only the first step's first candidate."""
    model, engine, exact = setup
    counts, stats = sample_sequences(engine, LyingChain())
    assert sum(stats.accept_hist[2:]) >= ROWS // 10
    assert chi_square_pvalue(counts, exact) < 1e-6
