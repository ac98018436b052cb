"""EAGLE-1 training objective: feature regression plus token cross-entropy.

The head reads (embed(x[t+1]), f[t] + noise) and predicts f[t+1], the target's
final feature at the next position. Loss = SmoothL1(pred, f[t+1]) +
w_p * CE(target lm_head(pred), target distribution at t+1), on positions whose
next token is an assistant token (Li et al. 2024: w_p = 0.1, uniform input noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.drafters.eagle import EagleHead
from eyas.kv.static import KVCache
from eyas.train.eagle3 import shift_left
from eyas.train.features import FeatureBatch


@dataclass
class Eagle1LossConfig:
    p_weight: float = 0.1  # token cross-entropy weight
    v_weight: float = 1.0  # feature regression weight
    noise: float = 0.2  # uniform noise in [-noise/2, noise/2] added to the input features


class Eagle1Objective:
    taps: tuple[int, ...] = ()

    def __init__(self, head: EagleHead, target, cfg: Eagle1LossConfig | None = None) -> None:
        self.module = head
        self.target = target
        self.cfg = cfg or Eagle1LossConfig()

    def loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        head, cfg = self.module, self.cfg
        dt = head.fc.weight.dtype
        feats = batch.hidden.to(dt)  # [B, T, D]
        if head.training and cfg.noise:
            feats = feats + (torch.rand_like(feats) - 0.5) * cfg.noise
        with torch.no_grad():
            emb = self.target.embed(shift_left(batch.input_ids, 1)).to(dt)
        b, t = batch.input_ids.shape
        c = head.config
        cache = KVCache.empty(1, b, c.num_kv_heads, t, c.head_dim, dt, feats.device)
        pos = torch.arange(t, device=feats.device)[None].expand(b, t)
        pred = head(emb, feats, pos, cache, 0, None)  # [B, T, D] predicted f[t+1]
        want = shift_left(batch.hidden, 1).to(pred.dtype)
        m = shift_left(batch.loss_mask, 1, False)  # token x[t+2] is an assistant token
        n = m.sum().clamp(min=1)
        v_loss = (F.smooth_l1_loss(pred.float(), want.float(), reduction="none").mean(-1) * m).sum() / n
        w = self.target.lm_head_proj.weight.detach()
        logp = F.log_softmax((pred.to(w.dtype) @ w.T).float(), dim=-1)
        with torch.no_grad():
            p = torch.softmax((want.to(w.dtype) @ w.T).float(), dim=-1)
        p_loss = (-(p * logp).sum(-1) * m).sum() / n
        loss = cfg.v_weight * v_loss + cfg.p_weight * p_loss
        with torch.no_grad():
            acc = ((logp.argmax(-1) == shift_left(batch.target_tokens, 1)) & m).sum() / n
        return loss, {"loss": float(loss.detach()), "v_loss": float(v_loss.detach()),
                      "p_loss": float(p_loss.detach()), "acc0": float(acc)}
