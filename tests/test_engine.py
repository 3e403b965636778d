"""Greedy speculative decoding must reproduce plain greedy decoding token for token, batched."""

import pytest
import torch

from conftest import accepted_drafts, hf_greedy, mixed_prompts, random_heads, tiny_model
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.proposers import MedusaProposer, StaticProposer
from medusa.decoding.target.transformer import Transformer
from medusa.decoding.trees.tree import Tree, chain, load_tree

MAX_NEW = 24
# A fixed 16-node, 4-deep tree (the shipped trees follow the trained heads and may change shape).
DEEP_TREE = Tree([[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                  [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [1, 0, 0, 0]], name="deep-16")


def test_medusa_with_candidate_vocabulary_matches_plain():
    """Heads restricted to a token subset propose differently but the output stays plain greedy's."""
    model = tiny_model()
    engine = Engine(Transformer(model), eos_token_ids=None)
    heads = random_heads(model)
    heads.set_candidates(torch.arange(0, model.config.vocab_size, 2))
    prompts = mixed_prompts(5)
    plain = engine.generate(prompts, MAX_NEW)
    spec = engine.generate(prompts, MAX_NEW, MedusaProposer(heads, DEEP_TREE))
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert accepted_drafts(spec.stats) > 0  # the restricted heads' drafts took part


class OracleProposer(StaticProposer):
    """Proposes the known greedy continuation along rank-0 paths, wrong tokens elsewhere, and breaks the
    correct path at a random depth: rows accept different, known-to-vary numbers of tokens each step."""

    name = "oracle"

    def __init__(self, tree: Tree, reference: dict, vocab: int, seed: int = 0):
        self.tree, self.reference, self.vocab = tree, reference, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def fill(self, batch):
        n = batch.n
        out = torch.zeros(n, self.tree.size - 1, dtype=torch.long)
        for r in range(n):
            ref = self.reference[batch.ids[r]]
            pos = int(batch.out_len[r])  # ref[pos] is the token after the pending root
            cut = int(torch.randint(0, self.tree.depth + 1, (1,), generator=self.gen))
            for i, path in enumerate(self.tree.nodes):
                d = len(path)
                good = pos + d - 1 < len(ref) and all(x == 0 for x in path) and d <= cut
                tok = ref[pos + d - 1] if good else (ref[min(pos + d - 1, len(ref) - 1)] + 1 + path[-1]) % self.vocab
                out[r, i] = tok
        return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    model = tiny_model(request.param)
    return model, Engine(Transformer(model), eos_token_ids=None)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_plain_matches_hf_generate(setup, batch_size):
    model, engine = setup
    prompts = mixed_prompts(batch_size)
    gen = engine.generate(prompts, MAX_NEW)
    assert [o.tokens for o in gen.outputs] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert gen.stats.mean_accepted == 1.0


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
@pytest.mark.parametrize("tree", ["tree-8", "tree-16", "tree-64", "deep"])
def test_medusa_random_heads_match_plain(setup, batch_size, tree):
    model, engine = setup
    prompts = mixed_prompts(batch_size, seed=batch_size)
    plain = engine.generate(prompts, MAX_NEW)
    shape = DEEP_TREE if tree == "deep" else load_tree(tree)
    spec = engine.generate(prompts, MAX_NEW, MedusaProposer(random_heads(model), shape))
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    # These seeded heads do hit now and then (at every size and tree here): accepted candidates took part.
    accepted = sum(a * c for a, c in enumerate(spec.stats.accept_hist))
    assert accepted > 0 and spec.stats.accept_hist[0] > 0
    assert spec.stats.forward_passes <= plain.stats.forward_passes


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
@pytest.mark.parametrize("tree", ["deep", "chain"])
def test_ragged_acceptance_matches_plain(setup, batch_size, tree):
    """Many tokens accepted, a different number per row and step: outputs still equal HF generate."""
    model, engine = setup
    prompts = mixed_prompts(batch_size, seed=10 + batch_size)
    reference = {i: hf_greedy(model, p, MAX_NEW) for i, p in enumerate(prompts)}
    shape = chain(4) if tree == "chain" else DEEP_TREE
    spec = engine.generate(prompts, MAX_NEW, OracleProposer(shape, reference, model.config.vocab_size))
    assert [o.tokens for o in spec.outputs] == [reference[i] for i in range(batch_size)]
    assert spec.stats.mean_accepted > 1.5  # the proposer really was accepted, several tokens at a time
    assert sum(c > 0 for c in spec.stats.accept_hist) > 2  # rows and steps accepted different amounts


def test_rows_finish_at_eos_at_different_steps():
    model = tiny_model("llama", seed=3)
    prompts = mixed_prompts(8, seed=4)
    # Pick as EOS a token that plain decoding emits at different times in different rows.
    free = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    counts = torch.bincount(torch.tensor(sum(free, [])), minlength=97)
    eos = int(counts.argmax())
    engine = Engine(Transformer(model), eos_token_ids=[eos])
    reference = [hf_greedy(model, p, MAX_NEW, eos=eos) for p in prompts]
    assert len({len(r) for r in reference}) > 2
    for proposer in (None, MedusaProposer(random_heads(model), load_tree("tree-16")),
                     OracleProposer(DEEP_TREE, dict(enumerate(reference)), 97)):
        gen = engine.generate(prompts, MAX_NEW, proposer)
        assert [o.tokens for o in gen.outputs] == reference
        assert [o.reason for o in gen.outputs] == ["stop" if r[-1] == eos else "length" for r in reference]


def test_finished_rows_stop_costing_work():
    model = tiny_model("llama")
    engine = Engine(Transformer(model), eos_token_ids=None)
    batch = engine.new_batch(4, 64, 20)
    engine.add(batch, ["a", "b", "c", "d"], [[1, 2], [3], [4, 5, 6], [7]], [2, 20, 3, 20])
    sizes = []
    while batch.n:
        sizes.append(batch.n)
        engine.step(batch)
    assert sizes[0] == 4 and sizes[2] == 2 and sizes[-1] == 2  # a and c leave after 2 and 3 tokens
    assert sorted(batch.ids) == []


def test_rows_join_a_running_batch():
    """Continuous batching: a row added mid-flight decodes exactly as it would alone."""
    model = tiny_model("qwen2")
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(3, seed=7)
    proposer = MedusaProposer(random_heads(model), load_tree("tree-8"))
    batch = engine.new_batch(3, 128, MAX_NEW)
    done = {}
    for f in engine.add(batch, [0], prompts[:1], MAX_NEW).finished:
        done[f.id] = f.tokens
    for step in range(12):
        if step == 3:
            engine.add(batch, [1, 2], prompts[1:], MAX_NEW)
        for f in engine.step(batch, proposer if step % 2 else None).finished:  # modes may switch per step
            done[f.id] = f.tokens
        for r in range(batch.n):  # the batch's record of committed tokens: prompt + all but the pending root
            n_out = int(batch.out_len[r])
            expect = prompts[batch.ids[r]] + batch.out[r, : n_out - 1].tolist()
            assert batch.seq[r, : int(batch.cache.lens[r])].tolist() == expect
            assert int(batch.root[r]) == int(batch.out[r, n_out - 1])
    while batch.n:
        for f in engine.step(batch, proposer).finished:
            done[f.id] = f.tokens
    assert [done[i] for i in range(3)] == [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_remove_cancels_a_row():
    model = tiny_model("llama")
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(3, seed=8)
    batch = engine.new_batch(3, 128, MAX_NEW)
    engine.add(batch, [0, 1, 2], prompts, MAX_NEW)
    engine.step(batch)
    batch.remove([1])
    assert batch.ids == [0, 2] and batch.n == 2
    done = {}
    while batch.n:
        for f in engine.step(batch).finished:
            done[f.id] = f.tokens
    assert done[0] == hf_greedy(model, prompts[0], MAX_NEW)
    assert done[2] == hf_greedy(model, prompts[2], MAX_NEW)


@pytest.mark.parametrize("pack", [False, True])
def test_linear_and_fused_residual_match_reference(pack):
    from medusa.decoding.target.kernels import Linear, packing_available

    lin = torch.nn.Linear(64, 300, bias=True).to(torch.bfloat16)
    if pack and not packing_available(lin.weight):
        pytest.skip("oneDNN bf16 packing is not available on this CPU")
    fused = Linear(lin, pack=pack)
    tol = dict(atol=3e-2, rtol=3e-2)
    for shape in ((1, 64), (7, 64), (40, 64), (2, 5, 64)):  # [B, T, H] inputs, as the engine passes them
        x = torch.randn(*shape, dtype=torch.bfloat16)
        other = torch.randn(*shape[:-1], 300, dtype=torch.bfloat16)
        ref = lin(x).float()
        assert fused(x).shape == ref.shape
        assert torch.allclose(fused(x).float(), ref, **tol)
        assert torch.allclose(fused.plus(x, other).float(), ref + other.float(), **tol)


def train_tiny_heads(model, num_heads=3, steps=300, seed=0):
    """Heads fitted on the model's own greedy continuations (self-distillation in miniature)."""
    torch.manual_seed(seed)
    tr = Transformer(model)
    prompts = mixed_prompts(24, seed=99)
    gen = Engine(tr, eos_token_ids=None).generate(prompts, 40)
    hidden, labels = [], []
    for p, o in zip(prompts, gen.outputs):
        s = p + o.tokens
        cache = tr.new_cache(1, len(s))
        with torch.inference_mode():
            h = tr(torch.tensor([s]), torch.arange(len(s))[None], cache, slice(0, 1),
                   torch.ones(len(s), len(s), dtype=torch.bool).tril())[0]
        hidden.append(h.clone())
        labels += [[s[t + k + 2] if t + k + 2 < len(s) else -100 for k in range(num_heads)] for t in range(len(s))]
    hidden, labels = torch.cat(hidden), torch.tensor(labels)
    heads = MedusaHeads(HeadsConfig(64, model.config.vocab_size, num_heads, 1)).attach(model)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    for _ in range(steps):
        logits = heads(hidden)
        loss = sum(torch.nn.functional.cross_entropy(logits[k], labels[:, k], ignore_index=-100)
                   for k in range(num_heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.requires_grad_(False), prompts


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", seed=11)
    heads, prompts = train_tiny_heads(model)
    return model, heads, prompts


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_trained_heads_accept_and_match_plain(trained, batch_size):
    model, heads, train_prompts = trained
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = train_prompts[:batch_size]
    plain = engine.generate(prompts, 40)
    spec = engine.generate(prompts, 40, MedusaProposer(heads, Tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])))
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert spec.stats.mean_accepted > 2.0  # trained heads are really accepted, several tokens per step
    assert spec.stats.forward_passes < plain.stats.forward_passes * 0.6


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 17)])
def test_forward_matches_hf_logits(arch, dtype, rows):
    """The lean forward (fused projections, rotary in place, the norm's low-precision kernel) gives the
    HF model's logits, for a prompt pass and for the one-token passes of decoding, with K/V kept in fp32
    (small caches on CPU) or in the model dtype."""
    from medusa.decoding.target.transformer import FP32_ATTENTION_ROWS

    exact = tiny_model(arch, seed=5)
    model = tiny_model(arch, seed=5).to(dtype)
    tr = Transformer(model)
    cache = tr.new_cache(rows, 64)
    assert (cache.data.dtype == torch.float32) == (dtype == torch.float32 or rows <= FP32_ATTENTION_ROWS)
    seq = mixed_prompts(1, seed=7)[0] + mixed_prompts(1, seed=8)[0]
    with torch.inference_mode():
        ref = model(torch.tensor([seq])).logits[0].float()
        split = len(seq) // 2
        causal = torch.ones(split, split, dtype=torch.bool).tril()
        prompt = tr.lm_head(tr(torch.tensor([seq[:split]]), torch.arange(split)[None], cache, slice(0, 1),
                               causal))[0]
        cache.lens[0] = split
        steps = []
        for i in range(split, len(seq)):
            h = tr(torch.tensor([[seq[i]]]), torch.tensor([[i]]), cache, slice(0, 1), causal[:1, :1])
            cache.lens[0] += 1
            steps.append(tr.lm_head(h)[0, 0])
    ours = torch.cat([prompt.float(), torch.stack(steps).float()])
    if dtype == torch.float32:
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        return
    # bf16: how far a bf16 forward lands from the exact (fp32) logits depends on the CPU's bf16 kernels
    # (native AVX-512-BF16, oneDNN's emulation, or the generic path, each rounding differently), so judge
    # ours by the error HF's own bf16 forward makes on the same machine: it must be of the same order. A
    # real defect (rotary skipped on k, the wrong half of the mirrored norm) is many times larger.
    with torch.inference_mode():
        exact_logits = exact(torch.tensor([seq])).logits[0].float()
    ours_err = (ours - exact_logits).abs().max()
    hf_err = (ref - exact_logits).abs().max()
    assert ours_err <= 2 * hf_err + 1e-3 * exact_logits.abs().max()
    agree = (ours.argmax(-1) == exact_logits.argmax(-1)).float().mean()
    hf_agree = (ref.argmax(-1) == exact_logits.argmax(-1)).float().mean()
    assert agree >= min(0.9, hf_agree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from medusa.decoding.target.transformer import RMSNorm

    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    torch.nn.init.normal_(hf.weight, mean=1.0, std=0.5)
    ours = RMSNorm(hf)
    assert ours.mirrored == (dtype == torch.bfloat16)  # the fused low-precision path is the one exercised
    for shape in ((1, 1, 96), (3, 7, 96), (2, 5, 4, 96)):
        x = (torch.randn(*shape) * 4).to(dtype)
        ref, got = hf(x).float(), ours(x).float()
        if dtype == torch.float32:
            assert torch.equal(got, ref)
        else:  # one rounding (ours) vs two (HF's normalise-then-scale): at most one bf16 step apart
            assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()


class RightOrWrong(StaticProposer):
    """Proposes the true greedy continuation for the rows in `right`, a wrong token at every node elsewhere."""

    name = "right-or-wrong"

    def __init__(self, tree: Tree, reference: dict, vocab: int, right: set):
        self.tree, self.reference, self.vocab, self.right = tree, reference, vocab, right

    def fill(self, batch):
        out = torch.zeros(batch.n, self.tree.size - 1, dtype=torch.long)
        for r in range(batch.n):
            ref, pos = self.reference[batch.ids[r]], int(batch.out_len[r])  # ref[pos]: the token after the root
            for i, path in enumerate(self.tree.nodes):
                tok = ref[pos + len(path) - 1]
                out[r, i] = tok if batch.ids[r] in self.right else (tok + 1) % self.vocab
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_gives_the_rotary_embeddings_own_values(dtype):
    """Passes read cos/sin from a table filled once; every lookup must be bit-identical to the rotary
    embedding's own output for those positions, also after the table has grown, and for ragged rows."""
    from medusa.decoding.target.transformer import RotaryTable, rope_tables

    model = tiny_model("llama", seed=1).to(dtype)
    rotary = model.model.rotary_emb
    table = RotaryTable(rotary)
    assert table.tabled
    x = torch.zeros(2, 1, model.config.hidden_size, dtype=dtype)
    for bound, positions in [(16, torch.tensor([[3, 4, 5], [0, 9, 15]])), (40, torch.tensor([[39, 17, 20]])),
                             (300, torch.tensor([[0, 1, 2], [250, 251, 299]]))]:
        got = table(x, positions, bound)
        want = rope_tables(*rotary(x, positions))
        assert got[0].shape == want[0].shape == (positions.shape[0], 3, 1, rotary.inv_freq.shape[0] * 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert table.cos.shape[0] >= 300 and table.cos.dtype == dtype
    rotary.rope_type = "dynamic"  # frequencies that follow the length are not tabled
    assert not RotaryTable(rotary).tabled


def test_one_row_pass_mask_from_slices_is_the_general_mask():
    """A single row's mask built from slices (its length known as a number) equals the general one: a pass
    that is its own block, a feature-head expansion seeing earlier draft entries, a prefix of zero."""
    from medusa.decoding.target.kernels import pass_mask

    gen = torch.Generator().manual_seed(0)
    for start, t, used, window_extra in [(7, 1, 0, 0), (7, 5, 0, 0), (12, 4, 8, 3), (0, 3, 0, 2), (30, 8, 16, 0)]:
        visible = torch.rand(1, t, used + t, generator=gen) > 0.4
        lens = torch.tensor([start])
        window = start + used + t + window_extra
        for vis in (visible, visible[0]):
            want = pass_mask(lens, vis, window)
            assert torch.equal(pass_mask(lens, vis, window, start), want)
    assert want[0, 0, :, :start].all() and not want[0, 0, :, start + used + t:].any()


def test_step_output_reports_accepted_candidates(setup):
    """Row 0 is offered the true continuation (all 3 accepted), row 1 wrong tokens (none accepted)."""
    model, engine = setup
    prompts = mixed_prompts(2)
    reference = {i: o.tokens for i, o in enumerate(engine.generate(prompts, MAX_NEW).outputs)}
    proposer = RightOrWrong(chain(3), reference, model.config.vocab_size, right={0})
    batch = engine.new_batch(2, max(map(len, prompts)) + MAX_NEW + 8, MAX_NEW)
    first = engine.add(batch, [0, 1], prompts, MAX_NEW)
    assert first.accepted.tolist() == first.accepted_list == [0, 0] and first.count_list == [1, 1]
    out = engine.step(batch, proposer)
    assert out.accepted.tolist() == [3, 0] and out.counts.tolist() == [4, 1]
    assert out.accepted_list == [3, 0] and out.count_list == [4, 1]  # the same, read with the step
    assert out.tokens[0].tolist() == reference[0][1:5] and out.tokens[1, 0] == reference[1][1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_releasing_the_source_weights_changes_no_token(arch):
    """A process that only decodes through the engine may free the HF model's copies of the projections:
    the engine's own (fused, packed) weights decode exactly as before."""
    from conftest import mixed_prompts, tiny_model

    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer

    model = tiny_model(arch, seed=5)
    tr = Transformer(model)
    engine = Engine(tr, eos_token_ids=None)
    prompts = mixed_prompts(3, seed=2)
    before = [o.tokens for o in engine.generate(prompts, 12).outputs]
    params = sum(p.numel() for p in model.parameters())
    freed = tr.release_source_weights(model)
    attn = model.model.layers[0].self_attn
    assert freed > 0 and attn.q_proj.weight.numel() == 0 and sum(p.numel() for p in model.parameters()) < params
    assert [o.tokens for o in engine.generate(prompts, 12).outputs] == before
