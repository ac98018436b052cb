"""EAGLE-3 training objective: training-time test (TTT) over K unrolled steps.

Step 0 at position t reads (embed(x[t+1]), fc(taps[t])) and predicts the
target's distribution over x[t+2]. Step k reads (embed(x[t+1+k]), the step
k-1 output at t) and predicts x[t+2+k]: exactly what the drafter does at depth
k + 1 of a tree. Attention mirrors inference: step k at position t (RoPE
position t + k) sees the step-0 keys of positions <= t (the committed prefix)
plus its own ancestors, the step-1..k keys at position t (the tree path).

Loss per step: cross-entropy against the target's next-token distribution
restricted to the draft vocabulary (optionally sharpened by a temperature, down
to its argmax: greedy acceptance asks only for the target's top token), on
positions whose label is an assistant token the draft vocabulary contains,
weighted ``decay ** k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from eyas.drafters.eagle3 import Eagle3Head, Eagle3Layer
from eyas.models.native import DecoderLayer, rope_tables
from eyas.train.features import FeatureBatch

LABEL_TEMPERATURE_MAX = 10.0  # labels hotter than this are all but uniform over the draft vocabulary


@dataclass
class Eagle3LossConfig:
    ttt_steps: int = 7
    decay: float = 0.8  # weight of step k is decay ** k
    # GRIFFIN-style token-alignable training (arXiv 2502.11018): step k >= 1 at position t counts only
    # when every earlier step at t had the target's token among its top ``align_topk`` drafts, i.e. a
    # tree of that top-k could have reached the step; later steps elsewhere teach paths never drafted.
    # 0 = off (every learnable position counts, EAGLE-3's recipe)
    align_topk: int = 0
    # temperature of the target's label distribution: 1 = the distribution itself (EAGLE's soft labels),
    # below 1 sharper, 0 = a one-hot label on its argmax (the token greedy verification accepts)
    label_temperature: float = 1.0
    # in-batch replay of rejections (after Draft-OPD's on-policy replay of rejected positions): a position
    # where the head's top-1 misses the target's token weighs 1 + miss_weight in its step's mean (0 = off)
    miss_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.align_topk < 0:
            raise ValueError(f"ttt_steps must be >= 1 and align_topk >= 0, got {self.ttt_steps}, {self.align_topk}")
        if not 0.0 <= self.label_temperature <= LABEL_TEMPERATURE_MAX:
            raise ValueError(f"label_temperature must be in [0, {LABEL_TEMPERATURE_MAX:g}], "
                             f"got {self.label_temperature}")
        if self.miss_weight < 0:
            raise ValueError(f"miss_weight must be >= 0, got {self.miss_weight}")


def label_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [..., Vd] the target's, over the draft vocabulary -> label distribution [..., Vd] fp32.

    temperature 0: one-hot on the argmax; otherwise softmax(logits / temperature).
    """
    logits = logits.float()
    if temperature == 0.0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x: [B, T, ...] -> x[:, n:] padded at the end with ``fill`` back to T."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


class TTTAttention:
    """Attention of one TTT step over step-0 causal keys plus the diagonal keys of steps 1..k (one per layer)."""

    def __init__(self, attn) -> None:
        self.a = attn  # eyas.models.native.Attention (2H inputs in the first layer, H in later ones)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, x2: torch.Tensor, rope) -> torch.Tensor:
        """x2: [B, T, 2H] (the first layer; [B, T, H] a later one); rope: (cos, sin) [B, 1, T, Dh] at positions
        t + k -> [B, T, H].
        """
        a = self.a
        b, t, _ = x2.shape
        q, k, v = a.project(x2, rope)  # the inference layer's own projections
        rep = a.h // a.hk
        self.keys.append(k.repeat_interleave(rep, dim=1))  # [B, H, T, Dh]
        self.values.append(v.repeat_interleave(rep, dim=1))
        scale = 1.0 / math.sqrt(a.dh)
        s0 = (q @ self.keys[0].transpose(-1, -2)) * scale  # [B, H, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=x2.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in self.keys[1:]]  # [B, H, T, 1] each
        w = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        y = w[..., :t] @ self.values[0]
        for j, vj in enumerate(self.values[1:]):
            y = y + w[..., t + j : t + j + 1] * vj
        return a.o_proj(y.transpose(1, 2).reshape(b, t, a.h * a.dh))


class TTTLayers:
    """The head's decoder layers over TTT steps, one ``TTTAttention`` (keys kept step to step) per layer: EAGLE-3's
    ``midlayer``, then any plain layers after it (``Eagle3Head.extra_layers``).
    """

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.attns = [TTTAttention(head.midlayer.self_attn), *(TTTAttention(x.self_attn) for x in head.extra_layers)]

    def __call__(self, emb: torch.Tensor, hid: torch.Tensor, rope) -> torch.Tensor:
        """emb: [B, T, H] the step's token embeddings; hid: [B, T, H] the previous step's output (step 0: fc of the
        taps); rope at positions t + k -> [B, T, H] this step's pre-norm output.
        """
        first = self.head.midlayer
        hid = first.finish(hid, self.attns[0](first.attn_input(emb, hid), rope))
        for layer, attn in zip(self.head.extra_layers, self.attns[1:], strict=True):
            hid = hid + attn(layer.input_layernorm(hid), rope)
            hid = hid + layer.mlp(layer.post_attention_layernorm(hid))
        return hid


@torch.no_grad()
def widen_mlp(head: Eagle3Head, units: int, seed: int = 0) -> Eagle3Head:
    """The head with ``units`` MLP units instead of I, computing the same function (net2net-style growth).

    gate/up [I, H] -> [units, H]: the new rows are random at the existing rows' scale (std), so the new units
    are active and get gradients; down [H, I] -> [H, units]: the new columns are zero, so at step 0 they add
    exactly nothing (greedy drafts and tau unchanged) and training grows them. Shapes stay a plain Llama MLP,
    which the engines read from config.json's intermediate_size.
    """
    mlp, old = head.midlayer.mlp, head.cfg.model.intermediate_size
    if len(head.extra_layers) and units != old:
        raise ValueError("--widen-mlp widens a one-layer head's MLP; this head has "
                         f"{head.cfg.model.num_layers} layers (widen it first, then add layers)")
    if units < old:
        raise ValueError(f"--widen-mlp {units} is narrower than the head's MLP ({old} units): it only widens")
    if units == old:
        return head
    cfg = replace(head.cfg, model=replace(head.cfg.model, intermediate_size=units))
    layer = Eagle3Layer(cfg.model, cfg.norm_before_residual).to(mlp.down_proj.weight)
    missing, unexpected = layer.load_state_dict(
        {k: v for k, v in head.midlayer.state_dict().items() if not k.startswith("mlp.")}, strict=False)
    assert not unexpected and all(k.startswith("mlp.") for k in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(seed)
    for name in ("gate_proj", "up_proj"):
        w = getattr(mlp, name).weight  # [I, H]
        extra = torch.randn(units - old, w.shape[1], generator=g) * w.float().std()
        getattr(layer.mlp, name).weight.copy_(torch.cat([w.float(), extra]))
    down = mlp.down_proj.weight  # [H, I]
    layer.mlp.down_proj.weight.copy_(torch.cat([down.float(), down.new_zeros(down.shape[0], units - old).float()], 1))
    head.cfg, head.config, head.midlayer = cfg, cfg.model, layer
    return head.train(head.training).requires_grad_(any(p.requires_grad for p in head.fc.parameters()))


@torch.no_grad()
def add_layers(head: Eagle3Head, layers: int, seed: int = 0) -> Eagle3Head:
    """The head with ``layers`` decoder layers in all, computing the same function (the new ones appended).

    Each new layer is a plain Llama layer after the last (its q/k/v and gate/up random at the first layer's
    scale, norms 1), with zero o_proj and down_proj: it adds exactly nothing at step 0 (drafts and tau unchanged),
    and o_proj and down_proj take gradients at once (their inputs are not zero), then the rest. The engines read
    the count from config.json's num_hidden_layers (eyas.formats.eagle3: vLLM loads such a head).
    """
    have = head.cfg.model.num_layers
    if layers < have:
        raise ValueError(f"--head-layers {layers} is fewer than the head's {have} decoder layers: it only adds")
    if layers == have:
        return head
    cfg = replace(head.cfg, model=replace(head.cfg.model, num_layers=layers))
    first = head.midlayer
    ref = first.mlp.down_proj.weight
    g = torch.Generator().manual_seed(seed)
    for _ in range(layers - have):
        layer = DecoderLayer(cfg.model).to(ref)
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the first layer's reads 2H: its scale, H columns
            w = getattr(a, name).weight
            w.copy_(torch.randn(w.shape, generator=g) * getattr(first.self_attn, name).weight.float().std())
        for name in ("gate_proj", "up_proj"):
            w = getattr(layer.mlp, name).weight
            w.copy_(torch.randn(w.shape, generator=g) * getattr(first.mlp, name).weight.float().std())
        a.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        head.extra_layers.append(layer)
    head.cfg, head.config = cfg, cfg.model
    return head.train(head.training).requires_grad_(any(p.requires_grad for p in head.fc.parameters()))


@torch.no_grad()
def grow_draft_vocab(head: Eagle3Head, target_rows: torch.Tensor, ids: torch.Tensor) -> Eagle3Head:
    """``head`` (changed in place and returned) over the larger draft vocabulary ``ids`` ([Vd'] sorted target ids
    holding every current draft id): the current ids keep their ``lm_head`` rows (their logits are unchanged), and
    a new id's row is the target's output row (``target_rows`` [V, H], ``lm_head_proj.weight``) through the linear
    map that best takes the target's rows of the current ids to the head's (least squares over the Vd current rows):
    the new rows start where training moved their neighbours, and training goes on from there.
    """
    old = head.draft_ids()
    ids = torch.as_tensor(ids, dtype=torch.long).sort().values
    if ids.shape[0] < old.shape[0] or not torch.isin(old, ids).all():
        raise ValueError(f"--grow-draft-vocab {ids.shape[0]} must keep the head's {old.shape[0]} draft ids "
                         "(it only grows the vocabulary)")
    if ids.shape[0] == old.shape[0]:
        return head
    w = head.lm_head.weight  # [Vd, H]
    t = target_rows.detach().float().to(w.device)
    fit = torch.linalg.lstsq(t[old.to(w.device)], w.float()).solution  # [H, H]: target row -> head row
    rows = t[ids.to(w.device)] @ fit  # [Vd', H]
    rows[torch.searchsorted(ids, old).to(w.device)] = w.float()  # the current rows exactly
    cfg = replace(head.cfg, draft_vocab_size=ids.shape[0])
    lm_head = nn.Linear(w.shape[1], ids.shape[0], bias=False).to(w)
    lm_head.weight.copy_(rows)
    head.cfg, head.lm_head = cfg, lm_head
    head.d2t = torch.zeros(ids.shape[0], dtype=torch.long, device=head.d2t.device)  # t2d keeps its [V] shape
    head.set_draft_vocab(ids)
    return head.train(head.training).requires_grad_(any(p.requires_grad for p in head.fc.parameters()))


@torch.no_grad()
def fit_tap_scale(taps: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """taps: [N, L, H] sample of tap features -> [L * H] scale 1 / rms per feature.

    Llama-family residual streams carry a few "massive activation" channels (SmolLM2-135M:
    two channels near 2.5e4 against a typical 1e0-1e1 at the middle and late taps). Fed raw to
    fc, they dominate its output and its gradients and the head learns slowly. Training uses
    fc(taps * scale); ``folded`` multiplies the scale into fc's columns, so the exported head
    is an ordinary EAGLE-3 head (same function, engine layout unchanged).
    """
    x = taps.flatten(-2).float()
    return torch.rsqrt(x.pow(2).mean(0) + eps)


class Eagle3Objective:
    """Trains an Eagle3Head against a frozen target (embeddings and lm_head from the target)."""

    def __init__(self, head: Eagle3Head, target, cfg: Eagle3LossConfig | None = None,
                 tap_scale: torch.Tensor | None = None) -> None:
        self.module = head
        self.target = target
        self.cfg = cfg or Eagle3LossConfig()
        # [L * H_target] fixed per-feature input scale of fc (see fit_tap_scale); folded into fc on export
        n = head.fc.weight.shape[1]
        self.tap_scale = (tap_scale if tap_scale is not None else torch.ones(n)).float().to(head.fc.weight.device)
        ids = head.draft_ids()
        # [Vd, D] the target's output rows of the draft vocabulary (labels), frozen
        self.label_rows = target.lm_head_proj.weight.detach()[ids.to(target.device)]

    @torch.no_grad()
    def folded(self) -> Eagle3Head:
        """A copy of the head with the input scale folded into fc: what inference and export use."""
        import copy

        h = copy.deepcopy(self.module)
        h.fc.weight.mul_(self.tap_scale.to(h.fc.weight)[None, :])
        return h

    def labels(self, batch: FeatureBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> target probs over the draft vocab [B, T, Vd] (fp32), and [B, T] bool 'label in draft vocab'."""
        with torch.no_grad():
            logits = batch.hidden.to(self.label_rows.dtype) @ self.label_rows.T
            p = label_probs(logits, self.cfg.label_temperature)
            in_vocab = self.module.t2d[batch.target_tokens]
        return p, in_vocab

    def loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted TTT loss over ``ttt_steps``; draft logits and labels only where a label is learnable.

        The head's layer runs at every position (later positions attend to earlier ones), but the
        [*, Vd] draft logits, the target's label distribution and the cross-entropy are computed
        only at the N_k positions whose step-k label is learnable (an assistant token in the draft
        vocabulary): the vocabulary projections dominate the step's cost, and about a third of a
        conversation's positions (the prompt) never have a label. Those positions are found with one
        host round trip for all steps (``learnable_rows``; without ``align_topk``, whose masks depend on
        each step's drafts), so a GPU's queue is not drained at every step. Stats are 0-d tensors
        (``float()`` them to log: that waits for the device).
        """
        head, cfg = self.module, self.cfg
        dt = head.fc.weight.dtype
        valid = batch.loss_mask & self.module.t2d[batch.target_tokens]  # [B, T] label at t is learnable
        b, t = batch.input_ids.shape
        rows = learnable_rows(valid, 0 if cfg.align_topk else cfg.ttt_steps)
        with torch.no_grad():
            emb = self.target.embed(batch.input_ids).to(dt)  # [B, T, H]
            # [Nv, Vd] fp32: the target's distribution at the learnable positions, in row-major order
            p = label_probs(batch.hidden.flatten(0, 1)[rows[0]].to(self.label_rows.dtype) @ self.label_rows.T,
                            cfg.label_temperature)
            row = torch.full((b * t,), -1, dtype=torch.long, device=valid.device)  # [B * T] -> row of p
            row[rows[0]] = torch.arange(p.shape[0], device=valid.device)
            row = row.view(b, t)
        pos = torch.arange(t, device=emb.device)[None].expand(b, t)
        layers = TTTLayers(head)
        hid = F.linear(batch.taps.flatten(-2).to(dt) * self.tap_scale.to(emb.device, dt), head.fc.weight)  # [B, T, H]
        total = emb.new_zeros((), dtype=torch.float32)
        stats: dict[str, torch.Tensor] = {}
        draft_tokens = head.draft_ids()
        reach = torch.ones_like(valid)  # [B, T] every earlier step drafted the target's token (align_topk)
        for k in range(cfg.ttt_steps):
            e = shift_left(emb, 1 + k)
            rope = rope_tables(head.inv_freq, pos + k, dt)
            hid = layers(e, hid, rope)
            if cfg.align_topk:  # position t's step-k label (token t+2+k) counts where the tree could reach it
                m = shift_left(valid, 1 + k, False) & reach  # [B, T]
                sel, n = m.flatten().nonzero()[:, 0], m.sum().clamp(min=1)
            else:
                sel = rows[1 + k]
                n = max(sel.shape[0], 1)
            logp = F.log_softmax(head.logits(hid.flatten(0, 1)[sel]).float(), dim=-1)  # [N_k, Vd]
            ce = -(p[shift_left(row, 1 + k, -1).flatten()[sel]] * logp).sum(-1)  # [N_k]
            with torch.no_grad():
                label = shift_left(batch.target_tokens, 1 + k).flatten()[sel]  # [N_k]
                hit = draft_tokens[logp.argmax(-1)] == label  # [N_k] the head's top-1 would be accepted
                w = 1.0 + cfg.miss_weight * (~hit).float()  # [N_k] misses (rejected drafts) weigh more
                stats[f"acc{k}"] = hit.sum() / n
                stats[f"loss{k}"] = ce.detach().sum() / n
                if cfg.align_topk:
                    reach = _in_top_k(m, logp, draft_tokens, label, cfg.align_topk)
            step_loss = (w * ce).sum() / w.sum().clamp(min=1)
            total = total + cfg.decay**k * step_loss
        stats["loss"] = total.detach()
        return total, stats


def learnable_rows(valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """valid: [B, T] bool (label at t learnable) -> the flat [B * T] row indices, ascending, of ``valid`` and of
    each TTT step k < ``steps`` (position t counts at step k when t + 1 + k is valid): what ``x[mask]`` selects,
    found for every step with one wait for the device (boolean indexing waits once per mask).
    """
    masks = torch.stack([valid, *(shift_left(valid, 1 + k, False) for k in range(steps))]).flatten(1)  # [S+1, B*T]
    counts = masks.sum(1).tolist()  # the one host round trip
    return list(masks.nonzero()[:, 1].split(counts))  # row-major: mask by mask, positions ascending


def _in_top_k(m: torch.Tensor, logp: torch.Tensor, draft_tokens: torch.Tensor, label: torch.Tensor,
              k: int) -> torch.Tensor:
    """[B, T] bool: positions of ``m`` whose label is among the top-k drafts (False off ``m``).

    m: [B, T] bool with N True; logp: [N, Vd] draft log-probs at those positions; label: [N] target ids.
    """
    top = draft_tokens[logp.topk(min(k, logp.shape[-1]), dim=-1).indices]  # [N, k] target ids
    out = torch.zeros_like(m)
    out[m] = (top == label[:, None]).any(-1)
    return out
