"""Greedy decoding's screened output projection (eyas/kernels/lm_screen.cpp, eyas.models.lm_screen).

The screen must never change an argmax: its bound must hold for every entry (so the true maximum is always a
candidate), the candidates' logits must be the full projection's bits, ties must resolve to the first index as
the full logits' argmax does, non-finite rows must fall back, and greedy decoding of the embedded default must give
the tokens it gave without the screen.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from eyas import kernels
from eyas.models import lm_screen
from eyas.models.gguf_blocks import GGUFBlocks
from tests.conftest import random_blocks

BF16 = kernels.gguf_bf16()
SCREEN = kernels.lm_screen()
pytestmark = pytest.mark.skipif(
    BF16 is None or not BF16.available() or SCREEN is None or not SCREEN.available(),
    reason="needs AVX512-BF16 and AVX512-VNNI (the bf16 block kernel and the screen)",
)
K = 576


@pytest.fixture(autouse=True)
def screen_on(monkeypatch):
    """The screen without its per-machine timing (small random projections may not pay; tests/models checks that
    ``screen_pays`` decides)."""
    monkeypatch.setenv("EYAS_LM_SCREEN", "1")


def projection(raw: np.ndarray) -> nn.Linear:
    """An output projection whose weight is the Q8_0 blocks ``raw`` (the screen reads only the blocks)."""
    proj = nn.Linear(K, raw.shape[0], bias=False).requires_grad_(False)
    proj.__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.from_numpy(np.ascontiguousarray(raw)), qtype=8, k=K)
    return proj


def rows(n: int, seed: int, outliers: float = 40.0) -> torch.Tensor:
    """[n, K] bf16 hidden-like rows: unit noise with two large dimensions, as a final norm's output has."""
    x = torch.randn(n, K, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= outliers
    x[:, 100] *= -outliers / 2
    return x.to(torch.bfloat16)


def full_logits(proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return proj.__dict__["_eyas_blocks"].linear(x, None).float()


@pytest.mark.parametrize("vocab", [1000, 4096])  # a last group of 8 padding lanes, and whole groups of 16
@pytest.mark.parametrize("r", [1, 3, 8, 16])
def test_the_bound_holds_for_every_entry(vocab, r):
    proj = projection(random_blocks("Q8_0", vocab, K, seed=vocab + r))
    x = rows(r, seed=r)
    packed = SCREEN.pack(proj.__dict__["_eyas_blocks"].data, K)
    approx, bound = SCREEN.approx(x, packed, vocab)
    assert approx.shape == bound.shape == (r, vocab)
    err = (full_logits(proj, x) - approx).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # the approximation is not the exact projection (the bound is doing work)


@pytest.mark.parametrize("r", [1, 2, 5, 16, 21])  # 21: two kernel calls, candidates merged
def test_argmax_and_candidate_bits_equal_the_full_projections(r):
    proj = projection(random_blocks("Q8_0", 3000, K, seed=r))
    x = rows(r, seed=100 + r)
    full = full_logits(proj, x)
    found = lm_screen.screened(proj, x[None])
    got = found.logits[0]
    assert got.shape == full.shape and found.greedy.shape == (1, r)
    assert torch.equal(kernels.argmax(got), kernels.argmax(full))
    assert torch.equal(found.greedy[0], kernels.argmax(full))  # the argmax the screen found on the way
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], full[kept])  # a candidate's logit is the block kernel's, bit for bit
    assert int(kept.sum(-1).max()) < 3000 // 4  # and most entries were screened out


@pytest.mark.parametrize("vocab", [1000, 4096, 49152])  # padding lanes; whole groups; the embedded default's size
@pytest.mark.parametrize("r", [1, 2, 7, 9, 16])  # one and two passes of 8 rows over a group
def test_candidates_are_every_entry_whose_interval_reaches_the_best_lower_bound(vocab, r):
    """The kernel's candidate list (kept as it goes, never written as [R, V]) is the set approx() defines, in order."""
    proj = projection(random_blocks("Q8_0", vocab, K, seed=3 * vocab + r))
    x = rows(r, seed=7 * r)
    packed = SCREEN.pack(proj.__dict__["_eyas_blocks"].data, K)
    a, e = SCREEN.approx(x, packed, vocab)
    lo = (a - e).max(dim=1, keepdim=True).values
    want = torch.nonzero(((a + e) >= lo).any(dim=0)).flatten()
    got = SCREEN.candidates(x, packed, vocab)
    assert torch.equal(got, want)
    # rows whose best entries all lie in the last group, and one of a single entry: the running bound starts there
    x2 = torch.zeros(r, K, dtype=torch.bfloat16)
    assert torch.equal(SCREEN.candidates(x2, packed, vocab), torch.arange(vocab))  # all equal: every entry ties
    assert SCREEN.candidates(x2, packed, 1).tolist() == [0]


@pytest.mark.parametrize("ahead", [1, 2, 64])
def test_the_prefetch_changes_no_result(ahead):
    """Prefetching groups ahead only asks for memory: the same approximations, bounds and candidates, for a vocabulary
    of many groups split between the threads (each prefetches within its own range)."""
    proj = projection(random_blocks("Q8_0", 4096, K, seed=5))
    packed, vocab = SCREEN.pack(proj.__dict__["_eyas_blocks"].data, K), 4096
    x = rows(5, seed=4)
    for a, b in zip(SCREEN.approx(x, packed, vocab), SCREEN.approx(x, packed, vocab, ahead), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(SCREEN.candidates(x, packed, vocab), SCREEN.candidates(x, packed, vocab, ahead))
    with pytest.raises(RuntimeError, match="prefetch is 0"):
        SCREEN.candidates(x, packed, vocab, 65)


def test_the_prefetch_distance_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("EYAS_LM_SCREEN_PREFETCH", raising=False)
    assert lm_screen.prefetch_from_env() == 2
    monkeypatch.setenv("EYAS_LM_SCREEN_PREFETCH", "0")
    assert lm_screen.prefetch_from_env() == 0
    for bad in ("-1", "65", "two"):
        monkeypatch.setenv("EYAS_LM_SCREEN_PREFETCH", bad)
        with pytest.raises(ValueError, match="EYAS_LM_SCREEN_PREFETCH"):
            lm_screen.prefetch_from_env()


def test_ties_resolve_to_the_first_index():
    raw = random_blocks("Q8_0", 600, K, seed=5).reshape(600, K // 32, 34)
    x = rows(4, seed=6, outliers=1.0)
    top = np.sign(x[0].float().numpy()).reshape(K // 32, 32).astype(np.int8) * 100  # row 0's best weights
    for v, q in ((17, top), (412, top), (413, top.copy())):  # 17 and 412 tie exactly; 413 differs in one weight
        raw[v, :, 0:2] = np.full((K // 32, 1), 0.05, dtype=np.float16).view(np.uint8)
        raw[v, :, 2:] = q.view(np.uint8)
    raw[413, 0, 2] = np.uint8(np.int8(top[0, 0] - 1 if top[0, 0] > 0 else top[0, 0] + 1).view(np.uint8))
    proj = projection(raw.reshape(600, -1))
    full, got = full_logits(proj, x), lm_screen.screened_logits(proj, x[None])[0]
    assert float(full[0, 17]) == float(full[0, 412]) and int(kernels.argmax(full)[0]) == 17
    assert torch.equal(kernels.argmax(got), kernels.argmax(full))
    assert torch.equal(lm_screen.screened(proj, x[None]).greedy[0], kernels.argmax(full))
    assert bool(torch.isfinite(got[0, [17, 412, 413]]).all())  # every near-maximum was computed exactly


def test_the_last_step_gives_each_rows_argmax_in_one_call():
    """``at_candidates``: the candidates' exact logits in rows of -inf, and each row's argmax as argmax over such a row
    returns it (first maximum, the first NaN before any number) for ordinary, tied, NaN and infinite rows; candidate
    lists that do not ascend within the vocabulary are refused."""
    proj = projection(random_blocks("Q8_0", 300, K, seed=12))
    blocks = proj.__dict__["_eyas_blocks"]
    x = rows(5, seed=13)
    x[1] = 0  # every candidate ties at 0
    x[2, 9] = float("nan")
    x[3, 4] = float("inf")
    full = full_logits(proj, x)
    for cand in (torch.tensor([0, 7, 120, 299]), torch.arange(300), torch.tensor([5]), torch.tensor([3, 4])):
        logits, greedy = BF16.at_candidates(x, blocks.data, 8, cand, 300)
        want = torch.full((5, 300), float("-inf"))
        want[:, cand] = full[:, cand]
        assert torch.equal(logits.view(torch.int32), want.view(torch.int32))  # the bits, NaN included
        assert torch.equal(greedy, want.argmax(-1)) and torch.equal(greedy, kernels.argmax(want))
    assert int(BF16.at_candidates(x, blocks.data, 8, torch.tensor([3, 4]), 300)[1][1]) == 3  # a tie: the first
    for bad in ([7, 3], [4, 4], [300], [-1]):
        with pytest.raises(RuntimeError, match="ascend within"):
            BF16.at_candidates(x, blocks.data, 8, torch.tensor(bad), 300)


@pytest.mark.parametrize("scale", [1e-36, 1e-38, 0.0])  # 127 / max |x| overflows float32; subnormal products; zeros
def test_rows_near_zero_keep_the_bound_and_the_argmax(scale):
    proj = projection(random_blocks("Q8_0", 500, K, seed=9))
    x = (rows(3, seed=10, outliers=1.0).float() * scale).to(torch.bfloat16)
    x[2] = rows(1, seed=11)[0]  # an ordinary row beside them
    packed = SCREEN.pack(proj.__dict__["_eyas_blocks"].data, K)
    approx, bound = SCREEN.approx(x, packed, 500)
    full = full_logits(proj, x)
    assert bool(((full - approx).abs() <= bound).all())
    assert torch.equal(kernels.argmax(lm_screen.screened_logits(proj, x[None])[0]), kernels.argmax(full))


def test_non_finite_rows_and_unsupported_projections_fall_back():
    proj = projection(random_blocks("Q8_0", 200, K, seed=1))
    x = rows(3, seed=2)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 7] = bad
        assert lm_screen.screened_logits(proj, y[None]) is None  # the caller computes every logit
    assert lm_screen.screened_logits(proj, x.float()[None]) is None  # float32 rows: the f32 kernel's numerics
    q4 = nn.Linear(K, 200, bias=False)
    q4.__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.from_numpy(random_blocks("Q4_1", 200, K)), qtype=3, k=K)
    assert lm_screen.screened_logits(q4, x[None]) is None
    biased = projection(random_blocks("Q8_0", 200, K, seed=1))
    biased.bias = nn.Parameter(torch.zeros(200), requires_grad=False)
    assert lm_screen.screened_logits(biased, x[None]) is None
    assert lm_screen.screened_logits(nn.Linear(K, 200, bias=False), x[None]) is None  # no blocks


def test_greedy_decoding_of_the_embedded_default_gives_the_unscreened_tokens(embedded_bf16, monkeypatch):
    """Plain and speculative greedy decoding (bf16 exact mode) read screened logits, and give the tokens the full
    logits give."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.models import native

    loaded, _ = embedded_bf16
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,10"))
    assert spec.exact
    monkeypatch.delitem(loaded.model.lm_head_proj.__dict__, "_eyas_screen", raising=False)  # built here, env on
    prompt = "Name three rivers in Europe and say where each one ends."
    screened: list[int] = []
    real = native.screened

    def spy(proj, x):
        out = real(proj, x)
        screened.append(out is not None and bool(torch.isinf(out.logits).any()))
        return out

    monkeypatch.setattr(native, "screened", spy)
    plain = spec.generate(prompt, speculate=False, max_new_tokens=48)
    fast = spec.generate(prompt, max_new_tokens=48)
    assert screened and all(screened), "greedy forwards did not take the screen"
    monkeypatch.setattr(native, "screened", lambda proj, x: None)  # every logit computed
    full = spec.generate(prompt, speculate=False, max_new_tokens=48)
    assert plain.token_ids == full.token_ids == fast.token_ids
    assert fast.steps < len(fast.token_ids) - 1  # drafts were accepted: trees went through the screen


def test_verification_reads_the_argmax_the_screen_found(embedded_bf16, monkeypatch):
    """Greedy verification of screened forwards takes each row's argmax from the screen (``ForwardOutput.greedy``)
    instead of scanning the logits again; with the screen off it scans them."""
    from eyas import decode
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.models import native

    loaded, _ = embedded_bf16
    spec = Speculator(loaded, DrafterSpec("default", tree="dynamic:4,3,10"))
    monkeypatch.delitem(loaded.model.lm_head_proj.__dict__, "_eyas_screen", raising=False)  # built here, env on
    scans: list[int] = []
    real = decode.kernels.argmax
    monkeypatch.setattr(decode.kernels, "argmax", lambda logits: scans.append(1) or real(logits))
    prompt = "Name three rivers in Europe and say where each one ends."
    fast = spec.generate(prompt, max_new_tokens=24)
    assert fast.steps > 0 and not scans
    monkeypatch.setattr(native, "screened", lambda proj, x: None)  # every logit computed, then scanned
    assert spec.generate(prompt, max_new_tokens=24).token_ids == fast.token_ids
    assert len(scans) == fast.steps


def test_sampling_reads_full_logits(embedded_bf16, monkeypatch):
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.models import native

    loaded, _ = embedded_bf16
    spec = Speculator(loaded, DrafterSpec("none"))
    calls: list[int] = []
    monkeypatch.setattr(native, "screened", lambda proj, x: calls.append(1))
    spec.generate("Hello", speculate=False, max_new_tokens=4, temperature=0.7, seed=1)
    assert not calls
    spec.generate("Hello", speculate=False, max_new_tokens=4)
    assert calls


def test_the_screen_serves_only_where_it_was_timed_faster(monkeypatch, tmp_path):
    from eyas.models import loading

    monkeypatch.setenv("EYAS_LM_SCREEN", "auto")
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "cache_root", lambda: tmp_path)
    for pays in (True, False):
        monkeypatch.setattr(lm_screen, "screen_pays", lambda screen, pays=pays: pays)
        proj = projection(random_blocks("Q8_0", 256, K, seed=3))
        assert (lm_screen.screened_logits(proj, rows(1, seed=4)[None]) is not None) == pays
    monkeypatch.undo()
    monkeypatch.setattr(loading, "cache_root", lambda: tmp_path)
    screen = lm_screen.ArgmaxScreen(projection(random_blocks("Q8_0", 256, K, seed=3)).__dict__["_eyas_blocks"])
    first = lm_screen.screen_pays(screen)  # timed, then cached per machine and shape
    (record,) = (tmp_path / "lm_screen").glob("*.json")
    assert json.loads(record.read_text())["screen"] == first and lm_screen.screen_pays(screen) == first


def test_bench_records_how_the_logits_were_computed():
    from types import SimpleNamespace

    from eyas.bench.speed import output_projection

    proj = projection(random_blocks("Q8_0", 256, K, seed=7))
    model = SimpleNamespace(lm_head_proj=proj)
    assert output_projection(model) is None  # no greedy forward asked yet
    lm_screen.screened_logits(proj, rows(1, seed=8)[None])
    assert output_projection(model) == "screened"
    q4 = nn.Linear(K, 200, bias=False)
    q4.__dict__["_eyas_blocks"] = GGUFBlocks(data=torch.from_numpy(random_blocks("Q4_1", 200, K)), qtype=3, k=K)
    lm_screen.screened_logits(q4, rows(1, seed=8)[None])
    assert output_projection(SimpleNamespace(lm_head_proj=q4)) == "full"
    assert output_projection(SimpleNamespace()) is None  # a backend without the native output projection
