"""Medusa-1 heads: lossless drafting, checkpoint layouts, and the training objective.

* Greedy speculative decoding with Medusa heads (random or lm_head-initialised; static, chain
  and dynamic trees) equals plain greedy decoding token for token (fp32, tiny models).
* Sampling goes through rejection sampling: a seeded run is deterministic, and one verify step
  over a Medusa tree emits tokens distributed as the target (chi-square, the helper of
  tests/verify/test_rejection.py).
* Both checkpoint layouts round-trip, and what they write is what the reference loaders read:
  module trees rebuilt from vLLM's ``vllm/model_executor/models/medusa.py`` (+ its config
  class ``vllm/transformers_utils/configs/medusa.py``) and FasterDecoding/Medusa's
  ``medusa/model/medusa_model.py`` load the files with ``strict=True`` and give our logits.
* A head trained for another target is refused with a clear error.
* ``MedusaObjective`` overfits a tiny FeatureBatch, and the heads it trains are accepted at
  inference, which pins the "head k predicts t + k + 2" indexing on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters import medusa  # noqa: F401  (registers "medusa")
from eyas.drafters.base import TargetFeatures, get_drafter_factory
from eyas.drafters.eagle import HeadMismatchError
from eyas.drafters.medusa import (
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    make_medusa_tree,
    medusa_heads_for,
    target_lm_head_weight,
)
from eyas.formats.medusa import load_medusa, looks_like_medusa_dir, save_medusa
from eyas.models.loading import LoadedTarget
from eyas.train.features import TargetFeaturizer
from eyas.train.medusa_loss import MedusaLossConfig, MedusaObjective
from eyas.types import SamplingParams
from eyas.verify import logits_to_probs

VOCAB = 256  # the tiny models' vocabulary (tests/conftest.py)
N = 32
KINDS = ("llama", "qwen3")
TREES = (None, "static:eagle_small", "chain:3", "dynamic:4,3,10", "dynamic")


# ---- helpers ------------------------------------------------------------------------------------
def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + 17 * n + seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


def run(target, drafter, prompt: torch.Tensor, n: int = N, **cfg):
    """(new token ids, the decoder) of one generation."""
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n, **cfg))
    return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()], dec


def frozen_heads(target, init: str, num_heads: int = 4, num_layers: int = 1, seed: int = 3) -> MedusaHeads:
    return medusa_heads_for(target, num_heads, num_layers, init=init, seed=seed).eval().requires_grad_(False)


def randomise(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    """Every parameter random (incl. biases), so a loader that drops or swaps one is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return heads


def feature(target, d: int = 64, seed: int = 0) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    return TargetFeatures(hidden=torch.randn(3, d, generator=g).to(target.dtype))


def draft_of(target, heads: MedusaHeads, tree: str | None, seed: int = 0):
    d = MedusaDrafter(target_model=target, heads=heads, tree=tree)
    d.start(64)
    d.extend(torch.tensor([1, 2, 3]), feature(target, heads.config.hidden_size, seed))
    return d, d.propose(torch.tensor([5, 6, 7]), SamplingParams())


@pytest.fixture(params=KINDS)
def target(request, tiny):
    return tiny.native(request.param, seed=0)


@pytest.fixture
def llama(tiny):
    return tiny.native("llama", seed=0)


# ---- the heads -----------------------------------------------------------------------------------
def test_lm_head_init_makes_every_head_the_targets_next_token_predictor(llama):
    heads = medusa_heads_for(llama, num_heads=3, num_layers=2, init="lm_head")
    h = torch.randn(5, 64)
    want = torch.nn.functional.linear(h, llama.lm_head_proj.weight)
    got = heads(h)
    assert got.shape == (3, 5, VOCAB)
    for k in range(3):
        torch.testing.assert_close(got[k], want, rtol=0, atol=0)  # the same weights, bit for bit
    # the target's own lm_head may pick another GEMM shape (vocab_logits): equal up to rounding
    torch.testing.assert_close(llama.lm_head(h), want)
    assert target_lm_head_weight(llama).shape == (VOCAB, 64)


def test_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(64, 256, num_heads=0)


# ---- trees ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", TREES + ("static:[[0],[1],[0,0],[0,1],[1,0]]",))
def test_proposal_shape_tokens_and_point_mass(llama, tree):
    heads = randomise(frozen_heads(llama, "random", num_heads=3))
    drafter, out = draft_of(llama, heads, tree)
    t = out.tree
    assert out.q is None  # deterministic top-k drafts: point masses in rejection sampling
    assert t.num_nodes <= drafter.max_nodes and int(t.tokens[0]) == 7
    assert int(t.depth.max()) <= 3  # never deeper than the heads
    logp = torch.log_softmax(heads(feature(llama).hidden[-1]), dim=-1)  # [K, V]
    parents, tokens, depth = t.parents.tolist(), t.tokens.tolist(), t.depth.tolist()
    for i in range(1, t.num_nodes):
        # the node's token is among the top tokens of head depth - 1, whatever its parent
        rank = int((logp[depth[i] - 1] > logp[depth[i] - 1, tokens[i]]).sum())
        assert rank < 10, (i, rank)  # medusa_mc_sim_7b_63 uses ranks up to 9
        siblings = [tokens[j] for j in range(1, t.num_nodes) if parents[j] == parents[i]]
        assert len(siblings) == len(set(siblings))


def test_static_tree_node_is_rank_r_of_head_d(llama):
    heads = randomise(frozen_heads(llama, "random", num_heads=2))
    _, out = draft_of(llama, heads, "static:[[0],[1],[2],[0,0],[2,1]]")
    top = heads(feature(llama).hidden[-1]).topk(3, dim=-1).indices  # [K, 3]
    expected = [7, top[0, 0], top[0, 1], top[0, 2], top[1, 0], top[1, 1]]
    assert out.tree.tokens.tolist() == [int(x) for x in expected]
    assert out.tree.parents.tolist() == [-1, 0, 0, 0, 1, 3]


def test_default_tree_is_medusa_preset_cut_to_the_heads(llama):
    from eyas.tree import PRESETS

    preset = PRESETS["medusa_mc_sim_7b_63"]
    for k in (1, 2, 4):
        policy = make_medusa_tree(None, k)
        assert policy.max_nodes == 1 + sum(len(c) <= k for c in preset)
    assert make_medusa_tree(None, 4).max_nodes == 64
    assert make_medusa_tree("dynamic", 3).max_nodes == 49  # top_k 8, depth 3, 48 tokens


@pytest.mark.parametrize(("spec", "match"), [("dynamic:4,5,10", "exceeds the 3 Medusa heads"),
                                             ("dynamic:a", "take ints"), ("bushy", "unknown tree"),
                                             ("adaptive:2,4,0.4,0.1", "adaptive trees size an EAGLE"),
                                             ("static:nope", "unknown tree preset")])
def test_bad_tree_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        make_medusa_tree(spec, 3)


# ---- greedy losslessness ---------------------------------------------------------------------------
@pytest.mark.parametrize("plen", (1, 30))
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("init", ("random", "lm_head"))
def test_greedy_speculative_equals_plain(target, init, tree, plen):
    p = prompt_ids(plen)
    ref = run(target, None, p, 24)[0]
    drafter = MedusaDrafter(target_model=target, heads=frozen_heads(target, init), tree=tree)
    out, dec = run(target, drafter, p, 24)
    assert out == ref
    assert dec.stats.steps >= 1 and dec.stats.drafted >= dec.stats.steps


def test_drafter_from_registry_and_reused_across_prompts(llama, tmp_path):
    save_medusa(randomise(frozen_heads(llama, "random")), tmp_path, layout="medusa")
    loaded = LoadedTarget(model=llama, tokenizer=None, path=Path("."), name="tiny")
    drafter = get_drafter_factory("medusa")(target=loaded, path=tmp_path, tree="dynamic:4,4,12")
    for plen in (30, 7, 1):
        p = prompt_ids(plen, seed=9)
        assert run(llama, drafter, p)[0] == run(llama, None, p)[0]


def test_exact_mode_bf16_equals_exact_plain(tiny):
    target = tiny.native("llama", seed=0).to(torch.bfloat16)
    heads = frozen_heads(target, "lm_head").to(torch.bfloat16)
    drafter = MedusaDrafter(target_model=target, heads=heads, tree="static:eagle_small")
    p = prompt_ids(7, seed=8)
    assert run(target, drafter, p, exact=True)[0] == \
        run(target, None, p, exact=True)[0]


# ---- sampling --------------------------------------------------------------------------------------
def test_sampling_is_deterministic_per_seed(llama):
    p = prompt_ids(7, seed=6)
    sp = SamplingParams(temperature=0.8, top_p=0.9)

    def sample_run(seed: int) -> list[int]:
        heads = frozen_heads(llama, "lm_head")
        drafter = MedusaDrafter(target_model=llama, heads=heads, tree="dynamic:4,3,10")
        out = run(llama, drafter, p, sampling=sp, seed=seed)[0]
        assert len(out) == N and all(0 <= t < VOCAB for t in out)
        return out

    a = sample_run(123)
    assert sample_run(123) == a
    assert any(sample_run(s) != a for s in (7, 8, 9)), "different seeds gave the same sample every time"


def test_one_verify_step_over_a_medusa_tree_samples_the_target(llama, stats):
    """First two emitted tokens of one step ~ p(a) p(b | a), with drafts that get accepted."""
    sp = SamplingParams(temperature=1.5, top_k=6)
    heads = frozen_heads(llama, "lm_head", num_heads=2)
    tree = "static:[[0],[1],[2],[0,0],[0,1],[1,0]]"
    for seed in range(40):  # a prompt whose tree holds likely tokens, so acceptance is exercised
        drafter = MedusaDrafter(target_model=llama, heads=heads, tree=tree)
        dec = SpecDecoder(llama, drafter, DecodeConfig(max_new_tokens=8, sampling=sp, seed=seed))
        seq = dec.prefill(prompt_ids(7, seed=seed))
        draft = dec.draft(seq)
        probs = logits_to_probs(dec.verify_forward(seq, draft.tree).logits[0], sp)
        if float(probs[0, draft.tree.tokens[1:4]].sum()) > 0.3:
            break
    else:
        raise AssertionError("no prompt gave a Medusa tree with likely root children")
    accepted, p_value = stats.two_token_check(llama, seq.history, draft, probs, sp, VOCAB)
    assert accepted > 300
    assert p_value > 1e-3


# ---- checkpoint layouts ------------------------------------------------------------------------------
class VllmResidualBlock(nn.Module):
    """vLLM ``ResidualBlock``: ``layers`` = num_hidden_layers Linear(D, D, bias=medusa_fc_bias)."""

    def __init__(self, d: int, n: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=bias) for _ in range(n)])

    def forward(self, x):
        for lin in self.layers:
            x = x + nn.functional.silu(lin(x))
        return x


class VllmMedusa(nn.Module):
    """The parameter tree of vLLM's ``Medusa`` (``blocks``, ``lm_heads`` with weight [V, D])."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d, v = cfg["hidden_size"], cfg["truncated_vocab_size"]
        bias = cfg.get("medusa_fc_bias", False)
        self.blocks = nn.ModuleList([VllmResidualBlock(d, cfg["num_hidden_layers"], bias)
                                     for _ in range(cfg["num_heads"])])
        self.lm_heads = nn.ModuleList([nn.Linear(d, v, bias=False) for _ in range(cfg["num_heads"])])

    def forward(self, x):
        return torch.stack([lm(b(x)) for b, lm in zip(self.blocks, self.lm_heads, strict=True)])


def vllm_config_view(cfg: dict) -> dict:
    """What vLLM's ``MedusaConfig.from_pretrained`` makes of a config.json: every key holding
    "num" and "heads" becomes num_heads, "num" and "layers" num_hidden_layers."""
    out = dict(cfg)
    for k in list(out):
        if "num" in k and "heads" in k:
            out["num_heads"] = out.pop(k)
        elif "num" in k and "layers" in k:
            out["num_hidden_layers"] = out.pop(k)
    if out.get("truncated_vocab_size") is None:
        out["truncated_vocab_size"] = out["vocab_size"]
    return out


class MedusaRefResBlock(nn.Module):
    """FasterDecoding/Medusa ``ResBlock``: ``linear`` (with bias) and x + SiLU(linear(x))."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_reference_heads(d: int, v: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """Medusa's ``medusa_head``: ModuleList of Sequential(ResBlock x L, Linear(D, V, bias=False)).
    (The reference repeats one ResBlock object L times; with L = 1 that is the same tree.)"""
    return nn.ModuleList([
        nn.Sequential(*[MedusaRefResBlock(d) for _ in range(num_layers)], nn.Linear(d, v, bias=False))
        for _ in range(num_heads)
    ])


def _safetensors(d: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / name))


@pytest.mark.parametrize("layout", ("vllm", "medusa"))
@pytest.mark.parametrize(("num_layers", "bias"), [(1, True), (2, True), (1, False)])
def test_layout_round_trip(llama, tmp_path, layout, num_layers, bias):
    cfg = MedusaConfig(64, VOCAB, num_heads=3, num_layers=num_layers, bias=bias)
    heads = randomise(MedusaHeads(cfg), seed=num_layers).eval().requires_grad_(False)
    save_medusa(heads, tmp_path, layout=layout, target_name="tiny-llama")
    assert looks_like_medusa_dir(tmp_path)
    back = load_medusa(tmp_path, llama.config, torch.float32)
    # a bias-free head comes back from the Medusa layout with zero biases: the same function
    assert back.config.num_heads == 3 and back.config.num_layers == num_layers
    h = torch.randn(4, 64)
    torch.testing.assert_close(back(h), heads(h), rtol=0, atol=0)
    drafts = [draft_of(llama, x, None)[1].tree.tokens for x in (back, heads)]
    assert torch.equal(*drafts)


def test_vllm_layout_is_what_vllm_loads(tmp_path):
    heads = randomise(MedusaHeads(MedusaConfig(64, VOCAB, num_heads=3, num_layers=2))).eval()
    save_medusa(heads, tmp_path, layout="vllm", target_name="org/tiny")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["MedusaModel"] and raw["model_type"] == "medusa"
    view = vllm_config_view(raw)
    assert {k: view[k] for k in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size",
                                 "truncated_vocab_size", "medusa_fc_bias")} == {
        "num_heads": 3, "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": VOCAB,
        "truncated_vocab_size": VOCAB, "medusa_fc_bias": True}
    sd = _safetensors(tmp_path, "model.safetensors")
    ref = VllmMedusa(view)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd, strict=True)
    h = torch.randn(4, 64)
    torch.testing.assert_close(ref(h), heads(h), rtol=0, atol=0)


def test_medusa_layout_is_what_medusa_loads(tmp_path):
    heads = randomise(MedusaHeads(MedusaConfig(64, VOCAB, num_heads=3, num_layers=1))).eval()
    save_medusa(heads, tmp_path, layout="medusa", target_name="org/tiny")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert [raw[k] for k in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")] == \
        [3, 1, "org/tiny"]
    sd = _safetensors(tmp_path, "medusa_lm_head.safetensors")
    assert set(sd) == {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")} | {
        f"{k}.1.weight" for k in range(3)}
    ref = medusa_reference_heads(64, VOCAB, 3, 1)
    ref.load_state_dict(sd, strict=True)
    h = torch.randn(4, 64)
    torch.testing.assert_close(torch.stack([m(h) for m in ref]), heads(h), rtol=0, atol=0)


def test_loads_reference_checkpoints_written_by_their_own_modules(llama, tmp_path):
    """State dicts of the rebuilt reference modules (vLLM with medusa_heads. prefix, Medusa) load."""
    torch.manual_seed(0)
    vref = VllmMedusa({"hidden_size": 64, "truncated_vocab_size": VOCAB, "num_heads": 2,
                       "num_hidden_layers": 1, "medusa_fc_bias": False})
    from safetensors.torch import save_file

    (tmp_path / "v").mkdir()
    save_file({f"medusa_heads.{k}": v.contiguous() for k, v in vref.state_dict().items()},
              str(tmp_path / "v" / "model.safetensors"))
    (tmp_path / "v" / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2,
                                                            "num_hidden_layers": 1, "hidden_size": 64,
                                                            "vocab_size": VOCAB}))
    mref = medusa_reference_heads(64, VOCAB, 5, 1)
    (tmp_path / "m").mkdir()
    save_file({k: v.contiguous() for k, v in mref.state_dict().items()},
              str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    # Medusa's loader builds the config's head count and loads the rest with strict=False
    (tmp_path / "m" / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    h = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(load_medusa(tmp_path / "v", llama.config)(h), vref(h))
        torch.testing.assert_close(load_medusa(tmp_path / "m", llama.config)(h),
                                   torch.stack([m(h) for m in list(mref)[:4]]))


def test_looks_like_medusa_dir_is_false_for_other_checkpoints(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file({"fc.weight": torch.zeros(2, 4), "layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    assert not looks_like_medusa_dir(tmp_path)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    assert not looks_like_medusa_dir(tmp_path)
    assert not looks_like_medusa_dir(tmp_path / "missing")


# ---- mismatches ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ("vllm", "medusa"))
def test_heads_for_another_hidden_size_are_refused(llama, tmp_path, layout):
    save_medusa(MedusaHeads(MedusaConfig(32, VOCAB, num_heads=2)), tmp_path, layout=layout)
    with pytest.raises(HeadMismatchError, match=r"hidden size 32 but the target's hidden size is 64"):
        load_medusa(tmp_path, llama.config)
    loaded = LoadedTarget(model=llama, tokenizer=None, path=Path("."), name="tiny")
    with pytest.raises(ValueError, match="different target model"):
        get_drafter_factory("medusa")(target=loaded, path=tmp_path)


def test_heads_for_another_vocabulary_are_refused(llama, tmp_path):
    save_medusa(MedusaHeads(MedusaConfig(64, 300, num_heads=2)), tmp_path)
    with pytest.raises(HeadMismatchError, match="vocabulary size 300 but the target's vocabulary size"):
        load_medusa(tmp_path, llama.config)


def test_inconsistent_or_unsupported_checkpoints(llama, tmp_path):
    save_medusa(MedusaHeads(MedusaConfig(64, VOCAB, num_heads=2)), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"num_heads": 5}))
    with pytest.raises(HeadMismatchError, match="asks for 5 heads but the weights hold 2"):
        load_medusa(tmp_path, llama.config)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"truncated_vocab_size": 100}))
    with pytest.raises(HeadMismatchError, match="truncated vocabulary"):
        load_medusa(tmp_path, llama.config)
    (tmp_path / "model.safetensors").rename(tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="safetensors only"):
        load_medusa(tmp_path, llama.config)
    with pytest.raises(ValueError, match="needs a heads directory"):
        MedusaDrafter(target_model=llama)


# ---- the training objective --------------------------------------------------------------------------
def test_objective_overfits_and_its_heads_are_accepted(llama, tmp_path):
    """~30 steps on two conversations; the trained heads then draft the target's own output."""
    p0, p1 = prompt_ids(7, seed=1), prompt_ids(2, seed=2)
    r0, r1 = run(llama, None, p0, N)[0], run(llama, None, p1, 20)[0]
    rows = [torch.cat([p0, torch.tensor(r0)]), torch.cat([p1, torch.tensor(r1)])]
    t = max(r.shape[0] for r in rows)
    ids = torch.zeros(2, t, dtype=torch.long)
    attn = torch.zeros(2, t, dtype=torch.bool)
    loss_mask = torch.zeros(2, t, dtype=torch.bool)
    for i, (row, plen) in enumerate(zip(rows, (7, 2), strict=True)):
        ids[i, : row.shape[0]], attn[i, : row.shape[0]] = row, True
        loss_mask[i, plen - 1 : row.shape[0] - 1] = True  # the next token is a reply token
    batch = TargetFeaturizer(llama)(ids, attn, loss_mask)

    obj = MedusaObjective(llama, MedusaLossConfig(num_heads=3, layout="medusa"), target_name="tiny")
    opt = torch.optim.Adam(obj.module.parameters(), lr=1e-2)
    first, logs = obj.loss(batch)
    assert set(logs) >= {"loss", "head0_loss", "head0_acc", "head2_tokens"}
    # head k learns reply tokens at positions >= k + 2: all of row 0's, row 1's lose the first k
    assert [logs[f"head{k}_tokens"] for k in range(3)] == [N + 20, N + 19, N + 18]
    for _ in range(30):
        loss, logs = obj.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = obj.loss(batch)[0].item()
    assert final < 0.3 * first.item(), (first.item(), final)
    assert min(logs[f"head{k}_acc"] for k in range(3)) > 0.85  # top-1 agreement with the target

    heads = load_medusa(obj.save(tmp_path), llama.config)
    with torch.no_grad():
        torch.testing.assert_close(heads(batch.hidden), obj.module(batch.hidden))
    for tree in ("chain:3", None, "dynamic:4,3,10"):
        out, dec = run(llama, MedusaDrafter(target_model=llama, heads=heads, tree=tree), p0)
        assert out == r0
        assert dec.stats.accepted >= 2 * dec.stats.steps, (tree, dec.stats)
