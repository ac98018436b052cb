"""eyas.autotree: step costs measured through the decoder, cached per machine, and the sized tree.

Timing itself is not asserted (shared CI machines); what is: the measurement runs the real
decoder at every width, the cache is keyed and reused (no second measurement), --tree and
EYAS_AUTO_TREE=0 override, a head without a profile keeps its recommended tree, and the choice
is choose_tree's on the cached table.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from eyas import autotree
from eyas.drafters.eagle3 import random_eagle3_head
from eyas.drafters.loading import DrafterSpec
from eyas.models.loading import LoadedTarget
from eyas.tree.sizing import AcceptanceProfile, DraftCost, TreeChoice, choose_tree, step_budget

PROFILE = [[0.4, 0.1, 0.05], [0.45, 0.1, 0.05], [0.5, 0.1]]


@pytest.fixture
def llama(tiny):
    return tiny.native("llama", seed=0)


def test_junk_tree_has_the_width_and_keeps_the_root(llama):
    d = autotree.JunkTree(7, 256)
    out = d.propose(torch.tensor([3, 5, 9]), None)
    assert out.tree.num_nodes == 7 and int(out.tree.tokens[0]) == 9
    assert out.tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("exact", (False, True))
def test_step_costs_are_measured_at_every_width(llama, exact, monkeypatch):
    monkeypatch.setattr(autotree, "CONTEXT", 12)
    cost = autotree.measure_step_costs(llama, exact, widths=(1, 3, 8), steps=3)
    assert sorted(cost) == [1, 3, 8] and all(v > 0 for v in cost.values())


def test_draft_cost_fit_is_non_negative(llama, monkeypatch):
    monkeypatch.setattr(autotree, "CONTEXT", 12)
    head = random_eagle3_head(llama.config, draft_vocab_size=128, seed=3)
    for hybrid in (False, True):
        d = autotree.measure_draft_cost(head, llama, exact=False, hybrid=hybrid, steps=3)
        assert d.per_step > 0 and d.per_level >= 0 and d.per_node >= 0


def test_exact_timing_runs_prefill_their_prompt_once(llama, monkeypatch):
    """Exact mode's prefix cache hands the timing runs the prompt's cache (the same bits), so the sizing's time goes
    to the timed steps, not to prefilling the same prompt ~170 times: every run reuses all but the prompt's last
    token, except the first without a drafter and the first whose drafter reads the target's features."""
    monkeypatch.setattr(autotree, "CONTEXT", 17)
    stores = []
    real = autotree._prompt_store
    monkeypatch.setattr(autotree, "_prompt_store", lambda exact: stores.append(real(exact)) or stores[-1])
    autotree.measure_step_costs(llama, True, widths=(1, 3), steps=2, rounds=2)
    head = random_eagle3_head(llama.config, draft_vocab_size=128, seed=3)
    autotree.measure_draft_cost(head, llama, exact=True, hybrid=True, steps=2, rounds=1)
    assert len(stores) == 2
    for store in stores:
        runs = store.queried_tokens // 17
        assert runs >= 5 and store.hit_tokens == (runs - 2) * 16
    assert real(False) is None  # without exact mode a reused prefix's bits could differ: every run prefills


def test_draft_cost_fit_recovers_costs_and_stays_non_negative():
    rows = [(lv, lv * k) for k, lv in ((1, 0), (1, 2), (2, 1), (2, 2), (3, 2))]
    exact = [1e-3 + lv * 4e-4 + nd * 5e-5 for lv, nd in rows]
    d = autotree.fit_draft_cost(rows, exact)
    assert (d.per_step, d.per_level, d.per_node) == pytest.approx((1e-3, 4e-4, 5e-5), rel=1e-9)
    # nodes that look cheaper than free (noise): per_node pinned at 0, the rest refitted
    d = autotree.fit_draft_cost(rows, [1e-3 + lv * 4e-4 - nd * 1e-4 for lv, nd in rows])
    assert d.per_node == 0 and d.per_level >= 0 and d.per_step > 0
    assert autotree.fit_draft_cost(rows, [-1.0] * 5).per_step == 1e-5  # nothing measurable: the floor


@pytest.fixture
def fake_head(tmp_path, monkeypatch, llama):
    """A head directory with a profile, fake measurements that count their calls, a private cache."""
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    (head_dir / "profile.json").write_text(json.dumps({"rank_accept": PROFILE}))
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EYAS_AUTO_TREE", raising=False)
    monkeypatch.delenv("EYAS_ADAPTIVE_TREE", raising=False)
    calls = []
    table = {1: 0.040, 2: 0.041, 4: 0.042, 8: 0.044, 16: 0.060, 32: 0.080}
    draft = DraftCost(per_step=0.004, per_level=0.003, per_node=0.0002)
    monkeypatch.setattr(autotree, "measure_step_costs", lambda model, exact: calls.append("steps") or table)
    monkeypatch.setattr(autotree, "load_eagle3", lambda *a: None)
    monkeypatch.setattr(autotree, "measure_draft_cost", lambda head, model, exact, **kw: calls.append("draft") or draft)
    monkeypatch.setattr(autotree, "head_dir_of", lambda target, spec: head_dir)
    target = LoadedTarget(model=llama, tokenizer=None, path=tmp_path, name="tiny")
    return target, calls, table, draft


def test_choice_is_measured_once_then_cached(fake_head):
    target, calls, table, draft = fake_head
    a = autotree.size_tree_for(target, DrafterSpec("default"))
    assert calls == ["steps", "draft"]
    b = autotree.size_tree_for(target, DrafterSpec("default"))
    assert calls == ["steps", "draft"] and a == b  # from the cache file, same choice
    fixed = choose_tree(table, draft, AcceptanceProfile(PROFILE), max_nodes=32)
    assert a.fixed_spec == fixed.spec and a.predicted_tok_s == fixed.predicted_tok_s
    # sized step by step at the fixed tree's prices (eyas.tree.budget), deterministic given the table
    most = autotree.adaptive_max_total(fixed, 32)
    assert most == max(autotree.ADAPTIVE_MAX_TOTAL, 2 * fixed.total_tokens)
    assert a.budget == step_budget(fixed, table, draft, AcceptanceProfile(PROFILE), most)
    assert a.spec == a.budget.spec and a.spec.startswith(f"adaptive:{fixed.top_k},")
    files = list((autotree.cache_root() / "tree_costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["target"] == "tiny"
    autotree.size_tree_for(target, DrafterSpec("default"), exact=True)  # another key: measured again
    assert calls == ["steps", "draft"] * 2


def test_tree_flag_and_env_override(fake_head, monkeypatch):
    target, calls, _, _ = fake_head
    assert autotree.size_tree_for(target, DrafterSpec("default", tree="dynamic:4,3,4")) is None
    monkeypatch.setenv("EYAS_ADAPTIVE_TREE", "0")  # the fixed tree the sizer picked
    fixed = autotree.size_tree_for(target, DrafterSpec("default"))
    assert fixed.budget is None and fixed.spec.startswith("dynamic:")
    calls.clear()
    monkeypatch.setenv("EYAS_AUTO_TREE", "0")
    assert autotree.size_tree_for(target, DrafterSpec("default")) is None
    assert calls == []


def test_no_profile_keeps_the_recommended_tree(fake_head):
    target, calls, _, _ = fake_head
    (autotree.head_dir_of(target, None) / "profile.json").unlink()
    assert autotree.size_tree_for(target, DrafterSpec("default")) is None and calls == []


def test_head_dir_of_names(tmp_path, llama):
    target = LoadedTarget(model=llama, tokenizer=None, path=tmp_path, name="tiny")
    assert autotree.head_dir_of(target, DrafterSpec("ngram")) is None
    assert autotree.head_dir_of(target, DrafterSpec("hybrid")) is None  # no shipped head for this target
    assert autotree.head_dir_of(target, DrafterSpec(str(tmp_path))) is None  # a directory, not a head


def test_the_cost_key_of_an_hf_backend_target(tmp_path, tiny, llama):
    """The HF backend's target is not an nn.Module (its model is .hf): the key has no blocks and no quantized kinds
    (sizing the default head's tree on --backend hf once failed here), and differs from the native model's."""
    from eyas.models.hf import HFTarget

    hf = LoadedTarget(model=HFTarget(tiny.hf("llama", seed=0)), tokenizer=None, path=tmp_path, name="tiny")
    key = autotree.tree_cost_key(hf, tmp_path, exact=False, hybrid=True)
    assert key["gguf_blocks"] == 0 and key["quantized"] == []
    native = LoadedTarget(model=llama, tokenizer=None, path=tmp_path, name="tiny")
    assert key != autotree.tree_cost_key(native, tmp_path, exact=False, hybrid=True)


def test_the_cost_key_tells_drafting_switched_off_apart(tmp_path, llama, monkeypatch):
    """A table timed with the native head call or the head's kernels switched off is not the default's: their own
    key, and the default's key has no such field (its cached tables stay valid)."""
    target = LoadedTarget(model=llama, tokenizer=None, path=tmp_path, name="tiny")
    default = autotree.tree_cost_key(target, tmp_path, exact=False, hybrid=True)
    assert not any(k.startswith("eyas_") for k in default)
    for name in autotree.DRAFT_SWITCHES:
        monkeypatch.setenv(name, "0")
        assert autotree.tree_cost_key(target, tmp_path, exact=False, hybrid=True) != default, name
        monkeypatch.setenv(name, "1")
        assert autotree.tree_cost_key(target, tmp_path, exact=False, hybrid=True) == default, name


def test_the_cost_key_follows_the_heads_shape(tmp_path, llama):
    """A head directory whose config.json changes (a second layer, a wider MLP) is timed again; the same config in
    another place of the same name is the same key."""
    target = LoadedTarget(model=llama, tokenizer=None, path=tmp_path, name="tiny")
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text('{"num_hidden_layers": 1}')
    one = autotree.tree_cost_key(target, head, exact=False, hybrid=True)
    (head / "config.json").write_text('{"num_hidden_layers": 2}')
    two = autotree.tree_cost_key(target, head, exact=False, hybrid=True)
    assert one != two
    twin = tmp_path / "elsewhere" / "head"
    twin.mkdir(parents=True)
    (twin / "config.json").write_text('{"num_hidden_layers": 2}')
    assert autotree.tree_cost_key(target, twin, exact=False, hybrid=True) == two


# ---- integration: eyas.load, eyas generate --json, the server's policy endpoint (embedded model) ------
@pytest.fixture
def fake_costs(tmp_path, monkeypatch):
    """Fixed measurements (no timing on a shared machine) and a private cost cache."""
    monkeypatch.setattr(autotree, "cache_root", lambda: tmp_path)
    monkeypatch.delenv("EYAS_AUTO_TREE", raising=False)
    monkeypatch.delenv("EYAS_ADAPTIVE_TREE", raising=False)
    table = {1: 0.040, 2: 0.041, 4: 0.042, 8: 0.044, 16: 0.060, 32: 0.080}
    monkeypatch.setattr(autotree, "measure_step_costs", lambda model, exact: table)
    draft = DraftCost(0.004, 0.003, 0.0002)
    monkeypatch.setattr(autotree, "measure_draft_cost", lambda head, model, exact, **kw: draft)
    return table


@pytest.mark.slow
def test_load_sizes_the_default_heads_tree_and_tree_overrides(default_target, fake_costs):
    import eyas

    spec = eyas.load(dtype="float32")
    c = spec.tree_choice
    assert c is not None and spec.drafter_spec.tree == c.spec and c.spec.startswith("adaptive:")
    assert spec.drafter.max_nodes == c.budget.max_total + 1  # the most an adaptive step keeps
    assert eyas.load(dtype="float32", tree="dynamic:4,3,4").tree_choice is None
    hybrid = eyas.load(drafter="hybrid", dtype="float32")
    h = hybrid.tree_choice  # sized with the lookup's measured extra tau (profile.json hybrid_extra_tau)
    assert h is not None and hybrid.drafter.max_nodes == h.budget.max_total + 1
    assert h.predicted_tau > c.predicted_tau
    assert eyas.load(drafter="ngram", dtype="float32").tree_choice is None


@pytest.mark.slow
def test_generate_json_shows_the_choice(default_target, fake_costs, capsys):
    from eyas.cli import main

    assert main(["generate", "Hi", "--json", "--max-new-tokens", "4", "--dtype", "float32"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tree_choice"]["tree"].startswith("adaptive:") and d["tree_choice"]["predicted_tau"] > 1
    assert d["tree_choice"]["fixed_tree"].startswith("dynamic:")
    assert "kernel_tuning" not in d  # a float32 target: the bf16 block kernel's options do not apply


@pytest.mark.slow
def test_policy_endpoint_shows_the_choice(default_target, fake_costs):
    pytest.importorskip("fastapi")
    import eyas
    from eyas.serving.app import Server
    from eyas.serving.engine import ServeLimits
    from eyas.serving.guard import HttpConfig

    spec = eyas.load(dtype="float32")
    server = Server(spec, "smol", ServeLimits(max_queue=2, max_tokens=8, spec_policy="always", calibrate=False),
                    HttpConfig())
    try:
        deadline = time.monotonic() + 30
        while server.engine.policy_snapshot() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.policy_view()["tree_choice"] == spec.tree_choice.to_dict()
    finally:
        server.engine.close()


def test_a_profile_measured_for_other_weights_is_ignored(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights v1")
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"rank_accept": PROFILE, "weights": autotree.weights_digest(tmp_path)}))
    assert autotree.load_profile(tmp_path) == AcceptanceProfile(PROFILE)
    (tmp_path / "model.safetensors").write_bytes(b"weights v2, retrained")
    assert autotree.load_profile(tmp_path) is None


def test_a_profile_carries_its_measured_tree_tau(tmp_path):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"rank_accept": PROFILE, "tree_tau": {"2,2,3": 2.1, "1,1,1": 1.4}}))
    assert autotree.load_profile(tmp_path).tree_tau == {(2, 2, 3): 2.1, (1, 1, 1): 1.4}


def test_step_costs_never_fall_with_width(llama, monkeypatch):
    monkeypatch.setattr(autotree, "CONTEXT", 12)
    # warm-up (dropped), then width 1 before each other width: (1, 3), (1, 8)
    times = iter([0.2] * 4 + [0.9] * 4 + [0.5] * 4 + [0.9] * 4 + [1.0] * 4)
    monkeypatch.setattr(autotree, "_step_times", lambda dec, prompt: [next(times) for _ in range(4)])
    cost = autotree.measure_step_costs(llama, False, widths=(1, 3, 8), steps=3, rounds=1)
    assert cost == {1: 0.9, 3: 0.9, 8: 1.0}


def test_step_costs_pair_each_width_with_the_narrowest_timed_before_it(llama, monkeypatch):
    """A slow spell that falls on one pair (width 1 at 2.0 s, then 8 nodes at 2.5) moves both sides: width 8 costs
    width 1's median plus its own difference, not the 2.5 the spell made it."""
    monkeypatch.setattr(autotree, "CONTEXT", 12)
    times = iter([0.2] * 4 + [1.0] * 4 + [1.2] * 4 + [2.0] * 4 + [2.5] * 4)
    widths_run = []
    real = autotree.JunkTree
    monkeypatch.setattr(autotree, "JunkTree", lambda w, v: (widths_run.append(w), real(w, v))[1])
    monkeypatch.setattr(autotree, "_step_times", lambda dec, prompt: [next(times) for _ in range(4)])
    cost = autotree.measure_step_costs(llama, False, widths=(1, 3, 8), steps=3, rounds=1)
    assert widths_run == [3, 8]  # width 1 runs without a drafter
    assert cost == pytest.approx({1: 1.5, 3: 1.7, 8: 2.0})


def test_adaptive_trees_may_grow_past_the_cpu_cap_where_the_fixed_tree_is_large():
    """On a GPU the sizer picks trees of ~32 nodes; an adaptive step may keep twice the fixed tree, within max_nodes."""
    def choice(total: int) -> TreeChoice:
        return TreeChoice(top_k=8, depth=6, total_tokens=total, predicted_tau=3.0, predicted_tok_s=100.0,
                          plain_tok_s=40.0, step_ms=30.0)

    assert autotree.adaptive_max_total(choice(2), 32) == autotree.ADAPTIVE_MAX_TOTAL  # a CPU's small tree
    assert autotree.adaptive_max_total(choice(12), 32) == 24
    assert autotree.adaptive_max_total(choice(31), 32) == 31
