"""Batch invariance (`medusa.decoding.target.invariant`): with it on, a row's bits never depend on the pass around it,
op by op and end to end.

The guarantee rests on how this machine's kernels round; `invariant.probe` measures that, and where it fails
the flag is refused (checked here on every machine). The checks on this machine's kernels (bf16) run where
the probe passes, and say why where it does not. The attention's own arithmetic (groups of canonical
positions, a tree's regrouped keys) is checked on every machine too, with `InOrder` kernels: matrix products
that sum each result in index order, the order the probe asks of the machine's kernels; end to end in fp32,
where no rounding hides a difference."""

from __future__ import annotations

import pytest
import torch

from conftest import accepted_drafts, mixed_prompts, random_heads, tiny_model
from medusa.decoding.target import invariant
from medusa.decoding.target.kernels import pass_mask
from medusa.decoding.engine import Engine
from medusa.decoding.target.transformer import RMSNorm, Transformer, causal
from medusa.errors import MedusaError

WHY = invariant.probe("cpu", torch.bfloat16)
needs_invariance = pytest.mark.skipif(WHY is not None, reason=f"batch invariance unavailable here: {WHY}")


def projections(dtype: torch.dtype) -> str | None:
    """Why this CPU's projections in `dtype` round a row by the rows beside it, or None where they do not. The
    probe checks them before the attention: a complaint about the attention alone (an AVX2 CPU, whose fp32
    matrix products split a sum by its length) means they keep a row's bits."""
    why = invariant.probe("cpu", dtype)
    return None if why is None or "attention" in why else why


def needs_projections(dtype: torch.dtype):
    why = projections(dtype)
    return pytest.mark.skipif(why is not None, reason=f"batch invariance unavailable here: {why}")


H, KV, D = 9, 3, 64  # the embedded model's attention shape


class InOrder:
    """`torch` as `medusa.decoding.target.invariant` sees it, with `matmul` summing each result as one chain of
    multiply-adds in index order (a product, then a sum, per term): kernels that keep the order the
    attention needs, on any CPU, so the attention's own arithmetic is tested where the machine's kernels
    do not keep it."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        acc = a[..., :, :1] * b[..., :1, :]
        for k in range(1, a.shape[-1]):
            acc = acc + a[..., :, k: k + 1] * b[..., k: k + 1, :]
        return acc


MACHINE = pytest.param("machine", marks=needs_invariance)


@pytest.fixture
def kernels(request, monkeypatch):
    """This machine's kernels, or `InOrder` ones in the batch-invariant attention (on one thread: see
    `conftest.one_thread`)."""
    if request.param == "in-order":
        monkeypatch.setattr(invariant, "torch", InOrder())
        request.getfixturevalue("one_thread")
    return request.param


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] visibility of a tree given each node's parent (-1: the root)."""
    t = len(parents)
    vis = torch.eye(t, dtype=torch.bool)
    for j, p in enumerate(parents):
        while p >= 0:
            vis[j, p] = True
            p = parents[p]
    return vis


def attend(rows: list[tuple[torch.Tensor, torch.Tensor, int]], q: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Invariant attention of q [B, T, H, D] for rows (k [KV, L+T, D], v, L): the block's K/V follow each
    row's L committed entries. -> [B, T, H*D] (fp32: no rounding hides a difference)."""
    lens = torch.tensor([n for _, _, n in rows])
    w = invariant.window(int(lens.max()) + q.shape[1], 1 << 30)
    k = torch.zeros(len(rows), KV, w, D)
    v = torch.zeros(len(rows), KV, w, D)
    for i, (kk, vv, _) in enumerate(rows):
        k[i, :, : kk.shape[1]], v[i, :, : vv.shape[1]] = kk, vv
    plan = invariant.plan(lens, pass_mask(lens, vis, w), vis, H // KV)
    return invariant.attention(q, k, v, plan, D ** -0.5)


@pytest.mark.parametrize("kernels", [MACHINE, "in-order"], indirect=True)
@pytest.mark.parametrize("length", [40, 62, 63, 64, 200])
def test_attention_gives_a_query_the_same_bits_in_every_pass(kernels, length):
    """Row 0's query at position `length` + 2 with keys 0..length + 2: decoded alone, as the last token of a
    chunk among other rows, and as a tree node among siblings (its path stored out of depth order, across
    a group boundary where the length allows), alone and among rows of other lengths."""
    g = torch.Generator().manual_seed(length)
    p = length + 2
    k, v = torch.randn(KV, p + 1, D, generator=g), torch.randn(KV, p + 1, D, generator=g)
    q = torch.randn(1, 1, H, D, generator=g)
    others = [(torch.randn(KV, n + 8, D, generator=g), torch.randn(KV, n + 8, D, generator=g), n) for n in (5, 130, 64)]
    alone = attend([(k, v, p)], q, causal(1, "cpu"))[0, 0]
    # A chunk of 3 (positions p-2..p) in a batch of 4 rows.
    qc = torch.randn(4, 3, H, D, generator=g)
    qc[0, 2] = q[0, 0]
    chunk = attend([(k, v, p - 2)] + others, qc, causal(3, "cpu"))[0, 2]
    # A tree at length p - 2: node 4 (depth 2) has path root(0) -> node 2 -> node 4; nodes 1 and 3 are
    # siblings holding other keys. Its K/V: slot L + index.
    parents = [-1, 0, 0, 1, 2, 4]
    kt, vt = torch.randn(KV, p + 4, D, generator=g), torch.randn(KV, p + 4, D, generator=g)
    base = p - 2
    kt[:, :base], vt[:, :base] = k[:, :base], v[:, :base]
    for node, depth in ((0, 0), (2, 1), (4, 2)):
        kt[:, base + node], vt[:, base + node] = k[:, base + depth], v[:, base + depth]
    qt = torch.randn(4, 6, H, D, generator=g)
    qt[:, 4] = q[0, 0]
    vis = tree_mask(parents)
    tree_alone = attend([(kt, vt, base)], qt[:1], vis)[0, 4]
    tree_batch = attend([(kt, vt, base)] + others, qt, vis)[0, 4]
    for name, got in (("chunk", chunk), ("tree alone", tree_alone), ("tree in a batch", tree_batch)):
        assert torch.equal(got, alone), f"{name}: max difference {(got - alone).abs().max():.3g}"


@needs_projections(torch.bfloat16)
def test_projections_norms_and_logits_give_a_row_the_same_bits_among_others():
    """The bf16 layers around attention: a row alone and among 2..64 rows of others."""
    model = tiny_model(seed=2).to(torch.bfloat16)
    tr = Transformer(model)
    layer = tr.layers[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, model.config.hidden_size, generator=g).bfloat16()
    ops = {"qkv": layer.wqkv.forward, "o_proj + residual": lambda a: layer.wo.plus(a[..., : layer.nq * layer.head_dim], a),
           "mlp": layer.mlp, "rmsnorm": tr.norm.forward, "lm_head": tr.lm_head.forward,
           "norm (stock)": RMSNorm(model.model.norm).forward}
    for name, op in ops.items():
        alone = op(x[:, :1])
        for rows in (2, 3, 7, 16, 33, 64):
            assert torch.equal(op(x[:, :rows])[:, :1], alone), f"{name} with {rows} rows"


@needs_invariance
def test_a_long_reduction_gives_a_row_the_same_bits_in_a_pass_of_hundreds_of_rows():
    """A projection of 1,536 inputs (the embedded model's MLP down-projection) in passes the size of a batched
    prefill: with the model invariant each row gets its bits alone; the kernels alone would split the
    reduction differently above ~130 rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                         num_attention_heads=9, num_key_value_heads=3)).eval().bfloat16()
    tr = Transformer(model)
    tr.invariant = True
    w2 = tr.layers[0].w2
    assert w2.row_block == invariant.ROW_BLOCK
    x = torch.randn(1, 420, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    res = torch.randn(1, 420, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.cat([w2.forward(x[:, i: i + 1]) for i in range(420)], dim=1)
    alone_plus = torch.cat([w2.plus(x[:, i: i + 1], res[:, i: i + 1]) for i in range(420)], dim=1)
    for rows in range(120, 421, 3):
        assert torch.equal(w2.forward(x[:, :rows]), alone[:, :rows]), f"{rows} rows"
        assert torch.equal(w2.plus(x[:, :rows], res[:, :rows]), alone_plus[:, :rows]), f"{rows} rows, residual"
    tr.invariant = False
    assert w2.row_block is None


def decode(engine: Engine, prompts: list[list[int]], limits: list[int], proposer, late: int = 0):
    """Each prompt's greedy tokens, each with its log-probability (the bits of the logits that decided it),
    decoded together, each to its own limit (rows leave as they finish); the last `late` prompts join the
    running batch after three steps. Returns them and the run's stats."""
    from medusa.decoding.target.transformer import cache_capacity

    capacity = cache_capacity(max(len(p) for p in prompts), max(limits), proposer.tree.size if proposer else 1)
    batch = engine.new_batch(len(prompts), capacity, max(limits))
    if proposer is not None:
        proposer.attach(batch)
    got: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(prompts))}

    def take(out) -> None:
        for r, rid in enumerate(out.ids):
            got[rid] += [(int(out.tokens[r, j]), float(out.logprobs.token[r, j])) for j in range(out.count_list[r])]

    def add(ids: list[int]) -> None:
        take(engine.add(batch, ids, [prompts[i] for i in ids], [limits[i] for i in ids], logprobs=[0] * len(ids)))

    first = len(prompts) - late
    add(list(range(first)))
    for step in range(10_000):
        if step == 3 and late:
            add(list(range(first, len(prompts))))
        if not batch.n:
            return [got[i] for i in range(len(prompts))], batch.stats
        take(engine.step(batch, proposer))
    raise AssertionError("decoding did not finish")


def every_proposer(engine: Engine, model, seed: int = 5) -> dict:
    """Plain decoding and every kind of draft: a static Medusa tree, a dynamic tree, lookup, a draft model,
    retrieval, and trees merged with retrieval (the default: a feature head's, a Medusa head's)."""
    from medusa.decoding.proposers.draft import DraftModel, DraftProposer
    from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer, TreeShape
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
    from medusa.decoding.proposers.feature_proposer import FeatureProposer
    from medusa.decoding.proposers.lookup import LookupProposer
    from medusa.decoding.proposers import MedusaProposer
    from medusa.decoding.proposers.retrieval import MergedProposer, Retriever, RetrievalProposer

    heads = random_heads(model, num_heads=3, seed=seed)
    torch.manual_seed(seed)
    c = model.config
    head = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)
    draft = DraftModel.of(Transformer(tiny_model(seed=9, vocab=c.vocab_size).to(model.dtype)))
    return {"plain": None, "medusa tree": MedusaProposer(heads, "tree-8"),
            "dynamic tree": MedusaDynamicProposer(heads, 8, 3, 3), "lookup": LookupProposer(k=4),
            "draft": DraftProposer(draft, 3), "retrieval": RetrievalProposer(8, Retriever(3, 4)),
            "feature+retrieval": MergedProposer(FeatureProposer(head, engine.model, TreeShape(8, 3, 3)), Retriever(3, 4)),
            "medusa dynamic+retrieval": MergedProposer(MedusaDynamicProposer(heads, 8, 3, 3), Retriever(3, 4))}


@pytest.mark.parametrize("kernels", [MACHINE, pytest.param("in-order", marks=needs_projections(torch.float32))],
                         indirect=True)
def test_greedy_speculation_equals_plain_decoding_alone_and_batched(kernels):
    """Tiny random model, bf16 on this machine's kernels, fp32 on in-order ones (where nothing rounds a
    difference away): each prompt's plain tokens alone, and the bits of their log-probabilities, equal its
    tokens among others (rows of other lengths leaving early, one joining late) under every proposer, drafts
    from the text and merged trees included; and every proposer's drafts were accepted."""
    vocab = 13  # small: the text repeats itself, so lookup and retrieval find drafts
    model = tiny_model(seed=5, vocab=vocab).to(torch.bfloat16 if kernels == "machine" else torch.float32)
    tr = Transformer(model)
    tr.invariant = True
    engine = Engine(tr, eos_token_ids=None)
    # Prompts of 44-61 tokens: rows cross a group of GROUP = 64 canonical positions while they speculate.
    prompts = [(p * 64)[:n] for p, n in zip(mixed_prompts(5, vocab=vocab, seed=11), (50, 58, 44, 61, 55))]
    limits = [24, 9, 23, 24, 12]
    alone = [decode(engine, [p], [n], None)[0][0] for p, n in zip(prompts, limits)]
    for name, proposer in every_proposer(engine, model).items():
        drafted = 0
        for order, late in (([0, 1, 2, 3, 4], 1), ([4, 2, 1], 1)):  # rows leave early, one joins late
            got, stats = decode(engine, [prompts[i] for i in order], [limits[i] for i in order], proposer, late)
            assert got == [alone[i] for i in order], f"{name}, rows {order}"
            drafted += accepted_drafts(stats)
        assert proposer is None or drafted > 0, name  # its drafts took part


def test_the_flag_is_refused_where_the_kernels_do_not_keep_their_order(monkeypatch):
    """A machine whose kernels fail the probe gets a one-line error naming the flag, not a weaker promise."""
    from medusa.runtime import Runtime

    monkeypatch.setattr(invariant, "probe", lambda device, dtype: "this CPU's kernels round by shape")
    with pytest.raises(MedusaError, match=r"^--batch-invariant on: this CPU's kernels round by shape"):
        Runtime.load("default", "none", "fp32", "cpu", batch_invariant=True)


@needs_projections(torch.float32)  # the probe checks the projections first
def test_the_probe_notices_a_broken_order(monkeypatch):
    """The probe compares bits: with kernels that keep the order it passes the attention, and without the
    regrouping of a tree's nodes it reports the difference (whatever this machine's kernels do)."""
    monkeypatch.setattr(invariant, "torch", InOrder())
    invariant.probe.cache_clear()
    try:
        assert "attention" not in (invariant.probe("cpu", torch.float32) or "")
        monkeypatch.setattr(invariant, "tail_sums", lambda *a: None)
        invariant.probe.cache_clear()
        assert "attention" in (invariant.probe("cpu", torch.float32) or "")
    finally:
        invariant.probe.cache_clear()


class NarrowRoundsOtherwise(InOrder):
    """In-order kernels, except that a product with fewer than 12 columns rounds otherwise (by a last-bit-sized
    step), as AMD Zen 4's narrow fp32 kernels do."""

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = InOrder.matmul(a, b)
        return out * (1 + 2 ** -20) if b.shape[-1] < 12 else out


@needs_projections(torch.float32)  # the probe checks the projections first
def test_the_attention_pads_narrow_products_to_the_kernels_that_keep_the_order(monkeypatch):
    """A decode step's query is a few columns (heads per KV group x tokens), a tree's many: with kernels that
    round narrow products otherwise, the attention still gives a query the same bits alone, in a batch and as
    a tree node (the probe's comparison), because it never runs a narrow product."""
    monkeypatch.setattr(invariant, "torch", NarrowRoundsOtherwise())
    invariant.probe.cache_clear()
    try:
        assert invariant.probe("cpu", torch.float32) is None
    finally:
        invariant.probe.cache_clear()


def test_a_lone_row_runs_as_two_rows_under_invariance(monkeypatch):
    """Some CPUs (AMD Zen 4) give a one-row product a matrix-vector kernel that rounds a long reduction unlike
    the same row's among others: with a row block set (invariance on) a lone row never reaches it."""
    import torch.nn.functional as F

    from medusa.decoding.target.kernels import Linear

    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: real(x, w, b) * (1 + 2 ** -10 * (x.numel() == x.shape[-1])))
    proj = Linear(torch.nn.Linear(16, 8), pack=False)
    x, other = torch.randn(5, 1, 16), torch.randn(5, 1, 8)
    together, together_plus = proj(x.view(1, 5, 16)).view(5, 1, 8), proj.plus(x.view(1, 5, 16), other.view(1, 5, 8))
    assert not torch.equal(torch.cat([proj(r[None]) for r in x]), together)  # the emulated kernel bites
    proj.row_block = invariant.ROW_BLOCK
    assert torch.equal(torch.cat([proj(r[None]) for r in x]), together)
    assert torch.equal(torch.cat([proj.plus(r[None], o[None]) for r, o in zip(x, other)]), together_plus.view(5, 1, 8))


@pytest.fixture(scope="module")
def bf16_rt():
    from medusa.runtime import Runtime

    if WHY is not None:
        pytest.skip(f"batch invariance unavailable here: {WHY}")
    return Runtime.load("default", "default", "bf16", "cpu", batch_invariant=True)


def test_the_embedded_model_in_bf16_decodes_every_way_to_the_same_tokens(bf16_rt):
    """The shipped model and heads in bf16 (where batch shape changed tokens within a few dozen): plain alone,
    plain batched, the feature heads' dynamic tree and the Medusa heads' tree, batched, all agree."""
    rt = bf16_rt
    prompts = rt.encode(["Write a short story about a lighthouse keeper.", "Explain how vaccines work.",
                         "Give me three tips for learning a new language, with examples."])
    alone = [rt.engine.generate([p], 40).outputs[0].tokens for p in prompts]
    for spec, tree in (("plain", None), ("heads", "dynamic-16x5"), ("heads", "tree-16")):
        if spec == "heads" and tree == "tree-16" and rt.heads is None:
            continue
        gen = rt.engine.generate(prompts, 40, rt.proposer(spec, tree))
        assert [o.tokens for o in gen.outputs] == alone, f"{spec} {tree or ''}"
        assert spec == "plain" or accepted_drafts(gen.stats) > 0, f"{spec} {tree}"  # drafts took part


def test_served_greedy_streams_do_not_depend_on_other_traffic(bf16_rt):
    """bf16 server under the dynamic policy: 16 concurrent greedy streams each equal their prompt decoded
    alone (plain or speculative steps, as load decides)."""
    import asyncio

    import openai

    from test_serve import serve

    rt = bf16_rt
    jobs = [(f"Tell me about topic {i}: " + ["the sea", "mountains", "bread", "music"][i % 4], 8 + (i * 5) % 17)
            for i in range(16)]
    want = [rt.decode(rt.engine.generate(rt.encode([p], raw=True), n).outputs[0].tokens) for p, n in jobs]

    async def main(url: str):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(c.completions.create(model="default", prompt=p, max_tokens=n)
                                          for p, n in jobs))

    policy = {"mode": "dynamic", "calibrate": False, "high_watermark": 12, "low_watermark": 6,
              "trees": {1: "dynamic-8x3", 4: "dynamic-4x2"}}
    with serve(rt, policy=policy, max_queue=64, max_context=256) as url:
        got = asyncio.run(main(url))
    assert [r.choices[0].text for r in got] == want


def test_a_seeded_request_writes_the_same_alone_or_as_choice_0_of_3_beside_other_traffic(bf16_rt):
    """bf16 server under the dynamic policy: a sampled request with a seed, sent alone with n=1 (one row: a
    speculative tree), equals choice 0 of the same request with n=3 sent beside four greedy ones (eight
    rows: another tree, or none)."""
    import asyncio

    import openai

    from test_serve import serve

    kw = dict(model="default", messages=[{"role": "user", "content": "Write a haiku about autumn rain."}],
              max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)

    async def main(url: str):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            alone = await c.chat.completions.create(n=1, **kw)
            busy = await asyncio.gather(c.chat.completions.create(n=3, **kw), *(
                c.completions.create(model="default", prompt=f"Count to {i}:", max_tokens=20) for i in range(4)))
            return alone, busy[0]

    policy = {"mode": "dynamic", "calibrate": False, "high_watermark": 12, "low_watermark": 6,
              "trees": {1: "dynamic-8x3", 4: "dynamic-4x2"}}
    with serve(bf16_rt, policy=policy, max_queue=64, max_context=256) as url:
        alone, three = asyncio.run(main(url))
    texts = [ch.message.content for ch in sorted(three.choices, key=lambda ch: ch.index)]
    assert alone.choices[0].message.content == texts[0] and len(set(texts)) == 3
