"""Target features for drafter training: what every objective consumes.

A ``FeatureBatch`` holds, for B tokenized conversations padded on the right to
T tokens, the target's own view of every position: the final post-norm feature
(EAGLE-1, Medusa), the residual stream entering the tap layers (EAGLE-3) and
the target's greedy next token. Logits are not stored (B x T x V is too big):
objectives recompute what they need with ``target.lm_head`` on ``hidden``,
restricted to the vocabulary they draft in.

Features come from a live target (``TargetFeaturizer``, online) or from a
cache on disk written by the same code (``eyas.train.cache``, offline).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class FeatureBatch:
    # [B, T] long, token ids (right-padded with 0)
    input_ids: torch.Tensor
    # [B, T] bool, True where a real token sits (False on padding)
    attention_mask: torch.Tensor
    # [B, T] bool, True where the token at t + 1 is an assistant token to learn
    loss_mask: torch.Tensor
    # [B, T, D] target final feature after the last norm at each position
    hidden: torch.Tensor
    # [B, T, L, D] residual entering each tap layer (L = len(tap_layers)); L = 0 when none
    taps: torch.Tensor
    # [B, T] long, the target's greedy prediction of the token at t + 1 where loss_mask is True (0 elsewhere:
    # a vocabulary projection over every prompt position would cost as much as a quarter of the forward)
    target_tokens: torch.Tensor

    def to(self, device, dtype: torch.dtype | None = None) -> FeatureBatch:
        f = (lambda x: x.to(device)) if dtype is None else (lambda x: x.to(device, dtype))
        return FeatureBatch(
            input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device),
            loss_mask=self.loss_mask.to(device), hidden=f(self.hidden), taps=f(self.taps),
            target_tokens=self.target_tokens.to(device),
        )


class TargetFeaturizer:
    """Runs a frozen native target over padded batches and returns FeatureBatch."""

    def __init__(self, target, tap_layers: tuple[int, ...] = ()) -> None:
        self.target = target  # TargetModel (NativeLlama)
        self.tap_layers = tuple(tap_layers)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> FeatureBatch:
        """input_ids, attention_mask, loss_mask: [B, T] -> FeatureBatch (features in the target dtype)."""
        t = self.target
        dev = t.device
        ids = input_ids.to(dev)
        b, n = ids.shape
        cache = t.new_cache(b, n)
        pos = torch.arange(n, device=dev)[None].expand(b, n)
        none = torch.zeros(0, dtype=torch.long, device=dev)  # no full [B, T, V] logits: argmax in chunks
        with attention_backends(dev):
            out = t.forward(ids, pos, cache, 0, taps=self.tap_layers, logits_idx=none, causal=True)
        if self.tap_layers:
            taps = torch.stack([out.taps[i] for i in self.tap_layers], dim=2)
        else:
            taps = out.hidden.new_zeros(b, n, 0, out.hidden.shape[-1])
        lm = loss_mask.to(dev)
        tokens = torch.zeros(b * n, dtype=torch.long, device=dev)  # [B * T]
        rows = lm.flatten().nonzero()[:, 0]  # one wait for the device (x[lm] and tokens[lm] = would wait twice)
        tokens[rows] = greedy_tokens(t, out.hidden.flatten(0, 1)[rows])
        tokens = tokens.view(b, n)
        # the target's forward runs in inference mode; clones are ordinary tensors autograd may save
        return FeatureBatch(
            input_ids=ids, attention_mask=attention_mask.to(dev), loss_mask=lm,
            hidden=out.hidden.clone(), taps=taps.clone(), target_tokens=tokens.clone(),
        )


def attention_backends(device: torch.device):
    """On a GPU, SDPA's flash and memory-efficient kernels only (then math). The target's pass over a batch padded
    on the right is causal from slot 0, so it gives SDPA no mask (``causal=True``: with an explicit [B, 1, T, T]
    mask the flash kernels cannot serve); and SDPA took cuDNN's attention there, ~2 ms of host time a call in a
    training step on an H200 (docs/results/train_profile_gpu10.txt: a graph planned per new [B, T] shape). A no-op
    elsewhere.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def greedy_tokens(target, hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[..., D] final features -> [...] argmax of the target's logits, chunked over rows."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.cat([target.lm_head(flat[i : i + chunk]).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    return out.view(hidden.shape[:-1])
