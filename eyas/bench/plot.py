"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations


def plot_speed(report: dict, out: str) -> None:
    """Per-question speedup bars plus tau, with the overall figures in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qs = report["questions"]
    s = report["summary"]
    fig, ax = plt.subplots(figsize=(max(6, len(qs) * 0.35), 4))
    xs = range(len(qs))
    ax.bar(xs, [q["speedup"] for q in qs], color="#3b7dd8", label="speedup vs plain")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    labels = [f"{q['question_id']}/{q['turn']}" if q.get("turn", 1) > 1 else str(q["question_id"]) for q in qs]
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_ylabel("speedup (x)")
    ax2 = ax.twinx()
    ax2.plot(list(xs), [q["mean_accepted"] for q in qs], "o-", color="#d8703b", ms=3, label="tau")
    ax2.set_ylabel("mean accepted length (tau)")
    st = report["settings"]
    ax.set_title(f"drafter={st.get('drafter')} dtype={st.get('dtype')}: speedup {s['speedup']:.2f}x, "
                 f"tau {s['mean_accepted']:.2f}, identical {s['identical']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


_LOAD_PANELS = (
    ("output_token_throughput", None, "output tokens/s"),
    ("inter_token_latency_ms", "avg", "inter-token latency (ms, avg)"),
    ("time_to_first_token_ms", "avg", "time to first token (ms, avg)"),
)


def plot_load(report: dict, out: str) -> None:
    """`eyas bench load`: throughput, ITL and TTFT against concurrency, one curve per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(_LOAD_PANELS), figsize=(4.2 * len(_LOAD_PANELS), 3.6))
    for ax, (key, stat, label) in zip(axes, _LOAD_PANELS, strict=True):
        for side, levels in report["levels"].items():
            xs = [lv["concurrency"] for lv in levels]
            vals = [lv["metrics"][key] for lv in levels]
            ys = [(v or {}).get(stat) if stat else v for v in vals]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-", ms=4, label=side)
        xs = report["config"]["concurrency"]
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    cmp = report.get("comparison")
    title = f"eyas bench load: {report['sides'][0]['model']}, max_tokens {report['config']['max_tokens']}"
    if cmp is not None and cmp["break_even_concurrency"] is not None:
        title += f"; speculation stops paying at concurrency {cmp['break_even_concurrency']}"
        for ax in axes:
            ax.axvline(cmp["break_even_concurrency"], color="gray", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_train(records: list[dict], out: str) -> None:
    """`eyas train` log records -> held-aside tau and step-0 top-1 accuracy against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = {r["step"]: r for r in records if "eval" in r}  # a resumed run may repeat a step
    steps = {r["step"]: r for r in records if "acc0" in r}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["tokens"] for r in steps.values()], [r["acc0"] for r in steps.values()], ".", color="#3b7dd8",
            ms=3, alpha=0.6, label="step-0 top-1 accuracy (training batches)")
    ax.set_xlabel("training tokens (assistant)")
    ax.set_ylabel("accuracy")
    ax2 = ax.twinx()
    ev = sorted(evals.values(), key=lambda r: r["step"])
    ax2.plot([r["tokens"] for r in ev], [r["eval"]["tau"] for r in ev], "o-", color="#d8703b",
             label="held-aside tau")
    ax2.set_ylabel("mean accepted length (tau)")
    ax2.set_ylim(1.0, max([2.0] + [1.1 * r["eval"]["tau"] for r in ev]))  # tau >= 1: the axis starts there
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title("drafter training: acceptance against training tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
