import json

import pytest
import torch

from conftest import random_heads, tiny_model
from medusa.errors import MedusaError
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.proposers import MedusaProposer
from medusa.decoding.trees.tree import Tree, build_tree, chain, load_tree
from medusa.decoding.verifier import Candidates, Verifier


def test_tree_buffers_hand_worked():
    # root=0, [0]=1, [1]=2, [0,0]=3, [0,1]=4, [1,0]=5, [0,0,0]=6
    tree = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    b = tree.buffers()
    assert tree.size == 7 and tree.depth == 3 and tree.topk == 2
    assert b.node_depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    expected_mask = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert b.mask.int().tolist() == expected_mask
    # flattened top-k index: head (depth-1) * topk + rank
    assert b.cand_index.tolist() == [0, 1, 2, 3, 2, 4]
    # leaves [0,1], [1,0], [0,0,0]: root-to-leaf chains padded by repeating the leaf
    assert b.leaf_paths.tolist() == [[0, 1, 4, 4], [0, 2, 5, 5], [0, 1, 3, 6]]
    assert b.path_len.tolist() == [2, 2, 3]


def test_chain_and_root_only():
    b = chain(3).buffers()
    assert b.leaf_paths.tolist() == [[0, 1, 2, 3]]
    assert b.mask.int().tolist() == torch.ones(4, 4).tril().int().tolist()


def test_greedy_verifier_picks_longest_path():
    tree = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    v = 10
    tokens = torch.tensor([[5, 1, 2, 3, 4, 6, 7]])
    # target argmax after each node: root->2 (so node 2 accepted), node2 -> 6 (node 5 accepted), node5 -> 9
    pred = torch.tensor([[2, 0, 6, 0, 0, 9, 0]])
    logits = torch.nn.functional.one_hot(pred, v).float()
    verdict = Verifier().verify(logits, Candidates.shared(tokens, tree.buffers()))
    assert verdict.accepted.tolist() == [2]
    assert verdict.path[0, :3].tolist() == [0, 2, 5]
    assert verdict.next_token.tolist() == [9]


@pytest.mark.parametrize("bad", [[[0, 1]], [[0], [-1]], [[]]])
def test_malformed_trees_are_refused(bad):
    with pytest.raises(MedusaError):
        Tree(bad)


def test_tree_deeper_than_heads_is_refused():
    model = tiny_model()
    heads = MedusaHeads(HeadsConfig(64, 97, num_heads=2)).attach(model)
    with pytest.raises(MedusaError, match="only 2 heads"):
        MedusaProposer(heads, Tree([[0], [0, 0], [0, 0, 0]]))


def test_tree_wider_than_vocabulary_is_refused():
    model = tiny_model(vocab=5)
    heads = MedusaHeads(HeadsConfig(64, 5, num_heads=2)).attach(model)
    with pytest.raises(MedusaError, match="top-6"):
        MedusaProposer(heads, Tree([[0], [5]]))


def test_unknown_tree_name(tmp_path):
    with pytest.raises(MedusaError, match="tree-8"):
        load_tree("no-such-tree")
    bad = tmp_path / "t.yaml"
    bad.write_text("paths: [[0], 'x']\n")
    with pytest.raises(MedusaError, match="integer paths"):
        load_tree(str(bad))


def test_shipped_trees_load():
    for n in (8, 16, 32, 64):
        assert load_tree(f"tree-{n}").size == n + 1


def test_build_tree_prefers_likely_nodes():
    acc = [[0.9, 0.05], [0.8, 0.1], [0.7, 0.1]]
    tree = build_tree(acc, 3)
    assert tree.nodes == [(0,), (0, 0), (0, 0, 0)]
    tree = build_tree([[0.5, 0.4], [0.1, 0.05]], 3)
    assert tree.nodes == [(0,), (1,), (0, 0)]


def _random_heads(own: bool):
    model = tiny_model()
    return model, random_heads(model, num_heads=3, num_layers=2, std=0.1, own=own)


@pytest.mark.parametrize("own", [False, True])
def test_heads_roundtrip_own_layout(tmp_path, own):
    model, heads = _random_heads(own)
    x = torch.randn(5, 64)
    heads.save(tmp_path)
    loaded = MedusaHeads.load(tmp_path).attach(model)
    assert torch.equal(heads(x), loaded(x))
    assert heads(x).shape == (3, 5, 97)
    # shared projection: only the residual blocks are stored
    assert sum(p.numel() for p in loaded.parameters()) == 3 * 2 * (64 * 64 + 64) + own * 3 * 64 * 97


@pytest.mark.parametrize("own", [False, True])
def test_heads_roundtrip_medusa_layout(tmp_path, own):
    model, heads = _random_heads(own)
    heads.save(tmp_path, medusa_layout=True)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["medusa_num_heads"] == 3 and meta["medusa_num_layers"] == 2
    keys = set(torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True))  # what FasterDecoding loads
    assert {"0.0.linear.weight", "2.1.linear.bias", "1.2.weight"} <= keys
    loaded = MedusaHeads.load(tmp_path).attach(model)
    x = torch.randn(4, 64)
    assert torch.allclose(heads(x), loaded(x))


def test_medusa_layout_safetensors_file(tmp_path):
    """FasterDecoding's newer trainer writes medusa_lm_head.safetensors: read as well."""
    model, heads = _random_heads(True)
    heads.save(tmp_path, medusa_layout=True)
    from safetensors.torch import save_file
    state = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "medusa_lm_head.pt").unlink()
    x = torch.randn(2, 64)
    assert torch.allclose(heads(x), MedusaHeads.load(tmp_path).attach(model)(x))


def test_untrained_heads_repeat_the_base_prediction():
    """Zero-initialised blocks: every head starts as the base model's own lm_head."""
    model = tiny_model()
    heads = MedusaHeads(HeadsConfig(64, 97, num_heads=2)).attach(model)
    h = torch.randn(3, 64)
    out = heads(h)
    assert torch.allclose(out[0], model.lm_head(h), atol=1e-5) and torch.allclose(out[1], model.lm_head(h), atol=1e-5)


def test_heads_for_other_hidden_size_are_refused():
    heads = MedusaHeads(HeadsConfig(32, 97))
    with pytest.raises(MedusaError, match="hidden size 32"):
        heads.attach(tiny_model())


def test_heads_dir_without_heads(tmp_path):
    with pytest.raises(MedusaError, match="holds no heads"):
        MedusaHeads.load(tmp_path)


def test_candidate_vocabulary_roundtrip_and_proposals(tmp_path):
    model, heads = _random_heads(False)
    ids = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])
    heads.set_candidates(ids)
    heads.save(tmp_path)
    loaded = MedusaHeads.load(tmp_path).attach(model)
    assert loaded.config.candidates == 8 and torch.equal(loaded.candidate_ids, ids)
    x = torch.randn(6, 64)
    top = loaded.top_tokens(x, 3, 3)
    assert top.shape == (3, 6, 3) and torch.isin(top, ids).all()
    # the proposals are the best-scoring candidates under the full projection
    full = heads(x)[:, :, ids]
    assert torch.equal(top, ids[full.topk(3, dim=-1).indices])
    # without candidates: the whole vocabulary
    heads.set_candidates(None)
    assert torch.equal(heads.top_tokens(x, 3, 3), heads(x).topk(3, dim=-1).indices)


def test_candidate_vocabulary_checks(tmp_path):
    model, heads = _random_heads(False)
    heads.set_candidates(torch.tensor([1, 2]))
    with pytest.raises(MedusaError, match="only 2"):
        MedusaProposer(heads, Tree([[0], [1], [2]]))
    heads.set_candidates(torch.tensor([1, 500]))
    heads.save(tmp_path)
    with pytest.raises(MedusaError, match="outside the model's vocabulary"):
        MedusaHeads.load(tmp_path).attach(model)
    _, own = _random_heads(True)
    with pytest.raises(MedusaError, match="share the base lm_head"):
        own.set_candidates(torch.tensor([1, 2]))
