"""Build, evaluate and export the trainable head of each drafter kind."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from eyas.train.dataset import Example, draft_vocab, vocab_coverage


def build_objective(cfg, target, train_ex: list[Example]):
    """TrainConfig + frozen target -> objective with ``module`` (trainable head), ``taps``, ``loss``."""
    tc = target.config
    if cfg.kind == "eagle3":
        from eyas.drafters.eagle3 import Eagle3Config, Eagle3Head
        from eyas.train.eagle3 import Eagle3LossConfig, Eagle3Objective, add_layers, grow_draft_vocab, widen_mlp

        if cfg.init_head:  # continue an exported head: its draft vocabulary and taps
            head = _load_head(cfg.init_head, target)
            if cfg.widen_mlp:
                head = widen_mlp(head, cfg.widen_mlp, cfg.seed)
            if cfg.head_layers:
                head = add_layers(head, cfg.head_layers, cfg.seed)
            if cfg.grow_draft_vocab:  # the head's ids first, then the data's most frequent others
                ids, _ = draft_vocab(train_ex, tc.vocab_size, cfg.grow_draft_vocab, always=head.draft_ids().tolist())
                head = grow_draft_vocab(head, target.lm_head_proj.weight, ids)
            head.coverage = vocab_coverage(train_ex, tc.vocab_size, head.draft_ids())
        else:
            size = cfg.draft_vocab or tc.vocab_size
            ids, coverage = draft_vocab(train_ex, tc.vocab_size, size)
            head = Eagle3Head(Eagle3Config.for_target(tc, size))
            head.set_draft_vocab(ids)
            _init_from_target(head, target)
            head.coverage = coverage
        scale = _tap_scale(target, head.cfg.aux_layers, train_ex)
        if cfg.init_head:
            with torch.no_grad():  # training multiplies fc's input by the scale: the same function as exported
                head.fc.weight.div_(scale.to(head.fc.weight)[None, :])
        loss_cfg = Eagle3LossConfig(cfg.ttt_steps, cfg.decay, align_topk=cfg.align_topk,
                                    label_temperature=cfg.label_temperature, miss_weight=cfg.miss_weight)
        obj = Eagle3Objective(head.float(), target, loss_cfg, tap_scale=scale)
        obj.taps = head.cfg.aux_layers
        return obj
    if cfg.kind == "eagle1":
        from eyas.drafters.eagle import EagleHead
        from eyas.models.config import ModelConfig
        from eyas.train.eagle1 import Eagle1Objective

        # no fc bias: vLLM builds fc without one (and reads a config "bias" as attention bias)
        head = EagleHead(ModelConfig(**{**tc.__dict__, "num_layers": 1}), bias=False)
        return Eagle1Objective(head.float(), target)
    if cfg.kind == "medusa":
        from eyas.formats.verifier import resolve_verifier
        from eyas.train.medusa_loss import MedusaLossConfig, MedusaObjective

        name = resolve_verifier(cfg.model or "embedded").name_or_path  # what engines resolve (a hub id or a dir)
        obj = MedusaObjective(target, MedusaLossConfig(num_heads=cfg.medusa_heads), target_name=name)
        obj.taps = ()
        return obj
    raise ValueError(f"unknown drafter kind {cfg.kind!r} to train; choose eagle3, eagle1 or medusa")


@torch.no_grad()
def _tap_scale(target, taps, train_ex: list[Example], n: int = 16) -> torch.Tensor:
    """Per-feature 1/rms of the tap features over the first n training examples (deterministic)."""
    from eyas.train.dataset import collate
    from eyas.train.eagle3 import fit_tap_scale
    from eyas.train.features import TargetFeaturizer

    b = collate(train_ex[:n])
    fb = TargetFeaturizer(target, taps)(b["input_ids"], b["attention_mask"], b["loss_mask"])
    return fit_tap_scale(fb.taps[fb.attention_mask].cpu())


def _load_head(path: str, target):
    """An exported EAGLE-3 head (eyas's, SpecForge's or speculators' layout) in fp32, trainable."""
    from eyas.formats.eagle3 import load_eagle3

    return load_eagle3(path, target.config, torch.float32).train().requires_grad_(True)


def _inference_head(objective):
    """The head as inference sees it (EAGLE-3: input scale folded into fc)."""
    return objective.folded() if hasattr(objective, "folded") else objective.module


@torch.no_grad()
def _init_from_target(head, target) -> None:
    """Start the draft lm_head / final norm from the target's own rows: the head begins as a
    next-token predictor in the target's output space.
    """
    ids = head.draft_ids().to(target.device)
    head.lm_head.weight.copy_(target.lm_head_proj.weight[ids].float())
    head.norm.weight.copy_(target.model.norm.weight.float())


def eval_drafter(kind: str, head, target, tree: str):
    """An inference drafter around a copy of the head in the target's dtype."""
    h = copy.deepcopy(head).to(target.dtype).eval().requires_grad_(False)
    if kind == "eagle3":
        from eyas.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(target_model=target, head=h, tree=tree)
    if kind == "eagle1":
        from eyas.drafters.eagle import EagleDrafter

        return EagleDrafter(target_model=target, head=h, tree=tree)
    from eyas.drafters.medusa import MedusaDrafter

    # a Medusa tree is at most as deep as there are heads: keep only the kind of the eval tree
    # (bare "dynamic" = top-k 8, depth min(6, heads))
    return MedusaDrafter(target_model=target, heads=h, tree=tree.partition(":")[0])


def eval_acceptance(cfg, objective, target, hold_ex: list[Example]) -> dict:
    """Greedy generation on held-aside prompts: tau = 1 + accepted / steps (vLLM's definition)."""
    from eyas.decode import DecodeConfig, SpecDecoder

    was_training = objective.module.training
    drafter = eval_drafter(cfg.kind, _inference_head(objective), target, cfg.eval_tree)
    steps = accepted = 0
    for ex in hold_ex:
        first = int(ex.loss_mask.nonzero()[0]) + 1 if ex.loss_mask.any() else ex.input_ids.shape[0]
        dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=cfg.eval_tokens))
        for _ in dec.generate(ex.input_ids[:first].to(target.device)):
            pass
        steps += dec.stats.steps
        accepted += dec.stats.accepted
    objective.module.train(was_training)
    return {"tau": round(1 + accepted / max(steps, 1), 3), "prompts": len(hold_ex), "steps": steps}


def export_head(cfg, objective, loaded, out: Path) -> None:
    """Write the trained head in the layout other engines load (see eyas.formats)."""
    head = _inference_head(objective)
    name = loaded.name
    if cfg.kind == "eagle3":
        from eyas.formats.eagle3 import save_eagle3

        save_eagle3(head, out, target_name=name)  # LlamaForCausalLMEagle3: vLLM, SGLang, TensorRT-LLM
        save_eagle3(head, out.with_name(out.name + "_speculators"), target_name=name, speculators=True)
    elif cfg.kind == "eagle1":
        from eyas.formats.eagle1 import save_eagle1

        save_eagle1(head, out, target_name=name)
        save_eagle1(head, out.with_name(out.name + "_vllm"), target_name=name, layout="vllm")  # vLLM's layout
    else:
        objective.save(out)


def answer_text(ex: Example) -> tuple[torch.Tensor, int] | None:
    """A conversation cut after its first answer -> (ids, first), the answer starting at ``first + 1`` (what
    eyas.train.profile measures along); None when it has no answer.
    """
    learn = ex.loss_mask.nonzero()[:, 0]
    if learn.numel() == 0:
        return None
    first = int(learn[0])
    gaps = (learn[1:] - learn[:-1] != 1).nonzero()  # where the first answer's run of positions ends
    last = int(learn[int(gaps[0, 0])]) if gaps.numel() else int(learn[-1])
    return ex.input_ids[: last + 2], first


def export_profile(target, hold_ex: list[Example], out: Path, log=print) -> Path | None:
    """EAGLE-3 on a CPU: ``out/profile.json`` for the exported head (its file's weights) from the held-aside
    conversations' first answers (eyas.train.profile), so ``eyas generate --drafter OUT/head`` sizes its tree to the
    machine at load. None (and a log line) without held-aside conversations or off a CPU.
    """
    texts = [t for t in map(answer_text, hold_ex) if t is not None]
    if not texts or target.device.type != "cpu":
        why = "no held-aside conversations" if not texts else "the target is not on a CPU"
        log(f"no profile.json for {out} ({why}): its tree is sized at load only with one "
            "(scripts/acceptance_profile.py --head ... --questions ...)")
        return None
    from eyas.formats.eagle3 import load_eagle3
    from eyas.train.profile import write_profile

    head = load_eagle3(out, target.config, torch.float32)
    return write_profile(out, target, head, texts, f"{len(texts)} held-aside conversations' first answers "
                         "(eyas train), teacher-forced")
