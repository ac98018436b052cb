"""`eyas train`: self-distillation training of a drafter head (EAGLE-3, EAGLE-1, Medusa).

Single process:      eyas train --data distill.jsonl --out runs/eagle3
Several GPUs:        accelerate launch --num_processes 8 -m eyas train --data ... --out ...
"""

from __future__ import annotations

import argparse

from eyas.train.loop import TrainConfig, train


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter head on self-distilled data (accelerate)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainConfig(data=[], out_dir="")
    p.add_argument("--data", nargs="+", required=True,
                   help="jsonl conversations (from `eyas data`; .xz or .gz packed too)")
    p.add_argument("--out", required=True, help="output dir: checkpoint/, head/, train_log.jsonl")
    p.add_argument("--kind", default=d.kind, choices=["eagle3", "eagle1", "medusa"])
    p.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2)")
    p.add_argument("--target-dtype", default=d.target_dtype, choices=["auto", "float32", "bfloat16"],
                   help="dtype of the frozen target (auto: bfloat16 where bf16 matmuls are native, else float32)")
    p.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16", "fp16"],
                   help="autocast for the head (auto: bf16 where bf16 matmuls are native, else none)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per conversation (truncated)")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per batch per process")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    _add_recipe_args(p, d)
    _add_run_args(p, d)
    p.set_defaults(func=cmd_train)


def _add_recipe_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The recipe: unroll, alignment, labels, replay weight, vocabularies, a head to start from and grow."""
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="eagle3: training-time-test unroll")
    p.add_argument("--align-topk", type=int, default=d.align_topk,
                   help="eagle3: GRIFFIN-style token alignment: a TTT step counts only where every earlier step "
                        "had the target's token in its top-K drafts (0 = off)")
    p.add_argument("--label-temperature", type=float, default=d.label_temperature,
                   help="eagle3: temperature of the target's label distribution (1 = soft labels as EAGLE trains; "
                        "below 1 sharper; 0 = one-hot on the target's top token, what greedy verification accepts)")
    p.add_argument("--miss-weight", type=float, default=d.miss_weight,
                   help="eagle3: a position where the head's top-1 misses the target's token (a draft verification "
                        "would reject) weighs 1 + this in the loss (0 = off; in-batch replay of rejections)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="eagle3: draft vocabulary size (most frequent target tokens); 0 = full")
    p.add_argument("--medusa-heads", type=int, default=d.medusa_heads)
    p.add_argument("--init-head", default=None,
                   help="eagle3: start from this exported head (its weights and draft vocabulary; --draft-vocab "
                        "is then ignored), e.g. to continue the shipped head on more data")
    p.add_argument("--widen-mlp", type=int, default=None, metavar="UNITS",
                   help="eagle3 with --init-head: give the head's MLP this many units before training (more "
                        "capacity, same function at step 0: new units start with zero output weights)")
    p.add_argument("--head-layers", type=int, default=None, metavar="N",
                   help="eagle3 with --init-head: give the head N decoder layers before training (the new ones "
                        "plain Llama layers after its first, the same function at step 0: zero output weights). "
                        "vLLM loads such a head; SGLang and llama.cpp load one layer")
    p.add_argument("--grow-draft-vocab", type=int, default=None, metavar="IDS",
                   help="eagle3 with --init-head: grow the head's draft vocabulary to IDS target ids first (its ids "
                        "kept with their rows, the most frequent other assistant tokens of --data added, their rows "
                        "the target's mapped by a least-squares fit of the kept rows)")


def _add_run_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Checkpoints, evaluation, offline features, time budgets, seed, profiling, threads."""
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-aside acceptance every N steps")
    p.add_argument("--holdout", type=int, default=d.holdout, help="held-aside conversations for the eval")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens)
    p.add_argument("--eval-tree", default=d.eval_tree)
    p.add_argument("--feature-cache", default=None,
                   help="directory of offline target features (`eyas train-cache`); default: target in the loop")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="end this run after about SECONDS of training: the learning-rate schedule (sized by "
                        "--epochs/--max-steps) advances by the larger of steps and elapsed time, reaching 0 on time")
    p.add_argument("--wall-budget", type=float, default=None, metavar="SECONDS",
                   help="end the whole run (loading, steps and the head's export) within about SECONDS: the steps "
                        "get what loading leaves, less ~30 s for the export (a call with a hard time limit); no final "
                        "held-aside eval then, as its length is not bounded")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--profile-steps", type=int, default=d.profile_steps, metavar="N",
                   help="profile N of this run's steps (from --profile-start) with torch.profiler: OUT/profile.txt, "
                        "ops by device time on a GPU (CPU time elsewhere); the steps train as usual")
    p.add_argument("--profile-start", type=int, default=d.profile_start, metavar="STEP",
                   help="the first profiled step, 0-based within this run (default %(default)s; later, e.g. 1000, "
                        "for the steady state: with --pad-multiple the early steps still meet new batch shapes)")
    p.add_argument("--pad-multiple", type=int, default=d.pad_multiple, metavar="N",
                   help="pad each batch's length up to a multiple of N (the target then sees a few shapes, not one "
                        "per batch: on a GPU each new shape can cost cuDNN's attention a plan); padding is masked out, "
                        "the loss is the same")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per core; 1 on a CPU shared with other jobs)")


def cmd_train(a: argparse.Namespace) -> int:
    if a.threads is not None:
        if a.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {a.threads}")
        import torch

        torch.set_num_threads(a.threads)
    for flag, seconds in (("--time-budget", a.time_budget), ("--wall-budget", a.wall_budget)):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
    if a.init_head is not None and a.kind != "eagle3":
        raise ValueError(f"--init-head continues an EAGLE-3 head; --kind is {a.kind}")
    if a.widen_mlp is not None and a.init_head is None:
        raise ValueError("--widen-mlp widens the head given by --init-head; pass --init-head HEAD_DIR")
    if a.head_layers is not None and a.init_head is None:
        raise ValueError("--head-layers adds layers to the head given by --init-head; pass --init-head HEAD_DIR")
    if a.head_layers is not None and a.head_layers < 1:
        raise ValueError(f"--head-layers must be >= 1, got {a.head_layers}")
    if a.grow_draft_vocab is not None and a.init_head is None:
        raise ValueError("--grow-draft-vocab grows the head given by --init-head; pass --init-head HEAD_DIR "
                         "(a new head takes --draft-vocab)")
    from eyas.train.eagle3 import LABEL_TEMPERATURE_MAX  # the loss config's bound, checked here before loading

    if not 0.0 <= a.label_temperature <= LABEL_TEMPERATURE_MAX:
        raise ValueError(f"--label-temperature must be in [0, {LABEL_TEMPERATURE_MAX:g}] (1 = soft labels, "
                         f"0 = one-hot), got {a.label_temperature}")
    if a.miss_weight < 0:
        raise ValueError(f"--miss-weight must be >= 0 (0 = every position alike), got {a.miss_weight}")
    if a.pad_multiple < 1:
        raise ValueError(f"--pad-multiple must be >= 1 (1 = pad to the longest only), got {a.pad_multiple}")
    if a.profile_steps < 0:
        raise ValueError(f"--profile-steps must be >= 0 (0 = no profile), got {a.profile_steps}")
    if a.profile_start < 0:
        raise ValueError(f"--profile-start must be >= 0 (a step of this run, 0-based), got {a.profile_start}")
    if a.batch_tokens < a.max_len:
        raise ValueError(f"--batch-tokens ({a.batch_tokens}) must be >= --max-len ({a.max_len})")
    cfg = TrainConfig(
        data=a.data, out_dir=a.out, kind=a.kind, model=a.model, target_dtype=a.target_dtype,
        mixed_precision=a.mixed_precision, max_len=a.max_len, batch_tokens=a.batch_tokens, epochs=a.epochs,
        max_steps=a.max_steps, lr=a.lr, warmup_steps=a.warmup_steps, ttt_steps=a.ttt_steps,
        draft_vocab=a.draft_vocab, align_topk=a.align_topk, label_temperature=a.label_temperature,
        miss_weight=a.miss_weight, medusa_heads=a.medusa_heads, save_every=a.save_every,
        eval_every=a.eval_every, holdout=a.holdout, eval_tokens=a.eval_tokens, eval_tree=a.eval_tree,
        feature_cache=a.feature_cache, seed=a.seed, init_head=a.init_head, widen_mlp=a.widen_mlp,
        head_layers=a.head_layers, grow_draft_vocab=a.grow_draft_vocab,
        time_budget=a.time_budget,
        wall_budget=a.wall_budget, profile_steps=a.profile_steps,
        profile_start=a.profile_start, pad_multiple=a.pad_multiple,
    )
    train(cfg)
    return 0
