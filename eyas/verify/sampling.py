"""Target logits -> sampling distributions, and token draws without host syncs.

``logits_to_probs`` is the single place where temperature, top-k and top-p are
applied; ``verify_sampling`` takes its output, so the draft is verified against
exactly the distribution that plain decoding would sample from.
"""

from __future__ import annotations

import torch

from eyas.types import SamplingParams


def logits_to_probs(
    # [..., V]
    logits: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, and return float32 probabilities.

    Args:
        logits: [..., V] raw scores; ``-inf`` entries are allowed (banned tokens).
        params: the sampling parameters. ``temperature == 0`` (greedy) returns
            the one-hot of the argmax (first index on ties), so sampling from the
            result and verifying against it reduce to greedy decoding.

    Returns:
        [..., V] float32, each row sums to 1.

    Top-k keeps every token whose logit is >= the k-th largest (ties at the
    k-th value are all kept, as in gpt-fast and vLLM). Top-p (nucleus) then keeps
    the smallest prefix of the tokens sorted by probability whose mass is
    >= ``top_p``; the most likely token is always kept.
    """
    if logits.ndim < 1:
        raise ValueError("logits must have a vocabulary dimension [..., V]")
    logits = logits.float()
    if params.greedy:
        return _one_hot_argmax(logits)
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = _mask_top_k(logits, min(params.top_k, logits.shape[-1]))
    if params.top_p < 1.0:
        logits = _mask_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [..., V] float32 one-hot of the argmax (first index on ties)."""
    probs = torch.zeros_like(logits)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set logits below the k-th largest of their row to -inf."""
    # [..., 1]
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the nucleus of mass ``top_p`` to -inf.

    Worked example: probs sorted = [0.5, 0.3, 0.15, 0.05], top_p = 0.7.
    Mass strictly before each token = [0, 0.5, 0.8, 0.95]; a token is dropped
    when the tokens before it already reach top_p (>= 0.7): keep {0.5, 0.3}.
    The first token has mass 0 before it, so it is always kept.
    """
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(
    # [..., V] non-negative; need not be normalised
    probs: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """Draw one token per row, proportionally to ``probs``, without a host sync.

    Returns:
        [...] long token ids.

    NOTE: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` i.i.d. selects i with
    probability ``p_i / sum(p)``: ``E_i / p_i ~ Exp(rate p_i)`` and the smallest
    of independent exponentials is the i-th with probability proportional to its
    rate. This is gpt-fast's ``multinomial_sample_one_no_sync``; unlike
    ``torch.multinomial`` it never syncs. Zero-probability tokens are masked to
    -1 so they can never win, even if a noise draw underflows to 0 (0 / 0 = nan
    and ``argmax`` would prefer the nan). Deterministic given the generator state.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    scores = (probs / noise).masked_fill(probs <= 0, -1.0)
    return scores.argmax(dim=-1)


def greedy(
    # [..., V]
    logits: torch.Tensor,
) -> torch.Tensor:
    """Greedy tokens [...]: the argmax of each row (first index on ties)."""
    return logits.argmax(dim=-1)
