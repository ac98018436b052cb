"""The training loop: accelerate-driven, resumable, with periodic acceptance evaluation.

One loop for every drafter kind: an *objective* (``loss(batch) -> (loss,
stats)`` plus ``module``, the trainable head) built by ``eyas.train.objectives``.
The same command runs on CPU, one GPU, or several through ``accelerate launch``
/ torchrun (each process takes every world_size-th batch; gradients are
all-reduced by accelerate's DDP wrapper).

Checkpoints (``OUT/checkpoint``): the head's state dict as safetensors, the
optimizer and scheduler through ``torch.load(weights_only=True)``, and
``state.json`` (step, epoch, position in the epoch). They are written to a
temporary directory and renamed, so a SIGKILL loses at most the steps since
the last checkpoint, and ``eyas train`` picks up from it when run again.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from eyas.train.checkpoint import resume, save_checkpoint
from eyas.train.dataset import Example, collate, load_examples, read_conversations, split_holdout, token_batches
from eyas.train.features import TargetFeaturizer
from eyas.train.profiling import START as PROFILE_START
from eyas.train.profiling import StepProfiler


@dataclass
class TrainConfig:
    data: list[str]
    out_dir: str
    kind: str = "eagle3"  # eagle3 | eagle1 | medusa
    model: str | None = None  # target (default: the embedded model)
    # "auto": bfloat16 / bf16 autocast where bf16 matmuls are native (a GPU, a CPU with AVX512-BF16 or
    # AMX: about 2x float32 there), float32 / none elsewhere (AVX2-only CPUs: bf16 is slower than fp32)
    target_dtype: str = "auto"  # features are computed in this dtype
    mixed_precision: str = "auto"  # accelerate: auto | no | bf16 | fp16
    max_len: int = 1024
    batch_tokens: int = 4096  # padded tokens per batch per process
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 50
    grad_clip: float = 0.5
    ttt_steps: int = 7  # eagle3
    decay: float = 0.8  # eagle3 step weights decay ** k
    align_topk: int = 0  # eagle3: GRIFFIN-style masking of steps a top-k tree cannot reach (0 = off)
    label_temperature: float = 1.0  # eagle3: the target's label distribution sharpened (0 = its argmax)
    miss_weight: float = 0.0  # eagle3: extra weight of positions where the head's top-1 misses (0 = off)
    draft_vocab: int = 8192  # eagle3; 0 = full target vocabulary
    medusa_heads: int = 4
    save_every: int = 100
    eval_every: int = 200
    holdout: int = 16  # held-aside conversations for the acceptance eval
    eval_tokens: int = 64
    eval_tree: str = "dynamic:8,6,32"
    seed: int = 0
    feature_cache: str | None = None  # offline target features (eyas.train.cache)
    init_head: str | None = None  # eagle3: continue this exported head (its weights and draft vocabulary)
    # eagle3 with init_head: widen its MLP to this many units first, the same function (eyas.train.eagle3.widen_mlp)
    widen_mlp: int | None = None
    # eagle3 with init_head: this many decoder layers, new ones added as no-ops first (eyas.train.eagle3.add_layers)
    head_layers: int | None = None
    # eagle3 with init_head: grow its draft vocabulary to this many ids first (eyas.train.eagle3.grow_draft_vocab)
    grow_draft_vocab: int | None = None
    # wall-clock seconds for this run's steps: the schedule runs at max(step, time) progress and ends on time
    time_budget: float | None = None
    # wall-clock seconds for the whole call (loading, steps, export): the steps get what loading and EXPORT_S leave
    wall_budget: float | None = None
    profile_steps: int = 0  # profile N steps of this run into OUT/profile.txt (eyas.train.profiling)
    profile_start: int = PROFILE_START  # the first of them, 0-based within this run
    pad_multiple: int = 1  # online features: batches padded to a multiple of this length (eyas.train.dataset.collate)
    extra: dict = field(default_factory=dict)


class _Wrapped(nn.Module):
    """forward(batch) -> (loss, stats): what accelerate/DDP wraps."""

    def __init__(self, objective) -> None:
        super().__init__()
        self.head = objective.module
        self.objective = objective  # plain attribute: the frozen target is not a submodule

    def forward(self, batch):
        return self.objective.loss(batch)


def _lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))  # cosine to 0

    return f


EXPORT_S = 30.0  # --wall-budget: seconds kept for the head's export and the summary after the last step


def _seconds_for_steps(cfg: TrainConfig, loading: float) -> float | None:
    """Seconds for this run's steps: --time-budget, capped by what --wall-budget leaves after ``loading`` seconds
    already spent and EXPORT_S for the export; None when neither is set.
    """
    if cfg.wall_budget is None:
        return cfg.time_budget
    left = cfg.wall_budget - loading - EXPORT_S
    if left <= 0:
        raise ValueError(f"--wall-budget {cfg.wall_budget:.0f} s leaves no time to train: loading took "
                         f"{loading:.0f} s and the export keeps {EXPORT_S:.0f} s; raise --wall-budget")
    return left if cfg.time_budget is None else min(cfg.time_budget, left)


def _budget_step(budget: float, total: int, start: int, step: int, elapsed: float) -> int:
    """Time budget: the schedule's step, the larger of the step and the budget's elapsed share of the steps left
    at this run's ``start``; it reaches ``total`` (the cosine's 0, where the run stops) when the budget ends.
    """
    return max(step, start + int((total - start) * min(1.0, elapsed / budget)))


def _budget_lr(cfg: TrainConfig, acc, opt, sched, total: int, at: int) -> int:
    """Set the learning rate at the budget's schedule step ``at``, the furthest of all processes' (their clocks
    differ, the schedule is one); returns that step.
    """
    if acc.num_processes > 1:
        at = int(acc.gather(torch.tensor([at], device=acc.device)).max())
    _set_lr(cfg, opt, sched, total, at)
    return at


def _set_lr(cfg: TrainConfig, opt, sched, total: int, at: int) -> None:
    """Every parameter group's learning rate at schedule step ``at`` (the budget's, instead of the step count)."""
    f = _lr_lambda(cfg, total)
    for group, base in zip(opt.param_groups, sched.base_lrs, strict=True):
        group["lr"] = base * f(at)


def _batches(examples: list[Example], cfg: TrainConfig, epoch: int, rank: int, world: int) -> list[list[int]]:
    all_b = token_batches(examples, cfg.batch_tokens, cfg.seed + epoch)
    n = len(all_b) // world * world or len(all_b)  # equal counts per process
    return all_b[rank:n:world]


def _load(cfg: TrainConfig, device, convs: list, t_called: float, log):
    """The frozen target, the tokenized examples split into training and held-aside ones, and the objective."""
    from eyas.models.loading import load_target
    from eyas.train.objectives import build_objective

    loaded = load_target(cfg.model, cfg.target_dtype, device=device)
    loaded.model.requires_grad_(False)
    t_tok = time.time()
    examples = load_examples(cfg.data, loaded.tokenizer, cfg.max_len, log=log, convs=convs)
    train_ex, hold_ex = split_holdout(examples, min(cfg.holdout, len(examples) // 10))
    t_obj = time.time()
    objective = build_objective(cfg, loaded.model, train_ex)
    log(f"loading: {len(convs)} conversations read and the target loaded in {t_tok - t_called:.1f} s, tokenized in "
        f"{t_obj - t_tok:.1f} s, the objective built in {time.time() - t_obj:.1f} s")
    return loaded, train_ex, hold_ex, objective


def _train_step(cfg: TrainConfig, acc, wrapped, opt, sched, params: list, batch) -> dict:
    """One optimizer step on ``batch``: forward under autocast, backward, clip, step; the objective's stats."""
    with acc.autocast():
        loss, stats = wrapped(batch)
    acc.backward(loss)
    acc.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    sched.step()
    return stats


@dataclass
class _Run:
    """What one training run holds between its setup and its steps."""

    acc: object  # accelerate.Accelerator
    out: Path
    loaded: object  # eyas.models.base.LoadedTarget
    train_ex: list[Example]
    hold_ex: list[Example]
    objective: object  # eyas.train.objectives' objective: loss(batch) and module
    params: list
    opt: object
    sched: object
    wrapped: nn.Module
    total: int  # optimizer steps of the schedule
    state: dict  # step, epoch, batch, tokens, seconds (resumed from the checkpoint)
    featurize: object  # list[Example] -> the batch's target features (_feature_source)


def _setup(cfg: TrainConfig, t_called: float, log) -> _Run:
    """Accelerator, target, data, head, optimizer and schedule; resumes from OUT/checkpoint when there is one."""
    from accelerate import Accelerator

    from eyas.models.loading import fast_bf16

    convs = read_conversations(cfg.data, log)  # malformed data fails before the target loads
    if cfg.target_dtype == "auto":
        cfg.target_dtype = "bfloat16" if fast_bf16() else "float32"
    if cfg.mixed_precision == "auto":
        cfg.mixed_precision = "bf16" if fast_bf16() else "no"
    acc = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available())
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    loaded, train_ex, hold_ex, objective = _load(cfg, acc.device, convs, t_called, log)
    head = objective.module.to(acc.device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = len(_batches(train_ex, cfg, 0, acc.process_index, acc.num_processes))
    total = cfg.max_steps or max(1, int(per_epoch * cfg.epochs))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total))
    state = resume(out, head, opt, sched, log)
    wrapped, opt = acc.prepare(_Wrapped(objective), opt)
    featurize = _feature_source(cfg, loaded.model, objective)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))
    return _Run(acc, out, loaded, train_ex, hold_ex, objective, params, opt, sched, wrapped, total, state, featurize)


def train(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) training; returns the final summary (also written to OUT/train_summary.json)."""
    t_called = time.time()  # --wall-budget counts from here
    run = _setup(cfg, t_called, log)
    acc, state = run.acc, run.state
    loading = time.time() - t_called
    budget = _seconds_for_steps(cfg, loading)
    if cfg.wall_budget is not None:
        log(f"--wall-budget: {budget:.0f} s for the steps (loading took {loading:.0f} s)")
    last_eval = _run_steps(cfg, run, budget, log)
    summary = {"steps": state["step"], "tokens": state["tokens"], "seconds": round(state["seconds"], 1)}
    if budget is not None:
        summary["schedule_steps"] = run.total  # the budget compressed these into ``steps``
    if acc.is_main_process:
        _finish(cfg, run.objective, run.loaded, run.hold_ex, state, last_eval, run.out / "train_log.jsonl",
                summary, log)
    acc.wait_for_everyone()
    return summary


def _run_steps(cfg: TrainConfig, run: _Run, budget: float | None, log) -> tuple[int, dict]:
    """The optimizer steps until the schedule's end (or the wall budget's); returns the last evaluation."""
    acc, state, total, train_ex = run.acc, run.state, run.total, run.train_ex
    featurize = run.featurize
    history = run.out / "train_log.jsonl"
    bar = tqdm(total=total, initial=state["step"], desc=f"train {cfg.kind}", disable=not acc.is_main_process)
    t0 = time.time() - state["seconds"]
    t_run, start, at = time.time(), state["step"], state["step"]  # the time budget: from this run's first step
    prof = StepProfiler(cfg.profile_steps if acc.is_main_process else 0, run.out, start=cfg.profile_start,
                        log=log)  # one file, rank 0
    last_eval: tuple[int, dict] = (-1, {})
    while max(state["step"], at) < total:
        batches = _batches(train_ex, cfg, state["epoch"], acc.process_index, acc.num_processes)
        for bi in range(state["batch"], len(batches)):
            with prof.step():
                with prof.part("eyas.featurize"):
                    batch = featurize([train_ex[i] for i in batches[bi]])
                with prof.part("eyas.train_step"):
                    stats = _train_step(cfg, acc, run.wrapped, run.opt, run.sched, run.params, batch)
            if budget is not None:
                at = _budget_lr(cfg, acc, run.opt, run.sched, total,
                                _budget_step(budget, total, start, state["step"] + 1, time.time() - t_run))
            run.opt.zero_grad(set_to_none=True)
            tokens = sum(int(train_ex[i].loss_mask.numpy().sum()) for i in batches[bi])  # host copies: no wait
            state.update(step=state["step"] + 1, batch=bi + 1, tokens=state["tokens"] + tokens,
                         seconds=time.time() - t0)
            bar.update(1)
            _log_step(acc, history, state, stats, run.sched, bar)
            if acc.is_main_process and state["step"] % cfg.eval_every == 0:
                last_eval = (state["step"], _evaluate(cfg, run.objective, run.loaded.model, run.hold_ex, state,
                                                      history, log))
            if acc.is_main_process and (state["step"] % cfg.save_every == 0 or max(state["step"], at) >= total):
                save_checkpoint(run.out, acc.unwrap_model(run.wrapped).head, run.opt, run.sched, state)
            if max(state["step"], at) >= total:
                break
        else:
            state.update(epoch=state["epoch"] + 1, batch=0)
    bar.close()
    return last_eval


def _finish(cfg: TrainConfig, objective, loaded, hold_ex: list, state: dict, last_eval: tuple[int, dict],
            history: Path, summary: dict, log) -> None:
    """The main process's end of a run: export the head, the final eval (unless a wall budget forbids it), the
    summary file and the curve. Fills ``summary`` in place.
    """
    from eyas.train.objectives import export_head, export_profile

    out = Path(cfg.out_dir)
    export_head(cfg, objective, loaded, out / "head")  # first: an eval cut short by a time limit keeps it
    summary["head"] = str(out / "head")
    if cfg.kind == "eagle3":  # the acceptance the tree sizing reads at load (eyas.autotree)
        export_profile(loaded.model, hold_ex, out / "head", log)
    if last_eval[0] == state["step"]:
        summary["eval"] = last_eval[1]
    elif cfg.wall_budget is not None:  # an eval's length is not bounded: it has no place in a wall budget
        summary["eval"] = {}
        log("--wall-budget: no final held-aside eval (run `eyas bench speed` with the head instead)")
    else:
        summary["eval"] = _evaluate(cfg, objective, loaded.model, hold_ex, state, history, log)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    _plot_history(history, out / "train_curve.png")
    log(f"trained {cfg.kind} head: {summary}")


def _feature_source(cfg: TrainConfig, target, objective):
    """list[Example] -> FeatureBatch: online (target in the loop) or from the offline cache."""
    f = TargetFeaturizer(target, objective.taps)
    if cfg.feature_cache:
        from eyas.train.cache import FeatureCache

        return FeatureCache(cfg.feature_cache, f)

    def online(examples: list[Example]):
        b = collate(examples, cfg.pad_multiple)
        return f(b["input_ids"], b["attention_mask"], b["loss_mask"])

    return online


def _log_step(acc, history: Path, state: dict, stats: dict, sched, bar) -> None:
    """Every 10th step (and the first): the stats (floats or 0-d tensors, read here: on a GPU that waits for the
    step, so not every step) into the log and the progress bar.
    """
    if acc.is_main_process and (state["step"] % 10 == 0 or state["step"] == 1):
        vals = {k: float(v) for k, v in stats.items()}
        rec = {"step": state["step"], "tokens": state["tokens"], "seconds": round(state["seconds"], 1),
               "lr": sched.optimizer.param_groups[0]["lr"], **{k: round(v, 4) for k, v in vals.items()}}
        with history.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        bar.set_postfix(loss=f"{vals['loss']:.3f}", acc0=f"{vals.get('acc0', 0):.3f}",
                        tok_s=f"{state['tokens'] / max(state['seconds'], 1e-9):.0f}")


def _evaluate(cfg, objective, target, hold_ex, state, history: Path, log) -> dict:
    from eyas.train.objectives import eval_acceptance

    if not hold_ex:
        return {}
    res = eval_acceptance(cfg, objective, target, hold_ex)
    rec = {"step": state["step"], "tokens": state["tokens"], "seconds": round(state["seconds"], 1), "eval": res}
    with history.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    log(f"step {state['step']}: held-aside acceptance {res}")
    return res


def _plot_history(history: Path, out: Path) -> None:
    """OUT/train_curve.png: held-aside tau and step-0 accuracy against training tokens."""
    from eyas.bench.plot import plot_train

    records = [json.loads(line) for line in history.read_text(encoding="utf-8").split("\n") if line.strip()]
    plot_train(records, str(out))
