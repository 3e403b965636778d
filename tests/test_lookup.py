"""Prompt-lookup proposer: finds repeated n-grams, and never changes greedy output."""

import pytest
import torch

from conftest import mixed_prompts, tiny_model
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.decoding.proposers.lookup import LookupProposer, propose_from
from medusa.decoding.target.transformer import Transformer


def test_copies_the_continuation_of_the_latest_longest_match():
    ctx = torch.tensor([[1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3],    # 3-gram [1,2,3] last seen at 5
                        [4, 5, 6, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0],    # 2-gram [4,5] at 0 -> 6, 4, 5
                        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])   # no match: repeat the last token
    got = propose_from(ctx, torch.tensor([14, 5, 4]), k=3, max_ngram=3, min_ngram=1)
    assert got.tolist() == [[7, 8, 5], [6, 4, 5], [4, 4, 4]]


def test_longer_ngrams_win_over_more_recent_short_ones():
    ctx = torch.tensor([[7, 1, 2, 5, 6, 2, 8, 1, 2]])  # [1,2] matches at 1 (-> 5); [2] alone at 5 (-> 8)
    assert propose_from(ctx, torch.tensor([9]), k=2, max_ngram=2, min_ngram=1).tolist() == [[5, 6]]
    assert propose_from(ctx, torch.tensor([9]), k=2, max_ngram=1, min_ngram=1).tolist() == [[8, 1]]


def test_continuation_is_cut_at_the_end_of_the_context():
    ctx = torch.tensor([[3, 4, 3, 0, 0]])  # [3] matches at 0 -> 4, 3, then nothing known
    assert propose_from(ctx, torch.tensor([3]), k=4, max_ngram=2, min_ngram=1).tolist() == [[4, 3, 3, 3]]


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_lookup_matches_plain(batch_size):
    model = tiny_model("llama", seed=2, vocab=13)  # a small vocabulary: output repeats, lookups hit
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(batch_size, vocab=13, seed=30 + batch_size)
    plain = engine.generate(prompts, 32)
    spec = engine.generate(prompts, 32, LookupProposer(k=4))
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert spec.stats.forward_passes < plain.stats.forward_passes  # it did find and accept candidates


def test_bad_settings_are_clear_errors():
    with pytest.raises(MedusaError, match="k must be"):
        LookupProposer(k=0)
    with pytest.raises(MedusaError, match="n-gram"):
        LookupProposer(max_ngram=1, min_ngram=2)
