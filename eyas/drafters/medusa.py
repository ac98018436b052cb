"""Medusa-1 heads (Cai et al. 2024, arXiv 2401.10774): K small heads on the target's last feature.

Head k (0-based) reads the target's final post-norm feature at position t and predicts the
token at t + k + 2 (the target's own lm_head predicts t + 1)::

    logits_k = lm_head_k(block_k(h_t)),   block = num_layers x (x + SiLU(Linear(D, D)(x)))

A draft tree is rooted at the last sampled token r (position t + 1), so a node at depth d sits
at position t + 1 + d and takes its token from head d - 1, whatever its parent is: Medusa heads
see no draft tokens, which is why one feature per step is all the drafter keeps.

Checkpoint layouts (FasterDecoding/Medusa's and vLLM's, read and written): eyas.formats.medusa.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.drafters.base import Drafter, TargetFeatures, register_drafter
from eyas.tree import DynamicTreeBuilder, DynamicTreeConfig, parse_choices, static_tree
from eyas.types import DraftOutput, SamplingParams, Tree

DEFAULT_TREE = "medusa_mc_sim_7b_63"  # Medusa's default choices (eyas.tree.presets)


@dataclass
class MedusaConfig:
    hidden_size: int  # D, the target's hidden size
    vocab_size: int  # V, the target's vocabulary
    num_heads: int = 4  # K: head k predicts the token k + 2 positions after its feature
    num_layers: int = 1  # residual blocks per head
    bias: bool = True  # block Linear bias (Medusa: always; vLLM: config medusa_fc_bias)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive int, got {v!r}")


class _Block(nn.Module):
    """num_layers residual steps x + SiLU(W x + b) (vLLM's ``ResidualBlock``)."""

    def __init__(self, d: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=bias) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = x + nn.functional.silu(lin(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads: ``blocks.{k}`` then ``lm_heads.{k}``."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.blocks = nn.ModuleList([_Block(d, cfg.num_layers, cfg.bias) for _ in range(cfg.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(d, v, bias=False) for _ in range(cfg.num_heads)])

    def head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] target features at t -> [..., V] logits of the token at t + k + 2."""
        return self.lm_heads[k](self.blocks[k](hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> [K, ..., V] logits of every head."""
        return torch.stack([self.head(k, hidden) for k in range(self.config.num_heads)])

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> MedusaHeads:
        """Medusa's init: each lm_head = the target's ([V, D]) and every block the identity.

        The reference zeroes only the block weights (its bias keeps nn.Linear's random init);
        zeroing the bias as well makes each head start exactly as the next-token predictor.
        """
        for blk, lm in zip(self.blocks, self.lm_heads, strict=True):
            lm.weight.copy_(weight)
            for lin in blk.layers:
                nn.init.zeros_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        return self


@torch.no_grad()
def target_lm_head_weight(target) -> torch.Tensor:
    """[V, D] output projection of a TargetModel, read through its ``lm_head`` (bias-free)."""
    d = target.config.hidden_size
    return target.lm_head(torch.eye(d, dtype=target.dtype, device=target.device)).T.clone()


def medusa_heads_for(target, num_heads: int = 4, num_layers: int = 1, init: str = "lm_head",
                     seed: int = 0) -> MedusaHeads:
    """Float32 heads for a TargetModel; init "lm_head" (Medusa's) or "random" (seeded)."""
    if init not in ("lm_head", "random"):
        raise ValueError(f"unknown Medusa init {init!r}; use 'lm_head' or 'random'")
    cfg = MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads, num_layers)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
        torch.manual_seed(seed)
        heads = MedusaHeads(cfg).to(target.device)
    return heads.init_from_lm_head(target_lm_head_weight(target).float()) if init == "lm_head" else heads


# ---- draft trees -------------------------------------------------------------------------------
class _StaticMedusaTree:
    """A choices-list tree; node (depth d, rank r) gets rank r of head d - 1's top-k."""

    def __init__(self, choices: list[list[int]], num_heads: int, device: torch.device) -> None:
        self.template = static_tree([c for c in choices if len(c) <= num_heads]).to(device)
        t = self.template
        self.max_nodes = t.num_nodes
        self.depth = len(t.topk_per_depth)
        self.width = max(t.topk_per_depth)
        self.node_head = t.depth[1:] - 1  # [N - 1] head of each non-root node
        self.node_rank = t.ranks[1:]  # [N - 1] its rank in that head's top-k

    def build(self, root: torch.Tensor, logp: torch.Tensor) -> Tree:
        """root [1] long, logp [K, V] -> Tree (no host sync)."""
        top = logp[: self.depth].topk(self.width, dim=-1).indices  # [depth, width]
        return self.template.with_tokens(torch.cat([root, top[self.node_head, self.node_rank]]))


class _DynamicMedusaTree:
    """EAGLE-2-style best-first tree by cumulative log-prob; depth d scores with head d - 1."""

    def __init__(self, cfg: DynamicTreeConfig) -> None:
        self.cfg = cfg
        self.builder = DynamicTreeBuilder(cfg)
        self.max_nodes = cfg.total_tokens + 1

    def build(self, root: torch.Tensor, logp: torch.Tensor) -> Tree:
        k, dev = self.cfg.top_k, root.device
        top = logp[: self.cfg.depth].topk(k, dim=-1)
        vals, idx = top.values.cpu(), top.indices.cpu()  # host sync: tree books live on CPU
        self.builder.start(root.cpu()[0], vals[0], idx[0])
        for d in range(1, self.cfg.depth):  # every frontier node gets the same children: head d's top-k
            self.builder.expand(vals[d].expand(k, k), idx[d].expand(k, k))
        return self.builder.finish().tree.to(dev)


def make_medusa_tree(spec: str | None, num_heads: int, device: torch.device | str = "cpu"):
    """Parse --tree: static[:PRESET|CHOICES] (default medusa_mc_sim_7b_63), chain[:K], dynamic[:k,d,total].

    Static trees are cut to num_heads levels; a dynamic depth may not exceed num_heads
    (head d - 1 drafts depth d).
    """
    spec = spec or f"static:{DEFAULT_TREE}"
    kind, _, arg = spec.partition(":")
    if kind == "static":
        return _StaticMedusaTree(parse_choices(arg or DEFAULT_TREE), num_heads, torch.device(device))
    if kind == "adaptive":
        raise ValueError(f"tree {spec!r}: adaptive trees size an EAGLE head's tree step by step (eyas.tree.budget); "
                         "Medusa heads take static[:PRESET|CHOICES], chain[:K] or dynamic[:top_k,depth,total]")
    try:
        nums = [int(x) for x in arg.split(",")] if arg else []
    except ValueError:
        raise ValueError(f"bad tree spec {spec!r}: chain:K and dynamic:top_k,depth,total take ints") from None
    if kind == "chain" and len(nums) <= 1:
        k = nums[0] if nums else num_heads
        return _StaticMedusaTree([[0] * d for d in range(1, k + 1)], num_heads, torch.device(device))
    if kind == "dynamic" and len(nums) <= 3:
        top_k = nums[0] if nums else 8
        depth = nums[1] if len(nums) > 1 else min(6, num_heads)
        if depth > num_heads:
            raise ValueError(f"dynamic tree depth {depth} exceeds the {num_heads} Medusa heads (head d - 1 "
                             f"drafts depth d); use depth <= {num_heads}, e.g. dynamic:{top_k},{num_heads}")
        total = nums[2] if len(nums) > 2 else min(48, top_k + (depth - 1) * top_k**2)
        return _DynamicMedusaTree(DynamicTreeConfig(top_k, depth, total))
    raise ValueError(f"unknown tree {spec!r} for Medusa; use static[:PRESET|CHOICES], chain[:K] "
                     f"or dynamic[:top_k,depth,total]")


# ---- the drafter --------------------------------------------------------------------------------
@register_drafter("medusa")
class MedusaDrafter(Drafter):
    """Medusa-1 drafting: one head forward per step, then a static or dynamic tree.

    Proposals are distinct top-k ranks of one distribution per depth (siblings never repeat a
    token), chosen deterministically, so ``DraftOutput.q`` is None: verification treats each
    draft as a point mass, which keeps rejection sampling lossless (see eyas.verify.rejection).
    """

    def __init__(self, target=None, path: Path | None = None, heads: MedusaHeads | None = None,
                 tree: str | None = None, target_model=None) -> None:
        self.target = target_model if target_model is not None else target.model
        if heads is None:
            if path is None:
                raise ValueError("the medusa drafter needs a heads directory: --drafter PATH")
            from eyas.formats.medusa import load_medusa  # (the format module imports this one)

            heads = load_medusa(Path(path), self.target.config, self.target.dtype).to(self.target.device)
        self.heads = heads
        self.policy = make_medusa_tree(tree, heads.config.num_heads, self.target.device)
        self.max_nodes = self.policy.max_nodes
        self.logp: torch.Tensor | None = None

    def start(self, max_slots: int) -> None:
        self.logp = None

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, feats: TargetFeatures) -> None:
        """Only the newest feature matters: it sits right before the next tree's root."""
        w = self.heads.lm_heads[0].weight
        h = feats.hidden[-1].to(w.device, w.dtype)  # [D]
        # [K, V] log-probs; row d - 1 drafts the tree's depth d
        self.logp = torch.log_softmax(self.heads(h).float(), dim=-1).to(self.target.device)

    @torch.inference_mode()
    def propose(self, history: torch.Tensor, sampling: SamplingParams, generator=None) -> DraftOutput:
        if self.logp is None:
            raise RuntimeError("MedusaDrafter.propose before start() + extend(): no target feature yet")
        return DraftOutput(tree=self.policy.build(history[-1:], self.logp))
