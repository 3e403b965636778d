"""Per-row (dynamic) trees: the batched tree tensors and verification agree with the static ones, and the
node selection always yields a tree."""

import pytest
import torch

from medusa.decoding.trees.dynamic_tree import Pool, row_trees, select_nodes
from medusa.decoding.verifier import ACCEPT_REJECTION
from medusa.decoding.trees.tree import Tree, chain
from medusa.decoding.verifier import Candidates, Verifier

STATIC = Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]], name="t")


def as_rows(tree: Tree, n: int):
    """The static tree in the per-row representation, the same for n rows."""
    index = {p: i + 1 for i, p in enumerate(tree.nodes)}
    parent = torch.tensor([0] + [index.get(p[:-1], 0) for p in tree.nodes])
    t = tree.size
    return parent.expand(n, t).clone(), torch.ones(n, t, dtype=torch.bool)


@pytest.mark.parametrize("tree", [STATIC, chain(3), Tree([[0], [1], [2], [3]])])
def test_row_trees_match_static_buffers(tree):
    n = 3
    parent, live = as_rows(tree, n)
    tokens = torch.randint(0, 5, (n, tree.size - 1))
    rt = row_trees(tokens, parent, live, tree.depth)
    buf = tree.buffers()
    assert torch.equal(rt.mask[0], buf.mask) and torch.equal(rt.node_depth[0], buf.node_depth)
    assert torch.equal(rt.parent[0], buf.parent)
    kids = [sorted(c for c in row.tolist() if c >= 0) for row in rt.children[0]]
    assert kids == [sorted(c for c in row.tolist() if c >= 0) for row in buf.children]
    # every static root-to-leaf path is among the per-node paths
    per_node = {tuple(p[: int(l) + 1]) for p, l in zip(rt.paths[0].tolist(), rt.path_len[0].tolist())}
    for p, l in zip(buf.leaf_paths.tolist(), buf.path_len.tolist()):
        assert tuple(p[: l + 1]) in per_node


def distinct_siblings(tree: Tree, n: int, v: int, g) -> torch.Tensor:
    """Random tokens [n, T] (root first) with siblings distinct, as top-k picks are."""
    shift = torch.randint(0, v, (n, tree.depth + 1), generator=g)
    ranks = torch.tensor([0] + [p[-1] for p in tree.nodes])
    depth = torch.tensor([0] + [len(p) for p in tree.nodes])
    return (ranks[None, :] + shift.gather(1, depth.expand(n, -1))) % v


def test_greedy_verification_matches_the_static_verifier():
    g = torch.Generator().manual_seed(0)
    n, v = 6, 5
    parent, live = as_rows(STATIC, n)
    for _ in range(20):
        tokens = distinct_siblings(STATIC, n, v, g)
        logits = torch.randn(n, STATIC.size, v, generator=g)
        want = Verifier().verify(logits, Candidates.shared(tokens, STATIC.buffers()))
        got = Verifier().verify(logits, row_trees(tokens[:, 1:], parent, live, STATIC.depth).candidates(tokens))
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)
        acc = want.accepted
        for r in range(n):
            assert got.path[r, : acc[r] + 1].tolist() == want.path[r, : acc[r] + 1].tolist()


class FixedUniforms:
    """Just enough of RowSampling for the verifiers: every row samples with rejection, fixed uniforms."""

    def __init__(self, n, seed):
        self.acceptance = torch.full((n,), ACCEPT_REJECTION)
        self.g = torch.Generator().manual_seed(seed)

    def uniform(self, rows, m):
        return torch.rand(rows.stop - (rows.start or 0), m, generator=self.g)


def test_rejection_verification_matches_the_static_verifier():
    n, v = 5, 6
    parent, live = as_rows(STATIC, n)
    g = torch.Generator().manual_seed(1)
    for seed in range(10):
        tokens = distinct_siblings(STATIC, n, v, g)
        p = torch.softmax(torch.randn(n, STATIC.size, v, generator=g), -1)
        rows = slice(0, n)
        want = Verifier().by_rule(p, Candidates.shared(tokens, STATIC.buffers()), FixedUniforms(n, seed), rows)
        got = Verifier().by_rule(p, row_trees(tokens[:, 1:], parent, live, STATIC.depth).candidates(tokens),
                                        FixedUniforms(n, seed), rows)
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)


def test_selection_keeps_parents_and_dead_nodes_are_never_accepted():
    g = torch.Generator().manual_seed(2)
    n, k, depth = 4, 3, 4
    pool = Pool([], [], [], [])
    score = torch.log_softmax(torch.randn(n, k, generator=g), -1)
    front = pool.add(torch.randint(0, 9, (n, k), generator=g), score, torch.full((n, k), -1), 1)
    front_pool, front_score = front + torch.arange(k).expand(n, k), score
    for d in range(2, depth + 1):
        logp = torch.log_softmax(torch.randn(n, k, k, generator=g), -1)
        cs = (front_score[:, :, None] + logp).reshape(n, -1)
        slot = torch.arange(k)[None, :, None].expand(n, k, k).reshape(n, -1)
        start = pool.add(torch.randint(0, 9, (n, k * k), generator=g), cs, front_pool.gather(1, slot), d)
        best = cs.topk(k, -1).indices
        front_pool, front_score = start + best, cs.gather(1, best)
    pool.scores[0][0, 1:] = float("-inf")  # row 0: only one depth-1 node alive, so some nodes are dead
    _, scores, parents, depths = pool.flat(n, torch.device("cpu"))
    for nodes in (1, 5, 12):
        chosen, parent = select_nodes(scores, parents, depths, nodes)
        assert (parent < torch.arange(1, nodes + 1)).all()  # parents come first
        trees = pool.trees(nodes, depth)
        logits = torch.randn(n, nodes + 1, 9, generator=g)
        tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), trees.tokens], 1)
        verdict = Verifier().verify(logits, trees.candidates(tokens))
        dead = trees.path_len == 0
        dead[:, 0] = False
        for r in range(n):
            for node in verdict.path[r, 1: verdict.accepted[r] + 1].tolist():
                assert not dead[r, node]


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_medusa_heads_with_dynamic_trees_match_plain(batch_size):
    from conftest import mixed_prompts, random_heads, tiny_model
    from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer
    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer

    model = tiny_model("llama", vocab=16)
    engine = Engine(Transformer(model), eos_token_ids=None)
    heads = random_heads(model)
    prompts = mixed_prompts(batch_size, vocab=16, seed=batch_size)
    plain = engine.generate(prompts, 24)
    for candidates in (None, torch.arange(0, 16, 2)):
        heads.set_candidates(candidates)
        spec = engine.generate(prompts, 24, MedusaDynamicProposer(heads, 10, 4, 3))
        assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert sum(spec.stats.accept_hist[1:]) > 0


def test_dynamic_tree_ranks_candidates_through_the_heads_own_projections():
    """Heads with a projection each over a candidate vocabulary (vLLM's token_map layout) rank their
    candidates through those projections in a dynamic tree exactly as the static proposer does."""
    from conftest import random_heads, tiny_model
    from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer

    model = tiny_model("llama", vocab=16)
    heads = random_heads(model, own=True)
    ids = torch.arange(0, 16, 2)
    for k, full in enumerate(heads.lm_heads):  # each projection keeps only the candidates' rows
        rows = torch.nn.Linear(full.weight.shape[1], len(ids), bias=False)
        rows.weight.data.copy_(full.weight.data[ids])
        heads.lm_heads[k] = rows
    heads.candidate_ids, heads.config.candidates = ids, len(ids)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, tokens = MedusaDynamicProposer(heads, 10, 4, 3)._log_probs(hidden)
        assert torch.equal(tokens, heads.top_tokens(hidden, 3, 4))
