"""The plots of a testbed's results: held-out success against fresh rollouts and against training seconds (the mean
over seeds and the min-max band, one line per method), and, for the methods that replayed, the pool's size and the
replayed share of each step's rows."""

from __future__ import annotations

import textwrap
from pathlib import Path

from .report import method_label
from .statistics import AXES, mean_curve


def plot(out: Path, name: str, entry: dict) -> Path:
    """Draw `out/<name>.png` (and, with replay, `out/<name>-replay.png`) from the testbed's results `entry`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for method_name, method in entry["methods"].items():
        seeds = len(method["runs"])
        for ax, axis in zip(axes, AXES.values()):
            xs, mean, low, high = mean_curve(method["runs"], axis)
            (line,) = ax.plot(xs, mean, marker="o", markersize=3,
                              label=f"{method_label(method_name, name, entry)} ({seeds} seeds)")  # fmt: skip
            ax.fill_between(xs, low, high, alpha=0.18, color=line.get_color())
    axes[0].set_xlabel("fresh rollouts consumed")
    axes[1].set_xlabel("training seconds (evaluation excluded; this machine, these runs)")
    measure = entry.get("measure", "held-out success")
    axes[0].set_ylabel("\n".join(textwrap.wrap(measure, 50)), fontsize=8 if len(measure) > 40 else 10)
    fig.suptitle(f"{name}: mean and min-max over seeds (the tables' figures are per seed)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    replayed = {
        m: e for m, e in entry["methods"].items() if any(r["replay"]["rows_fraction"] for r in e["runs"].values())
    }
    if replayed:  # what replay did over the run: the pool's size and the replayed share of each step's rows
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        for method_name, method in replayed.items():
            series = [run["replay"] for run in method["runs"].values()]
            n = min(len(s["pool_tasks"]) for s in series)
            steps = list(range(1, n + 1))
            label = method_label(method_name, name, entry)
            left.plot(steps, [sum(s["pool_tasks"][i] for s in series) / len(series) for i in range(n)], label=label)
            right.plot(steps, [sum(s["rows_fraction"][i] for s in series) / len(series) for i in range(n)],
                       label=label)  # fmt: skip
        left.set(xlabel="optimizer step", ylabel="tasks in the pool (mean over seeds)", title=f"{name}: pool")
        right.set(xlabel="optimizer step", ylabel="replayed fraction of rows", title=f"{name}: replay share")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}-replay.png", dpi=110)
        plt.close(fig)
    return path
