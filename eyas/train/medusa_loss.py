"""Medusa-1 training objective: frozen target, trainable heads, weighted next-next-token CE.

Head k (0-based) reads the target's feature at position t and learns the token at t + k + 2
(Cai et al. 2024, arXiv 2401.10774, "Medusa-1: frozen backbone": loss = sum_k lambda_k * CE_k,
lambda_k a power of 0.8; here head k weighs decay**k. FasterDecoding/Medusa ``train.py`` pairs
``logits[k, :, : -(2 + k)]`` with ``labels[..., 2 + k :]``).

Index maths for one row of T tokens, with n = T - k - 2::

    features   hidden[0 .. n-1]              positions t
    labels     input_ids[k+2 .. T-1]         the tokens at t + k + 2
    learned    loss_mask[k+1 .. T-2]         loss_mask[s] = "token s + 1 is an assistant token"
    greedy     target_tokens[k+1 .. T-2]     the target's own prediction of token t + k + 2

Worked example, T = 6, k = 0: features h0..h3 learn x2..x5, masked by loss_mask[1..4], and are
scored against target_tokens[1..4] (the target's argmax at t + 1, i.e. its guess of x[t + 2]).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.drafters.medusa import MedusaHeads, medusa_heads_for
from eyas.formats.medusa import save_medusa
from eyas.train.features import FeatureBatch


@dataclass
class MedusaLossConfig:
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    decay: float = 0.8  # head k's loss weight is decay**k (Medusa's lambda_k)
    init: str = "lm_head"  # "lm_head": each head starts as the target's lm_head (Medusa); "random"
    layout: str = "vllm"  # checkpoint layout save() writes: "vllm" or "medusa"

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"MedusaLossConfig.decay must be in (0, 1], got {self.decay}")
        if self.layout not in ("vllm", "medusa"):
            raise ValueError(f"MedusaLossConfig.layout must be 'vllm' or 'medusa', got {self.layout!r}")


class MedusaObjective:
    """Trains ``module`` (MedusaHeads, float32) on FeatureBatch features of a frozen target."""

    def __init__(self, target, cfg: MedusaLossConfig | None = None, target_name: str = "",
                 heads: MedusaHeads | None = None) -> None:
        self.cfg = cfg or MedusaLossConfig()
        c = self.cfg
        if heads is None:
            heads = medusa_heads_for(target, c.num_heads, c.num_layers, c.init)
        self.module = heads
        self.module.float().train().requires_grad_(True)
        self.weights = [c.decay**k for k in range(self.module.config.num_heads)]
        self.target_name = target_name

    def loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted CE over every head; logs per-head loss and top-1 agreement with the target.

        Returns (scalar float32 loss with grad, {"loss", "head{k}_loss", "head{k}_acc",
        "head{k}_tokens"}); ``head{k}_acc`` is the fraction of learned positions where head k's
        argmax equals the target's greedy token there.
        """
        b, t = batch.input_ids.shape
        if batch.hidden.shape[:2] != (b, t):
            raise ValueError(f"hidden must be [B, T, D] = [{b}, {t}, D], got {tuple(batch.hidden.shape)}")
        w = self.module.lm_heads[0].weight
        total = w.sum() * 0.0  # a zero that keeps the graph when no head has a learned position
        stats = []  # per head: [loss, correct, count]; read back with one host sync at the end
        for k, weight in enumerate(self.weights):
            ce, correct, count = self._head_terms(batch, k)
            if ce is not None:
                total = total + weight * ce
            stats.append(torch.stack([ce.detach() if ce is not None else w.new_zeros(()), correct, count]))
        values = torch.stack(stats).tolist()  # host sync: logging
        logs: dict[str, float] = {"loss": float(total.detach())}
        for k, (ce, correct, count) in enumerate(values):
            logs[f"head{k}_loss"] = ce
            logs[f"head{k}_acc"] = correct / count if count else 0.0
            logs[f"head{k}_tokens"] = count
        return total, logs

    def _head_terms(self, batch: FeatureBatch, k: int):
        """(mean CE or None, correct count, position count) of head k, all float32 tensors."""
        t = batch.input_ids.shape[1]
        n = t - k - 2  # positions whose label t + k + 2 is inside the row
        w = self.module.lm_heads[0].weight
        zero = w.new_zeros((), dtype=torch.float32)
        if n <= 0:
            return None, zero.detach(), zero.detach()
        # [B, n] learned positions: the label is a real assistant token
        mask = batch.loss_mask[:, k + 1 : k + 1 + n].bool() & batch.attention_mask[:, k + 2 :].bool()
        feats = batch.hidden[:, :n][mask].to(w.device, torch.float32)  # [M, D]
        labels = batch.input_ids[:, k + 2 :][mask].to(w.device)  # [M]
        greedy = batch.target_tokens[:, k + 1 : k + 1 + n][mask].to(w.device)  # [M]
        count = torch.tensor(float(labels.shape[0]), device=w.device)
        if labels.shape[0] == 0:
            return None, zero.detach(), count
        logits = self.module.head(k, feats).float()  # [M, V]
        ce = torch.nn.functional.cross_entropy(logits, labels)
        correct = (logits.detach().argmax(-1) == greedy).float().sum()
        return ce, correct, count

    def save(self, out_dir: str | Path) -> Path:
        """Export the heads with ``save_medusa`` in ``cfg.layout``; returns the directory."""
        return save_medusa(self.module, out_dir, layout=self.cfg.layout, target_name=self.target_name)
