"""Medusa's typical acceptance (Cai et al. 2024, arXiv 2401.10774, section 2.3.1).

LOSSY: see ``LOSSY_NOTE``. Use ``verify_sampling`` when the output must follow
the target distribution, and ``verify_greedy`` at temperature 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.types import Tree, VerifyOutput
from eyas.verify.paths import check_rows, deepest_passing_path

LOSSY_NOTE = (
    "Typical acceptance is LOSSY: it accepts any draft token the target finds "
    "'typical enough' and ends with the target's argmax, so the output "
    "distribution differs from the target's sampling distribution. It trades "
    "exactness for longer accepted runs; it is not speculative sampling."
)


@dataclass
class TypicalConfig:
    """Thresholds of typical acceptance (Medusa's defaults).

    A token x is acceptable when ``p(x) > min(posterior_threshold,
    posterior_alpha * exp(-H(p)))``. Medusa suggests ``posterior_alpha`` around
    ``sqrt(posterior_threshold)``.
    """

    posterior_threshold: float = 0.09  # hard threshold epsilon
    posterior_alpha: float = 0.3  # entropy-dependent threshold scale delta

    def __post_init__(self) -> None:
        if not 0.0 <= self.posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold must be in [0, 1], got {self.posterior_threshold}")
        if self.posterior_alpha < 0.0:
            raise ValueError(f"posterior_alpha must be >= 0, got {self.posterior_alpha}")


def verify_typical(
    tree: Tree,
    # [N, V] target logits; row i is the distribution of the token after node i
    logits: torch.Tensor,
    temperature: float,
    cfg: TypicalConfig | None = None,
) -> VerifyOutput:
    """Accept the longest root path of typical tokens (LOSSY, see ``LOSSY_NOTE``).

    Node i is acceptable when, with ``p = softmax(logits[parent(i)] / temperature)``
    and its entropy ``H(p)``, ``p(token_i) > min(posterior_threshold,
    posterior_alpha * exp(-H(p)))``. A node is accepted when it and all its
    ancestors are acceptable; the deepest accepted node wins (lowest index on
    ties, i.e. the first of equally long paths), so nothing below a rejected
    node is ever accepted. The final token is the target's argmax at the last
    accepted node, as in Medusa's fast path (it is deterministic, which is part
    of why the method is lossy).

    Entropy uses exact ``-sum p log p`` (``torch.special.entr``); Medusa's code
    adds 1e-5 inside the log, which changes thresholds only marginally.

    Raises:
        ValueError: if ``temperature <= 0`` (use ``verify_greedy``).
    """
    if temperature <= 0:
        raise ValueError(f"typical acceptance needs temperature > 0, got {temperature}; use verify_greedy")
    check_rows(tree, logits, "logits")
    cfg = cfg if cfg is not None else TypicalConfig()
    # [N, V]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    # [N] threshold for the children of each node
    entropy = torch.special.entr(probs).sum(dim=-1)
    threshold = (cfg.posterior_alpha * torch.exp(-entropy)).clamp_max(cfg.posterior_threshold)
    parents = tree.parents.clamp_min(0)
    # [N] probability of each node's token under its parent's distribution (root: ignored)
    p_token = probs[parents, tree.tokens.clamp_min(0)]
    path = deepest_passing_path(tree, p_token > threshold[parents])
    final = logits[path[-1]].argmax(dim=-1, keepdim=True)
    tokens = torch.cat([tree.tokens[path[1:]], final.to(tree.tokens.dtype)])
    return VerifyOutput(path=path, tokens=tokens)
