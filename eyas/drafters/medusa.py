"""Medusa-1 heads (Cai et al. 2024, arXiv 2401.10774): K small heads on the target's last feature.

Head k (0-based) reads the target's final post-norm feature at position t and predicts the
token at t + k + 2 (the target's own lm_head predicts t + 1)::

    logits_k = lm_head_k(block_k(h_t)),   block = num_layers x (x + SiLU(Linear(D, D)(x)))

A draft tree is rooted at the last sampled token r (position t + 1), so a node at depth d sits
at position t + 1 + d and takes its token from head d - 1, whatever its parent is: Medusa heads
see no draft tokens, which is why one feature per step is all the drafter keeps.

Checkpoint layouts (both read and written; safetensors only):

* ``medusa`` -- FasterDecoding/Medusa ``medusa/model/medusa_model.py``: ``medusa_head`` is an
  ``nn.ModuleList`` of ``nn.Sequential(ResBlock x L, nn.Linear(D, V, bias=False))`` and
  ``ResBlock.linear`` has a bias, so its state dict keys are ``{k}.{j}.linear.weight``,
  ``{k}.{j}.linear.bias`` and ``{k}.{L}.weight``; ``config.json`` holds ``medusa_num_heads``,
  ``medusa_num_layers`` and ``base_model_name_or_path``. The reference pickles the weights to
  ``medusa_lm_head.pt``; its later training scripts and TGI use ``medusa_lm_head.safetensors``,
  the name written here.
* ``vllm`` -- vLLM ``vllm/model_executor/models/medusa.py``: ``blocks.{k}.layers.{j}.weight``
  (``.bias`` only when config ``medusa_fc_bias`` is true; vLLM's default is no bias) and
  ``lm_heads.{k}.weight``; ``config.json`` read by ``vllm/transformers_utils/configs/medusa.py``
  (``model_type`` "medusa", ``architectures`` ["MedusaModel"], ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``). The
  module below uses vLLM's names, so that layout is its own state dict.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.drafters.base import Drafter, TargetFeatures, register_drafter
from eyas.drafters.eagle import HeadMismatchError
from eyas.models.config import ModelConfig
from eyas.tree import DynamicTreeBuilder, DynamicTreeConfig, parse_choices, static_tree
from eyas.types import DraftOutput, SamplingParams, Tree

DEFAULT_TREE = "medusa_mc_sim_7b_63"  # Medusa's default choices (eyas.tree.presets)
LAYOUTS = ("vllm", "medusa")
_WEIGHT_FILES = {"vllm": "model.safetensors", "medusa": "medusa_lm_head.safetensors"}
# vLLM's load_weights strips "medusa_heads."; Medusa-2 full-model checkpoints nest the heads
# under "medusa_head." (MedusaModelABC.medusa_head)
_PREFIXES = ("medusa_heads.", "medusa_head.")
_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")


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


# ---- checkpoint layouts ------------------------------------------------------------------------
def save_medusa(heads: MedusaHeads, out_dir: str | Path, layout: str = "vllm", target_name: str = "") -> Path:
    """Write config.json + safetensors weights in the ``vllm`` or ``medusa`` layout; returns the dir."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Medusa layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    c = heads.config
    sd = {k: v.detach().cpu().contiguous().clone() for k, v in heads.state_dict().items()}
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    if layout == "vllm":
        # vLLM's MedusaConfig.from_pretrained renames every key holding "num" and "heads" to
        # num_heads (and "num" + "layers" to num_hidden_layers): write no other such key.
        cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
               "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
               "truncated_vocab_size": c.vocab_size, "medusa_fc_bias": c.bias, "original_lm_head": False,
               "base_model_name_or_path": target_name, "torch_dtype": dtype}
    else:
        sd = _to_medusa_keys(sd, c)
        # MedusaConfig (FasterDecoding) fields; hidden_size / vocab_size are extra PretrainedConfig
        # kwargs it keeps and eyas checks against the target
        cfg = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
               "base_model_name_or_path": target_name, "hidden_size": c.hidden_size,
               "vocab_size": c.vocab_size, "torch_dtype": dtype}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / _WEIGHT_FILES[layout]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _to_medusa_keys(sd: dict[str, torch.Tensor], c: MedusaConfig) -> dict[str, torch.Tensor]:
    """vLLM names -> Medusa names (nn.Sequential indices; the lm_head is entry num_layers)."""
    out = {}
    for k in range(c.num_heads):
        for j in range(c.num_layers):
            w = sd[f"blocks.{k}.layers.{j}.weight"]
            out[f"{k}.{j}.linear.weight"] = w
            # Medusa's ResBlock always has a bias: a bias-free block is the same block with b = 0
            out[f"{k}.{j}.linear.bias"] = sd.get(f"blocks.{k}.layers.{j}.bias", w.new_zeros(w.shape[0]))
        out[f"{k}.{c.num_layers}.weight"] = sd[f"lm_heads.{k}.weight"]
    return out


def detect_layout(keys) -> str | None:
    """'vllm', 'medusa' or None for a collection of state dict keys (prefixes stripped)."""
    keys = [_strip(k) for k in keys]
    if keys and all(k.startswith(("blocks.", "lm_heads.")) or k == "token_map" for k in keys):
        return "vllm"
    if keys and all(_MEDUSA_KEY.match(k) for k in keys):
        return "medusa"
    return None


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def _weights_path(p: Path) -> Path:
    for name in _WEIGHT_FILES.values():
        if (p / name).exists():
            return p / name
    for name in ("medusa_lm_head.pt", "pytorch_model.bin"):
        if (p / name).exists():
            src, dst = p / name, p / _WEIGHT_FILES["medusa"]
            raise ValueError(
                f"{src} is a pickle checkpoint and eyas reads safetensors only; convert it once with: "
                f"python -c \"import torch; from safetensors.torch import save_file; "
                f"sd = torch.load('{src}', weights_only=True); "
                f"save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, '{dst}')\""
            )
    raise FileNotFoundError(f"no {' or '.join(_WEIGHT_FILES.values())} in {p}")


def looks_like_medusa_dir(path: str | Path) -> bool:
    """True for a directory holding Medusa heads in either layout (reads key names only)."""
    p = Path(path)
    if not p.is_dir():
        return False
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    if isinstance(raw, dict) and (raw.get("model_type") == "medusa" or "medusa_num_heads" in raw):
        return True
    files = [p / n for n in _WEIGHT_FILES.values() if (p / n).exists()]
    if not files:
        return False
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:  # key names only, no tensor reads
        return detect_layout(list(f.keys())) is not None


def load_medusa(path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Load heads in either layout and check they fit the target (HeadMismatchError if not)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"Medusa heads {p} need a config.json next to the weights")
    raw = json.loads((p / "config.json").read_text())
    sd = {_strip(k): v for k, v in load_file(str(_weights_path(p))).items()}
    layout = detect_layout(sd)
    if layout is None:
        raise HeadMismatchError(
            f"{p} holds no Medusa heads: expected keys blocks.K.layers.J.* + lm_heads.K.weight (vLLM) "
            f"or K.J.linear.* + K.L.weight (Medusa); found e.g. {sorted(sd)[:4]}"
        )
    sd, cfg = _from_vllm(sd, raw, p) if layout == "vllm" else _from_medusa(sd, raw, p)
    _check_fits(cfg, raw, target_cfg, p)
    heads = MedusaHeads(cfg)
    try:
        heads.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise HeadMismatchError(f"Medusa heads {p}: weights do not match their config: {e}") from None
    return heads.to(dtype).eval().requires_grad_(False)


def _config_count(raw: dict, names: tuple[str, ...], found: int, what: str, p: Path) -> int:
    """The config's head/layer count (both references build that many; extra weights are ignored)."""
    n = next((raw[k] for k in names if k in raw), found)
    if not isinstance(n, int) or not 1 <= n <= found:
        raise HeadMismatchError(
            f"Medusa heads {p}: config.json asks for {n} {what} but the weights hold {found}; "
            f"fix {names[0]} in config.json"
        )
    return n


def _from_vllm(sd: dict, raw: dict, p: Path) -> tuple[dict, MedusaConfig]:
    tv = raw.get("truncated_vocab_size")
    if "token_map" in sd or (tv is not None and tv != raw.get("vocab_size", tv)):
        raise HeadMismatchError(
            f"Medusa heads {p} draft in a truncated vocabulary (token_map); eyas needs heads over the "
            f"target's full vocabulary: export them without truncated_vocab_size / token_map"
        )
    found = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    if raw.get("original_lm_head", False) and "lm_heads.0.weight" in sd:
        # vLLM: one lm_head (stored as lm_heads.0) shared by every head
        sd = sd | {f"lm_heads.{k}.weight": sd["lm_heads.0.weight"] for k in range(found)}
    n = _config_count(raw, ("num_heads", "medusa_num_heads"), found, "heads", p)
    layers = len({k.split(".")[3] for k in sd if k.startswith("blocks.0.layers.")})
    nl = _config_count(raw, ("num_hidden_layers", "medusa_num_layers"), layers, "layers per head", p)

    def kept(key: str) -> bool:  # both references build the config's counts and skip the rest
        parts = key.split(".")
        return int(parts[1]) < n and (parts[0] == "lm_heads" or int(parts[3]) < nl)

    sd = {k: v for k, v in sd.items() if kept(k)}
    if "lm_heads.0.weight" not in sd:
        raise HeadMismatchError(f"Medusa heads {p}: no lm_heads.0.weight in the weights")
    v, d = sd["lm_heads.0.weight"].shape
    # the weights decide the bias (vLLM itself would drop biases unless config medusa_fc_bias is true)
    return sd, MedusaConfig(d, v, n, nl, bias="blocks.0.layers.0.bias" in sd)


def _from_medusa(sd: dict, raw: dict, p: Path) -> tuple[dict, MedusaConfig]:
    found = len({k.split(".")[0] for k in sd})
    n = _config_count(raw, ("medusa_num_heads", "num_heads"), found, "heads", p)
    lm_idx = [int(k.split(".")[1]) for k in sd if k.startswith("0.") and ".linear." not in k]
    if len(lm_idx) != 1:
        raise HeadMismatchError(f"Medusa heads {p}: head 0 needs exactly one lm_head key '0.L.weight'")
    nl = _config_count(raw, ("medusa_num_layers", "num_hidden_layers"), lm_idx[0], "layers per head", p)
    out = {}
    try:
        for k in range(n):
            for j in range(nl):
                out[f"blocks.{k}.layers.{j}.weight"] = sd[f"{k}.{j}.linear.weight"]
                out[f"blocks.{k}.layers.{j}.bias"] = sd[f"{k}.{j}.linear.bias"]
            out[f"lm_heads.{k}.weight"] = sd[f"{k}.{nl}.weight"]
    except KeyError as e:
        raise HeadMismatchError(f"Medusa heads {p}: missing key {e.args[0]} (config: {n} heads, "
                                f"{nl} layers each)") from None
    v, d = out["lm_heads.0.weight"].shape
    return out, MedusaConfig(d, v, n, nl, bias=True)


def _check_fits(cfg: MedusaConfig, raw: dict, target_cfg: ModelConfig, p: Path) -> None:
    base = raw.get("base_model_name_or_path") or "unknown"
    for name, ours, theirs in (("hidden size", cfg.hidden_size, target_cfg.hidden_size),
                               ("vocabulary size", cfg.vocab_size, target_cfg.vocab_size)):
        if ours != theirs:
            raise HeadMismatchError(
                f"Medusa heads {p} have {name} {ours} but the target's {name} is {theirs}: these heads "
                f"were trained for a different target model (base_model_name_or_path: {base}); "
                f"use heads trained for this target"
            )
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if key in raw and raw[key] != ours:
            raise HeadMismatchError(f"Medusa heads {p}: config.json {key}={raw[key]}, weights {ours}")


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
