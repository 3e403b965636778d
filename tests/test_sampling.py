"""Sampling with speculation: rejection sampling (and matching keyed samples, for seeded rows) keeps the
target distribution exactly; typical does not. Seeded rows write the same text whatever the speculation."""

import dataclasses

import pytest
import torch

from conftest import hf_greedy, mixed_prompts, random_heads, tiny_model
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.proposers import MedusaProposer, StaticProposer
from medusa.decoding.verifier import RowTrees
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import Transformer
from medusa.decoding.trees.tree import chain, load_tree

V = 8
PROMPT = [1, 2, 3]


def small_model():
    model = tiny_model("llama", seed=5, vocab=V)
    # Flatter logits than the default tiny model, so that every token has real probability mass.
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)
    return model


@pytest.fixture(scope="module")
def small():
    model = small_model()
    return model, Engine(Transformer(model), eos_token_ids=None)


def exact_pairs(model, params: SamplingParams) -> torch.Tensor:
    """Exact probability of each (first, second) output token pair under plain sampling: [V*V]."""
    def dist(seq):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1] / params.temperature
        return torch.softmax(logits.double(), -1)
    p1 = dist(PROMPT)
    return torch.stack([p1[a] * dist(PROMPT + [a]) for a in range(V)]).flatten()


def seeded_rows(params: SamplingParams, n: int, seed: int = 0) -> list[SamplingParams]:
    """`params` for `n` rows, each with a seed of its own (so verified by matching keyed samples)."""
    return [dataclasses.replace(params, seed=seed + i) for i in range(n)]


def sample(engine, proposer, params, n=6000, seed=0, keyed=False):
    """Counts of each (first, second) output token pair over `n` rows, and the run's stats. Rows have seeds of
    their own when `keyed`, else share the batch's generator, seeded: either way the statistical tests draw
    the same numbers on every run, so they cannot fail by chance."""
    rows = seeded_rows(params, n, seed) if keyed else [params] * n
    gen = engine.generate([PROMPT] * n, 2, proposer, rows, seed=seed)
    pairs = torch.tensor([o.tokens[0] * V + o.tokens[1] for o in gen.outputs])
    return torch.bincount(pairs, minlength=V * V).double(), gen.stats


def sample_pairs(engine, proposer, params, n=6000, seed=0, keyed=False) -> torch.Tensor:
    return sample(engine, proposer, params, n, seed, keyed)[0]


def accepted(stats) -> int:
    """Candidates accepted over the run."""
    return sum(a * c for a, c in enumerate(stats.accept_hist))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test, cells with expected count < 5 lumped together."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


class SampledChain(StaticProposer):
    """A chain proposer that draws its tokens from an arbitrary (wrong) distribution q and says so."""

    name = "sampled-chain"

    def __init__(self, k: int, seed: int = 0):
        self.tree = chain(k)
        self.gen = torch.Generator().manual_seed(seed)

    def draft(self, batch):
        n = batch.n
        logits = torch.randn(n, self.tree.size - 1, V, generator=self.gen) * 1.5
        q = torch.softmax(logits, -1)
        tokens = torch.multinomial(q.view(-1, V), 1, generator=self.gen).view(n, -1)
        return RowTrees.shared(tokens, self.tree.buffers(), q)


PARAMS = SamplingParams(temperature=1.0, acceptance="rejection", seed=None)


@pytest.mark.parametrize("keyed", [False, True], ids=["shared", "keyed"])
def test_plain_sampling_matches_exact_distribution(small, keyed):
    model, engine = small
    counts = sample_pairs(engine, None, PARAMS, keyed=keyed)
    assert chi_square_pvalue(counts, exact_pairs(model, PARAMS)) > 1e-3


@pytest.mark.parametrize("kind", ["tree", "chain"])
@pytest.mark.parametrize("keyed", [False, True], ids=["rejection", "match"])
def test_rejection_sampling_is_lossless(small, kind, keyed):
    """Unseeded rows are verified by rejection, seeded ones by matching keyed samples: both lossless, for
    deterministic tree drafts and for a chain sampled from a wrong distribution."""
    model, engine = small
    proposer = MedusaProposer(random_heads(model), load_tree("prior-8")) if kind == "tree" else SampledChain(3)
    counts, stats = sample(engine, proposer, PARAMS, keyed=keyed)
    assert chi_square_pvalue(counts, exact_pairs(model, PARAMS)) > 1e-3
    assert accepted(stats) > 0  # candidates were accepted (and rejected): acceptance itself was tested
    assert stats.accept_hist[0] > 0


def test_typical_acceptance_is_not_lossless(small):
    """The same test rejects Medusa's typical acceptance, so the test above can fail."""
    model, engine = small
    params = SamplingParams(temperature=1.0, acceptance="typical", typical_epsilon=0.3, typical_delta=0.5)
    proposer = MedusaProposer(random_heads(model), load_tree("prior-8"))
    counts, stats = sample(engine, proposer, params)
    assert chi_square_pvalue(counts, exact_pairs(model, params)) < 1e-6
    assert accepted(stats) > 0


def test_top_k_and_top_p_restrict_the_support(small):
    model, engine = small
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
    order = first.argsort(descending=True).tolist()
    proposer = MedusaProposer(random_heads(model), load_tree("prior-8"))
    gen = engine.generate([PROMPT] * 400, 1, proposer, SamplingParams(temperature=1.0, top_k=2))
    assert {o.tokens[0] for o in gen.outputs} == set(order[:2])
    cut = float(first[order[0]]) + 1e-6  # top_p just above the top token's mass keeps exactly two tokens
    gen = engine.generate([PROMPT] * 400, 1, proposer, SamplingParams(temperature=1.0, top_p=cut))
    assert {o.tokens[0] for o in gen.outputs} == set(order[:2])


def test_seeded_runs_are_reproducible(small):
    model, engine = small
    proposer = MedusaProposer(random_heads(model), load_tree("prior-16"))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    a = engine.generate(mixed_prompts(3, vocab=V), 20, proposer, params)
    b = engine.generate(mixed_prompts(3, vocab=V)[::-1], 20, proposer, params[::-1])
    assert [o.tokens for o in a.outputs] == [o.tokens for o in b.outputs][::-1]
    c = engine.generate(mixed_prompts(3, vocab=V), 20, proposer, [SamplingParams(temperature=1.0, seed=9)] * 3)
    assert [o.tokens for o in a.outputs] != [o.tokens for o in c.outputs]


def test_a_seeded_row_writes_the_same_text_whatever_the_speculation(small):
    """A seeded row's tokens depend on its seed and the logits alone: plain decoding, a Medusa tree and a
    chain sampled from another distribution write the same, alone or beside other rows (seeded or not)."""
    model, engine = small
    prompts = mixed_prompts(4, vocab=V, seed=8)
    mine = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (11, 12)]
    others = [SamplingParams(temperature=0.8), SamplingParams()]
    want = [engine.generate([p], 24, None, [m]).outputs[0].tokens for p, m in zip(prompts, mine)]
    assert want[0] != engine.generate([prompts[0]], 24, None, [dataclasses.replace(mine[0], seed=13)]).outputs[0].tokens
    proposers = {"tree": MedusaProposer(random_heads(model), load_tree("prior-16")), "chain": SampledChain(3)}
    for name, proposer in proposers.items():
        alone = [engine.generate([p], 24, proposer, [m]) for p, m in zip(prompts, mine)]
        assert [g.outputs[0].tokens for g in alone] == want, name
        assert sum(accepted(g.stats) for g in alone) > 0, name  # speculation took part
        batched = engine.generate(prompts[2:] + prompts[:2], 24, proposer, others + mine)
        assert [o.tokens for o in batched.outputs[2:]] == want, name


def test_rows_with_different_temperatures_in_one_batch():
    model = tiny_model("qwen2")
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(4, seed=3)
    heads = MedusaHeads(HeadsConfig(64, 97, 4, 1)).attach(model)
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, acceptance="typical", seed=2)]
    gen = engine.generate(prompts, 16, MedusaProposer(heads, load_tree("prior-16")), params)
    for i in (0, 2):  # greedy rows stay token-identical to plain greedy decoding
        assert gen.outputs[i].tokens == hf_greedy(model, prompts[i], 16)
    assert gen.outputs[1].tokens != hf_greedy(model, prompts[1], 16)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(acceptance="maybe")])
def test_bad_sampling_parameters(kwargs):
    with pytest.raises(MedusaError):
        SamplingParams(**kwargs)
