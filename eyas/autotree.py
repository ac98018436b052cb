"""A draft tree sized to this machine at load: measure step costs once, cache them, choose a tree.

``size_tree_for(target, spec)`` is the one entry point (eyas.load calls it when no --tree is given):

1. the head's acceptance profile comes with the head (``HEAD/profile.json``, written by
   ``scripts/acceptance_profile.py``); a head without one keeps its recommended tree;
2. the machine's costs are measured once and cached under ``$EYAS_CACHE/tree_costs/`` (default
   ``~/.cache/eyas``), keyed by the machine (CPU, flags, threads, torch, kernel sources), target, dtype, exact mode and
   head: a verify step at each width (SpecDecoder over a fixed junk tree of that many nodes: the
   forward, verification and commit exactly as decoding runs them) and the drafting (whole steps with
   the real drafter, hybrid or head alone, on three dynamic trees, less the junk step of the same
   width, fitted to ``eyas.tree.sizing.DraftCost``: extending the head after each verify included);
3. ``eyas.tree.sizing.choose_tree`` picks top-k, depth and total nodes maximising predicted tokens/s;
4. ``eyas.tree.sizing.step_budget`` prices that tree's rows and levels into an adaptive tree
   (``--tree adaptive:...``, eyas.tree.budget), which sizes each step from the head's confidence.

``EYAS_AUTO_TREE=0`` turns it off (the head's recommended tree is used, as before); ``EYAS_ADAPTIVE_TREE=0``
keeps step 3's fixed tree.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eyas import kernels
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.base import Drafter
from eyas.drafters.eagle import head_compute_dtype
from eyas.drafters.eagle3 import Eagle3Drafter
from eyas.drafters.hybrid import HybridDrafter
from eyas.drafters.loading import DrafterSpec, default_drafter_name, detect_kind, shipped_head
from eyas.formats.eagle3 import load_eagle3
from eyas.kv.prefix import PrefixCacheConfig, PrefixStore
from eyas.models import gguf_tuning
from eyas.models.exact import exact_by_default
from eyas.models.gguf_blocks import attached_blocks
from eyas.models.int8_rows import int8_head_ready
from eyas.models.loading import LoadedTarget, cache_root
from eyas.models.machine_cache import cached_json, machine_key
from eyas.models.packed import packed_weights, skinny_gemm_ready
from eyas.notes import one_time_note
from eyas.tree import make_tree
from eyas.tree.sizing import (
    ADAPTIVE_MAX_TOTAL,
    AcceptanceProfile,
    DraftCost,
    TreeChoice,
    choose_tree,
    step_budget,
)
from eyas.types import DraftOutput

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # verify widths measured (nodes, root included)
CONTEXT = 160  # prompt tokens before the timed steps (a typical chat prompt)
# environment switches that send drafting down slower paths (eyas.drafters.head_step, eyas.drafters.head_kernels)
DRAFT_SWITCHES = ("EYAS_HEAD_STEP", "EYAS_HEAD_FAST")


class JunkTree(Drafter):
    """Proposes the same ``width``-node binary tree of fixed random tokens every step (timing only)."""

    def __init__(self, width: int, vocab: int) -> None:
        self.max_nodes = width
        g = torch.Generator().manual_seed(width)
        self.tokens = torch.randint(0, vocab, (width,), generator=g)
        self.parents = (torch.arange(width) - 1) // 2  # node i hangs under (i - 1) // 2; the root's is -1

    def propose(self, history, sampling, generator=None) -> DraftOutput:
        tokens = torch.cat([history[-1:], self.tokens[1:].to(history.device)])
        return DraftOutput(tree=make_tree(tokens, self.parents.to(history.device), validate=False))


def measure_step_costs(model, exact: bool, widths=WIDTHS, steps: int = 12, rounds: int = 5) -> dict[int, float]:
    """Seconds per decoding step verifying a tree of w nodes, for each w: the narrowest width's median step, plus
    the median over ``rounds`` of w's median step less the narrowest's timed right before it (``steps`` steps each),
    made non-decreasing in w.

    Paired differences, as the drafting's: a slow spell of the machine falls on both sides of a pair. Timing each
    width once a pass (the former fit) let one spell set a width's cost: on the Ice Lake VM, widths 3-8 all at
    33.6 ms against 24.7 for 1 (verify forwards of 19.5 / 21.2 / 28.2 ms at 1 / 4 / 8 nodes in decoding half an
    hour before), which priced every verify row at 0.27-0.69 tokens and cut the tree to top-k 2. Medians, not the
    fastest steps: the fastest of 8 caught some widths well below their typical cost (3 nodes at 6.7 ms against
    7.3 for 2 on the Zen 5 VM) and made the sizer's predictions run ~10 % high. Five rounds, not three (~5 s more,
    once per machine and build): a median of three let a spell over two rounds through, as in one table of eleven on
    the Zen 4 VM (2 and 4 nodes ~2x their usual cost over one; docs/results/tree_costs_zen4_noisy.json), whose
    trees replay 3 % slower on the usual table (scripts/adaptive_replay.py --policy-costs). A wider tree never
    costs less than a narrower one (it does the same work and more).
    """
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(model.device)
    store = _prompt_store(exact)

    def median_step(width: int) -> float:
        drafter = JunkTree(width, model.config.vocab_size) if width > 1 else None
        dec = SpecDecoder(model, drafter, DecodeConfig(max_new_tokens=steps + 2, exact=exact), prefix=store)
        return statistics.median(_step_times(dec, prompt))

    narrow = min(widths)
    median_step(narrow)  # warm-up, not kept
    base: list[float] = []
    diffs: dict[int, list[float]] = {w: [] for w in widths if w != narrow}
    for _ in range(rounds):
        for w in diffs:
            base.append(median_step(narrow))
            diffs[w].append(median_step(w) - base[-1])
        if not diffs:
            base.append(median_step(narrow))
    out, floor, b = {}, 0.0, statistics.median(base)
    for w in sorted(widths):
        floor = out[w] = max(b + (statistics.median(diffs[w]) if w in diffs else 0.0), floor)
    return out


# dynamic trees (top_k, depth, total) whose drafting is timed: chains and the top-k 2-3 trees a CPU's sizing picks
# from, so that the fit holds where it is used
DRAFT_TREES = ((1, 1, 1), (1, 3, 3), (2, 2, 3), (2, 3, 3), (3, 3, 3))


def measure_draft_cost(head: torch.nn.Module, model, exact: bool, hybrid: bool = False, steps: int = 24,
                       rounds: int = 6) -> DraftCost:
    """Fit DraftCost to whole decoding steps with the real drafter, less a junk tree's step of the same width.

    A step's drafting is what the drafter adds to a step: extending the head over the accepted tokens right
    after a verify forward (its weights then come from DRAM), the tree levels, the books, for the hybrid drafter
    lookup and the merge, and what all that evicts from the caches that the next verify forward then reads
    from DRAM again. Timing the drafter's own calls (propose and extend, in real steps) misses the last part.
    Each of ``rounds`` passes times every tree's steps right after a junk tree's of the same width (``steps``
    each), and a tree's drafting is the median over passes of those paired differences of medians, so a slow
    spell of the machine falls on both sides; then a non-negative least-squares fit over the five trees.

    Measured on the Zen 5 VM with the shipped hybrid drafter, a level of a top-k 2 tree: 0.60-0.65 ms in three
    fits (16 s each); the drafter's own calls 0.50-0.55 ms; the former fit (three trees after one another, each
    difference of two 48-step medians) 0.35-0.65 ms from run to run, and its 0.42 ms made the sizer pick
    ``dynamic:2,3,3``, which interleaved runs on tuning questions measured 2-6 % slower than ``3,2,3``.
    """
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(model.device)
    cfg = DecodeConfig(max_new_tokens=steps + 2, exact=exact)
    widths = {total + 1 for _, _, total in DRAFT_TREES}
    store = _prompt_store(exact)
    junk = {w: SpecDecoder(model, JunkTree(w, model.config.vocab_size), cfg, prefix=store) for w in widths}
    decoders = {}
    for k, depth, total in DRAFT_TREES:
        drafter = Eagle3Drafter(target_model=model, head=head, tree=f"dynamic:{k},{depth},{total}")
        decoders[k, depth, total] = SpecDecoder(model, HybridDrafter(head_drafter=drafter) if hybrid else drafter, cfg,
                                                prefix=store)
    diffs: dict = {tree: [] for tree in DRAFT_TREES}
    for _ in range(rounds):
        for tree, dec in decoders.items():
            base = statistics.median(_step_times(junk[tree[2] + 1], prompt))
            diffs[tree].append(statistics.median(_step_times(dec, prompt)) - base)
    rows = [(depth - 1, (depth - 1) * k) for k, depth, _ in DRAFT_TREES]
    return fit_draft_cost(rows, [statistics.median(diffs[t]) for t in DRAFT_TREES])


def fit_draft_cost(rows: list[tuple[int, int]], drafting: list[float]) -> DraftCost:
    """Least squares of ``drafting[i] ~ per_step + levels_i * per_level + nodes_i * per_node`` with every cost >= 0.

    rows[i] = (levels_i, nodes_i): expansions after the root's and nodes fed in them. Exact over the 2**3 subsets of
    costs left free (the others pinned at 0): the feasible one with the least squared error; per_step at least 10 us.
    """
    x = torch.tensor([[1.0, lv, nd] for lv, nd in rows], dtype=torch.float64)
    y = torch.tensor(drafting, dtype=torch.float64)
    best, best_err = torch.zeros(3, dtype=torch.float64), float(y.square().sum())
    for free in ((0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)):
        sol = torch.linalg.lstsq(x[:, free], y[:, None]).solution[:, 0]
        if bool((sol < 0).any()):
            continue
        coef = torch.zeros(3, dtype=torch.float64)
        coef[list(free)] = sol
        err = float((x @ coef - y).square().sum())
        if err < best_err - 1e-18:
            best, best_err = coef, err
    return DraftCost(per_step=max(float(best[0]), 1e-5), per_level=float(best[1]), per_node=float(best[2]))


def _prompt_store(exact: bool) -> PrefixStore | None:
    """The timing runs' one prompt prefilled once, then copied (exact mode's prefix cache: the same cache bits): each
    run's untimed prefill of CONTEXT tokens took ~60 % of the sizing's ~58 s on the Intel Xeon 6/207.
    """
    return PrefixStore(PrefixCacheConfig(max_bytes=256 << 20)) if exact else None


def _step_times(dec: SpecDecoder, prompt: torch.Tensor) -> list[float]:
    """Seconds of each decoding step but the first (warm-up); prefill is not a step."""
    times, last = [], None
    for _ in dec.generate(prompt):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times[1:]


def tree_cost_key(target: LoadedTarget, head_dir: Path, exact: bool, hybrid: bool) -> dict:
    """What the step and draft costs depend on beyond the machine (CPU, flags, threads, torch, kernel sources:
    eyas.models.machine_cache.machine_key).
    """
    model = target.model
    # the HF backend's costs apart from the native model's (a key the native one never has: its tables stay valid)
    backend = {} if isinstance(model, torch.nn.Module) else {"backend": type(model).__name__}
    # a float32 model's forwards through its decode plan (eyas.models.decode_plan) cost less at every width; bf16
    # models had their plan before the key named it (their tables stay valid)
    plan = model.dtype == torch.float32 and getattr(model, "decode_plan", lambda: None)() is not None
    backend = {**backend, "f32_decode_plan": True} if plan else backend
    # the head's compiled paths switched off (a one-process A/B's slower arm): their own tables, a key field only
    # when off, so the default's tables stay valid (one timed under EYAS_HEAD_STEP=0 once stood as the default's)
    backend.update({name.lower(): "0" for name in DRAFT_SWITCHES if os.environ.get(name, "1") == "0"})
    return machine_key(
        target=target.name, dtype=str(model.dtype), device=str(model.device), exact=exact, head=head_dir.name,
        # the head's shape (layers, MLP width, draft vocabulary: its config.json), so a head replaced in place by a
        # larger one (a second layer, a wider MLP) is timed again; retrained weights of the same shape cost the same
        head_config=head_config_digest(head_dir),
        widths=list(WIDTHS), hybrid=hybrid, draft_fit="paired-6x24-nnls5", step_fit="paired-5x12-monotone",
        # exact mode's compiled tree attention (eyas.kernels) or per-node mirrors: different costs by width
        path_kernel=exact and getattr(model, "path_kernel", lambda: None)() is not None,
        # bf16 projections on prepacked weights (eyas.models.packed) are several times cheaper at few rows
        packed=packed_weights(),
        # float32 projections at few rows through the streaming kernel: verify widths 2-16 cost far less
        skinny=model.dtype == torch.float32 and skinny_gemm_ready(),
        # bf16 projections read from GGUF blocks (eyas.models.gguf_blocks): cheaper at one row, dearer wide
        gguf_blocks=sum(attached_blocks(m) is not None for m in model.modules()),
        gguf_tuning=asdict(gguf_tuning.active()),  # the block kernel's per-CPU choices (eyas.models.gguf_tuning)
        head_q8=os.environ.get("EYAS_HEAD_Q8", "1") != "0",  # the head's Q8_0 weights
        # greedy steps' output projection screened (eyas.models.lm_screen): a verify row costs less
        lm_screen=exact and model.dtype == torch.bfloat16 and kernels.lm_screen() is not None,
        # the head's int8 projections (eyas.models.int8_rows): a tree level costs about half
        head_int8=model.device.type == "cpu" and int8_head_ready(head_compute_dtype(model)),
        # int8 projections cost differently by width (eyas.models.quant): a separate table
        quantized=sorted({type(m).__name__ for m in model.modules() if hasattr(m, "scales")}), **backend)


def machine_costs(target: LoadedTarget, head_dir: Path, exact: bool, hybrid: bool = False) -> tuple[dict, DraftCost]:
    """(step seconds by width, DraftCost) for this machine: from the cache (``$EYAS_CACHE/tree_costs``), else
    measured and cached. ``hybrid``: the drafting measured is the hybrid drafter's (the head plus lookup and the merge).
    """
    cache_dir = cache_root() / "tree_costs"

    def measure() -> dict:
        one_time_note("sizing the draft tree to this machine: timing verify steps by width",
                      f"~35 s on 2 cores, cached under {cache_dir}")
        cost = measure_step_costs(target.model, exact)
        head = load_eagle3(head_dir, target.model.config, target.model.dtype)
        return {"step_seconds": cost, "draft": asdict(measure_draft_cost(head, target.model, exact, hybrid=hybrid))}

    d = cached_json("tree_costs", tree_cost_key(target, head_dir, exact, hybrid), measure, cache_dir)
    return {int(w): s for w, s in d["step_seconds"].items()}, DraftCost(**d["draft"])


def head_config_digest(head_dir: Path) -> str:
    """sha256 (first 16 hex digits) of the head's config.json, or "" where it has none."""
    f = head_dir / "config.json"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.exists() else ""


def weights_digest(head_dir: Path) -> str:
    """sha256 (first 16 hex digits) of the head's weight files: a profile belongs to one set of weights."""
    h = hashlib.sha256()
    for f in sorted(head_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def hybrid_extra_tau(head_dir: Path) -> dict[int, float] | None:
    """τ the hybrid drafter's lookup adds to the head's tree, by nodes (profile.json ``hybrid_extra_tau``)."""
    f = head_dir / "profile.json"
    extra = json.loads(f.read_text()).get("hybrid_extra_tau") if f.exists() else None
    return {int(n): float(t) for n, t in extra.items()} if extra else None


def load_profile(head_dir: Path) -> AcceptanceProfile | None:
    """The head's profile.json, or None when it has none or it was measured for other weights (a retrained head)."""
    f = head_dir / "profile.json"
    if not f.exists():
        return None
    d = json.loads(f.read_text())
    if d.get("weights") not in (None, weights_digest(head_dir)):
        print(f"eyas: {f} was measured for other weights; using the head's recommended tree "
              "(re-run scripts/acceptance_profile.py)", file=sys.stderr)
        return None
    tree_tau = {tuple(int(x) for x in k.split(",")): v for k, v in d.get("tree_tau", {}).items()}
    return AcceptanceProfile(d["rank_accept"], tree_tau=tree_tau or None)


def head_dir_of(target: LoadedTarget, spec: DrafterSpec) -> Path | None:
    """The EAGLE-3 head directory a drafter spec uses (default, a path, or hybrid's head), else None."""
    name = spec.name
    if name == "default":
        name = default_drafter_name(target)
    if name == "hybrid":
        head = spec.options.get("head")
        p = Path(head).expanduser() if head is not None else shipped_head(target.name)
    else:
        p = Path(name).expanduser()
    return p if p is not None and p.is_dir() and detect_kind(p) == "eagle3" else None


def size_tree_for(target: LoadedTarget, spec: DrafterSpec, exact: bool | None = None,
                  max_nodes: int = 32) -> TreeChoice | None:
    """The tree to use for ``spec`` on this machine, or None to keep the spec as it is.

    None when --tree was given (it overrides), when ``EYAS_AUTO_TREE=0``, or when the drafter is
    not an EAGLE-3 head with a ``profile.json``. ``exact``: None = eyas.load's default (``exact_by_default``).
    """
    if spec.tree is not None or os.environ.get("EYAS_AUTO_TREE", "1") == "0":
        return None
    head_dir = head_dir_of(target, spec)
    profile = load_profile(head_dir) if head_dir is not None else None
    if profile is None:
        return None
    exact = exact_by_default(target.model) if exact is None else exact
    name = default_drafter_name(target) if spec.name == "default" else spec.name
    cost, draft = machine_costs(target, head_dir, exact, hybrid=name == "hybrid")  # timed as it will run
    # lookup's extra tau (profile.json) for an explicit --drafter hybrid only; for the shipped head it is small
    # (0.03-0.07 tau at 5-17 nodes on tuning questions) and the default's tree is sized on the head's profile
    extra = hybrid_extra_tau(head_dir) if spec.name == "hybrid" else None
    choice = choose_tree(cost, draft, profile, max_nodes=max_nodes, extra_tau=extra)
    if os.environ.get("EYAS_ADAPTIVE_TREE", "1") != "0":  # sized step by step at the fixed tree's prices
        choice.budget = step_budget(choice, cost, draft, profile, max_total=adaptive_max_total(choice, max_nodes))
    return choice


def adaptive_max_total(choice: TreeChoice, max_nodes: int) -> int:
    """Most draft tokens an adaptive step may keep: ``ADAPTIVE_MAX_TOTAL``, or twice the fixed tree where rows are
    cheap enough for it to be larger (a GPU: the sizer picks trees of 32 nodes there), within ``max_nodes``.
    """
    return min(max(ADAPTIVE_MAX_TOTAL, 2 * choice.total_tokens), max_nodes - 1)
