"""Shared data types and the dimension glossary.

Dimension glossary (used in every shape comment in eyas):

    B  batch                     T  new tokens in one forward
    S  cache slots (keys)        K  draft length (chain)
    N  tree nodes, root included P  root-to-leaf paths of a tree
    L  longest path length       V  vocabulary size
    Vd draft vocabulary size     D  hidden size
    H  attention heads           Hk key/value heads
    Dh head dim

A *tree* always includes its root as node 0. The root is the token that was
sampled last (the bonus token of the previous step, or the first token after
prefill): it is known but not yet in the target's KV cache. Nodes are in
topological order (a parent precedes its children), so node i's depth is
``depth[parents[i]] + 1`` and ``parents[0] == -1``. A chain of K drafts is the
tree whose node i has parent i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Sentinel for "no token" in padded token tensors (as vLLM's PLACEHOLDER_TOKEN_ID).
PAD_ID = -1


@dataclass
class Tree:
    """A token tree to verify in one target forward.

    Built by ``eyas.tree`` from parents + tokens; all fields live on one device.
    """

    # [N] token id of each node (node 0 = root)
    tokens: torch.Tensor
    # [N] parent node index, -1 for the root
    parents: torch.Tensor
    # [N] depth of each node (root = 0); the node's position is prefix_len + depth
    depth: torch.Tensor
    # [N, N] bool, mask[i, j] = node j is node i or one of its ancestors
    mask: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> Tree:
        """This tree on ``device``: itself when it is there already (draft books are built on the host)."""
        if self.tokens.device == torch.device(device):
            return self
        return Tree(self.tokens.to(device), self.parents.to(device), self.depth.to(device), self.mask.to(device))


@dataclass
class DraftOutput:
    """What a drafter proposes for one step.

    ``q`` holds, for every non-root node, the distribution its token was drawn
    from (over the target vocabulary). ``None`` means the drafter chose its
    tokens deterministically (argmax, top-k, n-gram lookup); verification then
    treats each proposal as a point mass, which is lossless for distinct
    sibling tokens.
    """

    tree: Tree
    # [N, V] float, proposal distribution of each node's token (row 0 unused), or None
    q: torch.Tensor | None = None


@dataclass
class VerifyOutput:
    """Result of verifying one tree.

    ``path`` lists the accepted nodes from the root; ``tokens`` are the new
    tokens the step emits: the accepted draft tokens (nodes ``path[1:]``) and
    then one token sampled from the target (the bonus or recovered token).
    """

    # [A + 1] long, accepted node indices starting with the root (0)
    path: torch.Tensor
    # [A + 1] long, new tokens: tokens of path[1:] followed by the target's own token
    tokens: torch.Tensor

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (A), not counting the target's own token."""
        return int(self.path.shape[0]) - 1


@dataclass
class SamplingParams:
    """How the target's next-token distribution is shaped.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Seeds torch.Generator takes without overflow on every route: a signed 64-bit integer (vLLM's range).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class RequestSettings:
    """What one request asks for, typed once where it is parsed and carried unchanged to the decoder.

    The server builds it from an HTTP body (``eyas.serving.protocol``) and passes it through the
    engine and ``BatchDecoder.add`` to ``Speculator.decoder(settings=...)``. Stop *strings* act on
    text, so decoding ignores them; the incremental detokeniser (``eyas.detok``) applies them.
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None: unseeded sampling
    speculate: bool = True  # False: plain decoding for this request, whatever the drafter
    stop: tuple[str, ...] = ()  # stop strings (non-empty); the text ends before the first one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty (an empty one would end every generation at once)")


def mean_accepted(accepted: int, steps: int) -> float:
    """tau, tokens per target step after prefill: 1 + accepted / steps (vLLM's definition); 1 before any step."""
    return 1.0 + accepted / steps if steps else 1.0


@dataclass
class StepStats:
    """Running acceptance statistics of one generation."""

    steps: int = 0  # target forwards after prefill
    drafted: int = 0  # draft tokens proposed (tree nodes minus roots)
    accepted: int = 0  # draft tokens accepted
    # accepted_per_pos[i] = steps in which the (i+1)-th draft token along the path was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        while len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos.append(0)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted(self) -> float:
        return mean_accepted(self.accepted, self.steps)
