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
    ax.set_xticks(list(xs), [str(q["question_id"]) for q in qs], rotation=90, fontsize=7)
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
