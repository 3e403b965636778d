"""The tau a feature head is expected to reach: rank paths along the chain the head drafts, the accuracies
along accepted paths, and the expectation auto mode and `medusa train-feature` read from them."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.train.feature_data import draft_map, extract, feature_fn
from medusa.train.feature_eval import path_accuracy, rank_paths

V = 31


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", vocab=V)
    torch.manual_seed(0)
    head = FeatureHead(FeatureHeadConfig(model.config.hidden_size, V, V), model).float()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (14, 19):
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "loss_mask": [0] * 5 + [1] * (n - 5)})
    feats = extract(examples, feature_fn(model, []))
    return model, head, feats


def _chain(head, feats, i: int, origin: int, depth: int) -> list[torch.Tensor]:
    """The head's log-probabilities at depths 1..depth drafting from `origin` of sequence i, step by step
    as decoding does: the true entries up to `origin`, then each drafted entry reading the previous entry's
    output and the true next token, under a plain causal mask."""
    f, tok = feats.feats.rows(feats.seq(i).start, feats.seq(i).stop).float(), feats.tokens[feats.seq(i)]
    emb = head.embed(tok[1:]).float()  # entry s reads x_{s+1}
    x = head.inputs(emb[: origin + 1], f[: origin + 1], fused=True)
    out = []
    for d in range(depth):
        t = x.shape[0]
        y = head.layer_forward(emb[None, :t], x[None], torch.arange(t)[None], None)[0]
        out.append(torch.log_softmax(head.logits(y[-1]), -1))
        if d + 1 < depth:
            x = torch.cat([x, head.inputs(emb[t: t + 1], y[-1:], fused=False)])
    return out


@torch.no_grad()
def test_rank_paths_follow_the_chain_the_head_drafts_from_each_position(setup):
    _, head, feats = setup
    depth = 4
    ranks, logq = rank_paths(head, feats, draft_map(V, head.draft_ids), depth, V, scores=True)
    # Origins: positions o whose o + 2 is an answer token (12 and 17 of them).
    assert ranks.shape == (9 + 14, depth) and logq.shape == (9 + 14, depth, V)
    row = 0
    for i in range(len(feats)):
        seq = feats.seq(i)
        n = seq.stop - seq.start
        top = feats.top[seq]
        for origin in range(3, n - 2):
            chain = _chain(head, feats, i, origin, min(depth, n - 2 - origin))
            for d, lp in enumerate(chain):
                label = int(top[origin + d + 1])  # the target's token at origin + d + 2
                expect = int((lp > lp[label]).sum())
                assert ranks[row, d] == expect, (i, origin, d)
                assert torch.allclose(logq[row, d], lp.sort(descending=True).values, rtol=1e-4, atol=1e-4)
            # Past the answer's end: no label.
            assert (ranks[row, len(chain):] == -1).all()
            row += 1
    assert row == len(ranks)


def test_path_accuracy_conditions_each_depth_on_the_accepted_prefix():
    # Four positions; rank k (= 3 here) is a miss, -1 no label.
    paths = torch.tensor([[0, 0, 1], [0, 3, 0], [1, 0, -1], [3, 0, 0]])
    acc = path_accuracy(paths, 3)
    assert acc[0] == pytest.approx([2 / 4, 1 / 4, 0])
    # Depth 2 among the three accepted at depth 1 (the fourth missed); depth 3 among those still accepted
    # that have a label there (the first only).
    assert acc[1] == pytest.approx([2 / 3, 0, 0])
    assert acc[2] == pytest.approx([0, 1, 0])


def test_accuracies_along_the_accepted_path_give_a_chain_its_exact_expected_length():
    """Depths are correlated (a position the head gets right at depth 1 is easier at depth 2): multiplying
    per-depth accuracies over all positions misjudges even a chain, multiplying the accuracies among the
    positions whose path was accepted so far gives its expected accepted length exactly."""
    from medusa.decoding.trees.tree import expected_tau
    from medusa.train.feature_eval import marginal_accuracy

    g = torch.Generator().manual_seed(0)
    easy = torch.rand(4000, generator=g) < 0.5  # half the positions easy, half hard, at every depth
    p = torch.where(easy, 0.9, 0.3)[:, None].expand(4000, 3)
    paths = (torch.rand(4000, 3, generator=g) > p).long()  # rank 0 (hit) or 1 (miss: k = 1)
    chain = [(0,), (0, 0), (0, 0, 0)]
    exact = 1 + sum(float((paths[:, :d] == 0).all(1).float().mean()) for d in (1, 2, 3))
    assert expected_tau(chain, path_accuracy(paths, 1)) == pytest.approx(exact, abs=1e-6)
    assert expected_tau(chain, marginal_accuracy(paths, 1)) < exact - 0.1


def test_evaluate_head_reports_accuracies_along_the_accepted_path(setup):
    from types import SimpleNamespace

    from medusa.train.feature_eval import evaluate_head, marginal_accuracy

    _, head, feats = setup
    cfg = SimpleNamespace(loss=SimpleNamespace(unroll=2), eval_steps=3, eval_topk=5)
    report = evaluate_head(head, cfg, None, None, [{}, {}], draft_map(V, head.draft_ids), feats)
    paths = rank_paths(head, feats, draft_map(V, head.draft_ids), 3, 5)
    assert report["rank_accuracy"] == path_accuracy(paths, 5)
    assert report["top1"] == [a[0] for a in marginal_accuracy(paths, 5)]
    assert report["labels_per_step"] == [23, 21, 19]
