"""Losslessness, the top test of eyas (style.md rule 6).

Greedy speculative decoding must emit exactly the tokens plain greedy decoding
emits, token for token, on tiny random fp32 models on the CPU, whatever the
drafter proposes. The plain reference is itself checked against a naive
transformers argmax loop that recomputes the whole sequence every token.

Random tiny models write repetitive text, so n-gram drafts get real
acceptances; random EAGLE heads accept almost nothing. The commit path with many
accepted tokens is exercised by a draft LM that *is* the target (every draft is
accepted) and by an oracle drafter whose deep tree hides the true continuation
on a branch that is not the first in node order.

The ``slow`` tests repeat the check on the embedded default model (SmolLM2-135M,
fp32) with real chat prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.base import Drafter
from eyas.drafters.draft_lm import DraftLMDrafter
from eyas.drafters.eagle import EagleDrafter, random_head
from eyas.drafters.eagle3 import Eagle3Drafter, random_eagle3_head
from eyas.drafters.hybrid import HybridConfig, HybridDrafter
from eyas.drafters.ngram import NgramConfig, NgramDrafter
from eyas.tree import make_tree
from eyas.types import DraftOutput, SamplingParams

KINDS = ("llama", "llama3_rope", "qwen2", "qwen3")  # llama: GQA; llama3_rope: rope scaling
PROMPT_LENS = (1, 7, 30)
N = 32  # max_new_tokens of the tiny-model cases
VOCAB = 256  # the tiny models' vocabulary (tests/conftest.py)

EAGLE_TREES = (
    "dynamic:4,4,12",
    "static:eagle_small",
    "static:mc_sim_7b_63",
    "chain:4",
    "static:[[0],[1],[0,0],[0,1],[1,0]]",
)


# ---- helpers ------------------------------------------------------------------------------------
def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    """[n] long random prompt (seeded)."""
    g = torch.Generator().manual_seed(1000 + 17 * n + seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


def run(target, drafter, prompt: torch.Tensor, n: int = N, **cfg):
    """Generate; returns (all new token ids, the StepEvents, the decoder)."""
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n, **cfg))
    events = list(dec.generate(prompt))
    tokens = [t for ev in events for t in ev.tokens.tolist()]
    return tokens, events, dec


def plain(target, prompt: torch.Tensor, n: int = N, **cfg) -> list[int]:
    return run(target, None, prompt, n, **cfg)[0]


@torch.no_grad()
def hf_greedy(hf_model, prompt: torch.Tensor, n: int) -> list[int]:
    """Naive reference: recompute the full sequence with transformers, no cache, argmax."""
    ids = prompt[None].clone()
    out = []
    for _ in range(n):
        logits = hf_model(input_ids=ids, use_cache=False).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


def make_drafter(name: str, target, kind: str, tiny) -> Drafter:
    """The drafters every tiny model kind is checked with."""
    if name == "ngram_b1":
        return NgramDrafter(NgramConfig(num_draft=4, branches=1))
    if name == "ngram_b3":
        return NgramDrafter(NgramConfig(num_draft=4, branches=3))
    if name == "draft_lm":  # a different random model with the same vocabulary
        return DraftLMDrafter(model=tiny.native(kind, seed=5), num_draft=3)
    if name == "draft_lm_other_kind":  # another architecture (Qwen2 biases) drafting for any kind
        return DraftLMDrafter(model=tiny.native("qwen2", seed=6), num_draft=3)
    if name == "draft_lm_self":  # the target's own weights in a separate instance
        return DraftLMDrafter(model=tiny.native(kind, seed=0), num_draft=3)
    if name.startswith("eagle|"):
        return EagleDrafter(target_model=target, head=random_head(target.config, seed=3), tree=name[6:])
    if name.startswith("eagle3|"):  # reduced draft vocabulary: half the target's ids
        head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
        return Eagle3Drafter(target_model=target, head=head, tree=name[7:])
    if name.startswith("eagle3_2l|"):  # two decoder layers (eyas train --head-layers), the second random too
        head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3, num_layers=2)
        return Eagle3Drafter(target_model=target, head=head, tree=name.split("|")[1])
    if name.startswith("eagle3_sharp|"):  # a confident random head: adaptive trees vary in depth and size
        return Eagle3Drafter(target_model=target, head=sharp_eagle3_head(target), tree=name.split("|")[1])
    if name.startswith("hybrid|"):  # lookup chains grafted into a random EAGLE-3 head's tree, 8 nodes
        head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
        return HybridDrafter(head_drafter=Eagle3Drafter(target_model=target, head=head, tree=name[7:]),
                             cfg=HybridConfig(budget=8, num_draft=5))
    if name.startswith("hybrid_sharp|"):
        return HybridDrafter(head_drafter=Eagle3Drafter(target_model=target, head=sharp_eagle3_head(target),
                                                        tree=name.split("|")[1]), cfg=HybridConfig(num_draft=5))
    raise KeyError(name)


def sharp_eagle3_head(target):
    """A random EAGLE-3 head with its logits scaled 10x: path probabilities from ~0.01 to ~1, so an adaptive tree
    (eyas.tree.budget) feeds 1 to 4 levels and keeps 2 to 6 nodes on the tiny models (test_adaptive_trees_vary)."""
    head = random_eagle3_head(target.config, draft_vocab_size=VOCAB // 2, seed=3)
    with torch.no_grad():
        head.lm_head.weight *= 10
    return head


ADAPTIVE = "adaptive:2,4,0.3,0.05/0.05/0.2/0.3/0.5/0.7"  # top-k 2, depth <= 4, at most 6 drafts
DRAFTERS = ("ngram_b1", "ngram_b3", "draft_lm", "draft_lm_other_kind", "draft_lm_self") + tuple(
    f"eagle|{t}" for t in EAGLE_TREES
) + tuple(f"eagle3|{t}" for t in EAGLE_TREES[:3]) + ("hybrid|dynamic:4,4,12", f"eagle3_sharp|{ADAPTIVE}",
                                                     f"hybrid_sharp|{ADAPTIVE}", "eagle3_2l|dynamic:4,4,12")


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def target(tiny, kind):
    return tiny.native(kind, seed=0)


# ---- the reference itself ----------------------------------------------------------------------
@pytest.mark.parametrize("plen", (1, 30))
def test_plain_decoder_matches_naive_transformers_loop(tiny, kind, plen):
    """SpecDecoder with no drafter == argmax loop over the full sequence in transformers."""
    hf, native = tiny.pair(kind, seed=0)
    p = prompt_ids(plen)
    assert plain(native, p, 24) == hf_greedy(hf, p, 24)


def test_plain_decoder_prefill_chunking_is_invisible(target):
    p = prompt_ids(100)
    assert plain(target, p, prefill_chunk=32) == plain(target, p)


# ---- greedy losslessness -----------------------------------------------------------------------
@pytest.mark.parametrize("plen", PROMPT_LENS)
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_speculative_equals_plain(tiny, kind, target, drafter_name, plen):
    p = prompt_ids(plen)
    ref = plain(target, p)
    drafter = make_drafter(drafter_name, target, kind, tiny)
    out, events, dec = run(target, drafter, p)
    assert out == ref
    assert len(out) == N and events[-1].finished
    # every step emits its accepted drafts plus exactly one target token (bar the final truncation)
    assert all(ev.tokens.shape[0] == ev.num_accepted + 1 for ev in events[1:-1])
    assert dec.stats.steps == len(events) - 1
    if drafter_name == "draft_lm_self":
        # the draft model is the target: (nearly) every draft is accepted, many tokens per commit
        assert dec.stats.accepted >= 0.8 * 3 * dec.stats.steps
        assert dec.stats.steps <= N // 3


@pytest.mark.parametrize("name", ("eagle3_sharp", "hybrid_sharp"))
def test_adaptive_trees_vary_and_stay_lossless(tiny, kind, target, name):
    """The adaptive tree really changes depth and size from step to step here, so the greedy identity above covers
    trees of every shape it makes (and the hybrid's merge sized by the same budget)."""
    drafter = make_drafter(f"{name}|{ADAPTIVE}", target, kind, tiny)
    shapes = []
    propose = drafter.propose

    def spy(*args, **kw):
        out = propose(*args, **kw)
        shapes.append((out.tree.tokens.shape[0], int(out.tree.depth.max())))
        return out

    drafter.propose = spy
    p = prompt_ids(30, seed=2)
    assert run(target, drafter, p)[0] == plain(target, p)
    sizes, depths = {n for n, _ in shapes}, {d for _, d in shapes}
    assert len(sizes) >= 2 and max(sizes) <= 7 and len(depths) >= 2 and max(depths) <= 4 + (name == "hybrid_sharp")


def test_draft_lm_with_smaller_vocab_survives_out_of_range_target_tokens(tiny):
    """A draft model may have a smaller (unpadded) vocabulary than the target; target tokens it
    does not know must not crash drafting, and the output stays lossless."""
    target = tiny.native("llama", seed=0)
    p = prompt_ids(30)
    ref = plain(target, p)
    assert any(t >= 200 for t in p.tolist() + ref)
    drafter = DraftLMDrafter(model=tiny.native("llama", seed=6, vocab_size=200), num_draft=3)
    assert run(target, drafter, p)[0] == ref


def test_ngram_actually_accepts_on_tiny_models(tiny):
    """Guard against a vacuous test: n-gram drafts are accepted on repetitive random-model text."""
    for kind in KINDS:
        target = tiny.native(kind, seed=0)
        drafter = make_drafter("ngram_b3", target, kind, tiny)
        accepted = sum(run(target, drafter, prompt_ids(n))[2].stats.accepted for n in PROMPT_LENS)
        assert accepted > 0, kind


def test_drafter_reused_across_generations(target, tiny, kind):
    """start() resets per-sequence state: one drafter instance serves several prompts."""
    names = ("ngram_b3", "draft_lm_self", "eagle|dynamic:4,4,12")
    drafters = [make_drafter(n, target, kind, tiny) for n in names]
    for plen in (30, 7, 1):
        p = prompt_ids(plen, seed=9)
        ref = plain(target, p)
        for d in drafters:
            assert run(target, d, p)[0] == ref


# ---- an oracle tree: the true path is deep and not on the first branch ---------------------------
class OracleTreeDrafter(Drafter):
    """Proposes a tree holding the true continuation on one branch and junk elsewhere.

    Tree per step (J = junk, T_i = i-th true token), in node order::

        root -> J -> J -> J -> J          (a deep junk branch first)
             -> J
             -> T1 -> J
                   -> T2 -> J -> J
                         -> J
                         -> T3 -> T4
                               -> J
    """

    def __init__(self, continuation: list[int], prompt_len: int, depth: int = 4) -> None:
        self.cont, self.prompt_len, self.depth = continuation, prompt_len, depth
        self.max_nodes = 32

    def propose(self, history, sampling, generator=None) -> DraftOutput:
        g = history.shape[0] - self.prompt_len  # tokens generated so far; history[-1] = cont[g - 1]
        true = self.cont[g : g + self.depth]
        assert len(true) == self.depth, "oracle continuation too short"
        tokens, parents = [int(history[-1])], [-1]

        def add(tok: int, parent: int) -> int:
            tokens.append(tok % VOCAB)
            parents.append(parent)
            return len(tokens) - 1

        def junk(d: int, k: int = 1) -> int:  # a token that is not the true one at depth d
            return true[d - 1] + k

        node = 0
        for _ in range(self.depth):  # deep junk chain under the root, first in node order
            node = add(junk(1) if node == 0 else 7 * node + 3, node)
        add(junk(1, 2), 0)
        t1 = add(true[0], 0)
        add(junk(2), t1)
        t2 = add(true[1], t1)
        j = add(junk(3), t2)
        add(junk(4), j)
        add(junk(3, 2), t2)
        t3 = add(true[2], t2)
        add(true[3], t3)
        add(junk(4, 2), t3)
        assert len(tokens) <= self.max_nodes
        return DraftOutput(tree=make_tree(torch.tensor(tokens), torch.tensor(parents)))


@pytest.mark.parametrize("plen", PROMPT_LENS)
def test_oracle_tree_accepts_full_depth_every_step(target, plen):
    depth = 4
    p = prompt_ids(plen, seed=2)
    long_ref = plain(target, p, N + depth + 2)
    drafter = OracleTreeDrafter(long_ref, plen, depth)
    out, events, dec = run(target, drafter, p)
    assert out == long_ref[:N]
    st = dec.stats
    assert st.steps > 0 and st.accepted == depth * st.steps
    assert st.accepted_per_pos == [st.steps] * depth
    assert all(ev.num_accepted == depth for ev in events[1:-1])


@pytest.mark.parametrize("exact", (False, True))
def test_oracle_tree_stop_inside_accepted_block(target, exact):
    """A stop token in the middle of an accepted path ends the output right after it."""
    depth = 4
    # token 0 comes from prefill, then every step emits depth + 1 tokens: stop strictly inside a block
    p, long_ref, stop_at = stop_case(target, 7, N + depth + 2, ok=lambda i: i < N and i % (depth + 1) != 0)
    stop = long_ref[stop_at]
    expected = long_ref[: stop_at + 1]
    assert plain(target, p, stop_ids=(stop,)) == expected
    out, events, _ = run(target, OracleTreeDrafter(long_ref, 7, depth), p, stop_ids=(stop,), exact=exact)
    assert out == expected and events[-1].finished
    assert events[-1].num_accepted == events[-1].tokens.shape[0] and 0 < events[-1].num_accepted <= depth


# ---- stop ids --------------------------------------------------------------------------------------
def stop_case(target, plen: int, n: int, ok=lambda i: True):
    """(prompt, plain output, i): a seeded prompt whose output has a token first seen at index i,
    mid-generation (so stopping on it cuts the output short) and ``ok(i)``."""
    for seed in range(50):
        p = prompt_ids(plen, seed=100 + seed)
        ref = plain(target, p, n)
        for i in range(3, n - 3):
            if ref[i] not in ref[:i] and ok(i):
                return p, ref, i
    raise AssertionError("no prompt gives a token first seen mid-generation")


@pytest.mark.parametrize("drafter_name", ("ngram_b1", "ngram_b3", "draft_lm_self", "eagle|dynamic:4,4,12",
                                          "eagle3|dynamic:4,4,12"))
@pytest.mark.parametrize("plen", (1, 30))
def test_stop_id_mid_generation(tiny, kind, target, drafter_name, plen):
    p, ref, i = stop_case(target, plen, 40)
    stop_ids = (ref[i], VOCAB + 5)  # a second id that never occurs
    ref_stop, ref_events, _ = run(target, None, p, 40, stop_ids=stop_ids)
    assert ref_stop == ref[: i + 1] and ref_events[-1].finished
    out, events, _ = run(target, make_drafter(drafter_name, target, kind, tiny), p, 40, stop_ids=stop_ids)
    assert out == ref_stop
    assert events[-1].finished and all(not ev.finished for ev in events[:-1])


def test_stop_id_as_first_token(target):
    p = prompt_ids(7)
    first = plain(target, p, 4)[0]
    for drafter in (None, NgramDrafter(NgramConfig(num_draft=4))):
        assert run(target, drafter, p, 16, stop_ids=(first,))[0] == [first]


@pytest.mark.parametrize("n", (1, 2, 5))
def test_tiny_token_budgets(target, n):
    """max_new_tokens smaller than a single step's accepted block truncates identically."""
    p = prompt_ids(7, seed=3)
    ref = plain(target, p, n)
    assert len(ref) == n
    long_ref = plain(target, p, n + 8)
    for drafter in (NgramDrafter(NgramConfig(num_draft=4, branches=3)), OracleTreeDrafter(long_ref, 7)):
        assert run(target, drafter, p, n)[0] == ref


# ---- exact (batch-invariant) mode -----------------------------------------------------------------
@pytest.mark.parametrize("drafter_name",
                         (None, "ngram_b1", "ngram_b3", "eagle|dynamic:4,4,12", "eagle3|static:eagle_small",
                          "draft_lm_self", "hybrid|dynamic:4,4,12", f"eagle3_sharp|{ADAPTIVE}",
                          "eagle3_2l|dynamic:4,4,12"))
@pytest.mark.parametrize("plen", (1, 30))
def test_exact_mode_equals_plain(tiny, kind, target, drafter_name, plen):
    p = prompt_ids(plen, seed=5)
    ref = plain(target, p)
    drafter = None if drafter_name is None else make_drafter(drafter_name, target, kind, tiny)
    assert run(target, drafter, p, exact=True)[0] == ref


# ---- sampling: seeded determinism ------------------------------------------------------------------
@pytest.mark.parametrize("drafter_name", (None, "ngram_b1", "ngram_b3", "draft_lm", "eagle|dynamic:4,4,12",
                                          "eagle|static:eagle_small", "eagle3|dynamic:4,4,12",
                                          "hybrid|dynamic:4,4,12", f"hybrid_sharp|{ADAPTIVE}"))
def test_sampling_is_deterministic_per_seed(tiny, kind, target, drafter_name):
    p = prompt_ids(7, seed=6)
    sp = SamplingParams(temperature=0.8, top_p=0.9)

    def sample_run(seed: int) -> list[int]:
        d = None if drafter_name is None else make_drafter(drafter_name, target, kind, tiny)
        out = run(target, d, p, N, sampling=sp, seed=seed)[0]
        assert len(out) == N and all(0 <= t < VOCAB for t in out)
        return out

    a = sample_run(123)
    assert sample_run(123) == a
    others = [sample_run(s) for s in (7, 8, 9)]
    assert any(o != a for o in others), "different seeds gave the same sample every time"


def test_sampling_top_k_one_is_greedy(target):
    """top_k = 1 leaves one token: sampling (with any drafter) must reproduce greedy output."""
    p = prompt_ids(7)
    ref = plain(target, p)
    sp = SamplingParams(temperature=0.8, top_k=1)
    for d in (None, NgramDrafter(NgramConfig(num_draft=4, branches=3))):
        assert run(target, d, p, sampling=sp, seed=0)[0] == ref


# ---- the embedded default model (realism) ----------------------------------------------------------
_FALLBACK_PROMPTS = (
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report'.",
    "Write a short Python function that returns the n-th Fibonacci number, and explain it.",
)


def _mt_bench_prompts(k: int = 3) -> list[str]:
    repo = Path(__file__).resolve().parents[1]
    for base in (repo / "shared", repo.parent / "shared"):
        f = base / "data" / "mt_bench" / "question.jsonl"
        if f.exists():
            lines = f.read_text().splitlines()[:k]
            return [json.loads(line)["turns"][0] for line in lines]
    return list(_FALLBACK_PROMPTS[:k])


REAL_PROMPTS = _mt_bench_prompts()
REAL_NEW = 64


def _save_random_eagle_head(d: Path, target_model, seed: int = 0) -> Path:
    """A random head in the EAGLE-1 reference layout (config.json + pytorch_model.bin)."""
    c = target_model.config
    head = random_head(c, seed=seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings, "bias": True,
    }))
    torch.save(head.state_dict(), d / "pytorch_model.bin")
    return d


@pytest.fixture(scope="module")
def real(default_target, tmp_path_factory):
    """(Speculator factory, plain reference ids per prompt) on the embedded default model."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    head_dir = _save_random_eagle_head(tmp_path_factory.mktemp("eagle_head"), default_target.model)

    def speculator(name: str, tree: str | None = None) -> Speculator:
        spec_name = str(head_dir) if name == "eagle" else name
        return Speculator(default_target, DrafterSpec(spec_name, tree=tree))

    plain_spec = speculator("none")
    refs = {q: plain_spec.generate(q, max_new_tokens=REAL_NEW, speculate=False).token_ids
            for q in REAL_PROMPTS}
    return speculator, refs


@pytest.mark.slow
def test_embedded_default_through_eyas_load_is_lossless(real):
    """The public entry point: eyas.load(...).generate with and without speculation."""
    import eyas

    _, refs = real
    spec = eyas.load(drafter="ngram", dtype="float32")
    q = REAL_PROMPTS[0]
    out = spec.generate(q, max_new_tokens=REAL_NEW)  # refs: plain decoding (speculate=False)
    assert out.token_ids == refs[q]
    assert out.new_tokens == len(refs[q]) and out.text


@pytest.mark.slow
def test_load_warms_up_with_a_short_greedy_generation_and_keeps_none_of_it(real, monkeypatch):
    """eyas.load ends with one 2-token greedy generation (first-use work at load); the prefix cache made after it
    holds nothing, and the first real generation is still plain decoding's tokens. warmup=False skips it."""
    import eyas
    from eyas.api import Speculator

    _, refs = real
    calls = []
    real_generate = Speculator.generate

    def generate(self, *args, **kw):
        calls.append((args, kw))
        return real_generate(self, *args, **kw)

    monkeypatch.setattr(Speculator, "generate", generate)
    spec = eyas.load(drafter="ngram", dtype="float32", prefix_cache_mb=16)
    assert calls == [(("Hello",), {"max_new_tokens": 2})]
    assert len(spec.prefix_cache) == 0
    q = REAL_PROMPTS[0]
    assert spec.generate(q, max_new_tokens=REAL_NEW).token_ids == refs[q]
    calls.clear()
    eyas.load(drafter="ngram", dtype="float32", warmup=False)
    assert calls == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tree"),
    [("ngram", None), ("eagle", "dynamic:3,3,6"), ("eagle", "static:[[0],[1],[0,0],[0,1],[1,0]]")],
    ids=["ngram", "eagle-dynamic", "eagle-static"],
)
def test_embedded_default_speculative_equals_plain(real, name, tree):
    speculator, refs = real
    spec = speculator(name, tree)
    for q in REAL_PROMPTS:
        out = spec.generate(q, max_new_tokens=REAL_NEW)
        assert out.token_ids == refs[q], q
        assert len(out.token_ids) <= REAL_NEW
        assert out.steps + 1 >= len(out.token_ids) - out.accepted


# ---- exact mode in bfloat16: what it exists for -----------------------------------------------------
@pytest.mark.parametrize("drafter_name", ("ngram_b3", "eagle|dynamic:4,4,12", "eagle|static:eagle_small",
                                          "eagle3|dynamic:4,4,12", "hybrid|dynamic:4,4,12", "draft_lm_self",
                                          "eagle3_2l|dynamic:4,4,12"))
@pytest.mark.parametrize("plen", (7, 30))
def test_exact_mode_bf16_speculative_equals_exact_plain(tiny, kind, drafter_name, plen):
    """In bf16 a token's logits depend on the forward's width; exact mode pads plain and speculative
    forwards to one width and key length, so outputs match token for token."""
    target = tiny.native(kind, seed=0).to(torch.bfloat16)
    drafter = make_drafter(drafter_name, target, kind, tiny)
    if isinstance(drafter, DraftLMDrafter):
        drafter.model = drafter.model.to(torch.bfloat16)
    if isinstance(drafter, EagleDrafter):
        drafter.head = drafter.head.to(torch.bfloat16)
    p = prompt_ids(plen, seed=8)
    ref = plain(target, p, exact=True)
    out, _, dec = run(target, drafter, p, exact=True)
    assert out == ref
