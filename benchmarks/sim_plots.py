"""Matplotlib figures for docs/SIMULATION.md (written as PNG files under docs/sim/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.sim_experiments import CAPACITIES, EVICTIONS, TBT_SWEEP

PAPER_FIG5 = {"random": 19.65, "load-balancing": 5.27, "local-cache-aware": 3.58, "global-cache-aware": 3.07}


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_a(a: dict[str, Any], out: Path) -> str:
    names = list(a)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [a[n]["summary"]["ttft_mean"] for n in names], 0.4, label="Halfmoon sim")
    ax.bar([x + 0.2 for x in xs], [PAPER_FIG5[n] for n in names], 0.4, label="paper Fig. 5")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("average TTFT (s)")
    ax.set_title("(a) prefill scheduling policy, 16 nodes")
    ax.legend()
    return _save(fig, out / "a_ttft_by_policy.png")


def plot_b(b: dict[str, Any], out: Path) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels = ["inf" if c is None else f"{c / 1000:.3g}k" for c in CAPACITIES]
    for ev in EVICTIONS:
        idx = [i for i, (_, e) in enumerate(b["grid"]) if e == ev]
        axes[0].plot(labels, [b["theory"][i] for i in idx], marker="o", label=ev)
        axes[1].plot(labels, [b["sim"][i]["summary"]["hit_rate"] for i in idx], marker="o", label=ev)
    axes[0].set_title("(b) cache-only replay (cf. Fig. 9)")
    axes[1].set_title("(b) simulator, global pool 8P+8D")
    for ax in axes[:2]:
        ax.set_xlabel("pool capacity (512-token blocks)")
        ax.set_ylabel("cache hit rate")
        ax.legend()
    scopes = ("local", "global")
    axes[2].bar(scopes, [b[s]["summary"]["hit_rate"] for s in scopes], color=["tab:gray", "tab:blue"])
    axes[2].set_ylabel("cache hit rate")
    twin = axes[2].twinx()
    twin.plot(scopes, [b[s]["summary"]["prefill_s_mean"] for s in scopes], "ro-")
    twin.set_ylabel("prefill compute per request (s)", color="r")
    axes[2].set_title("(b) 10 prefill nodes, 3M tokens each (cf. Fig. 10)")
    return _save(fig, out / "b_hit_rate.png")


def plot_c(c: dict[str, Any], out: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, run in c["runs"].items():
        axes[0].plot([t * 1000 for t in TBT_SWEEP], [run["capacity"][str(t)] for t in TBT_SWEEP], marker="o", label=name)
    axes[0].set_xscale("log")
    axes[0].set_xticks([100, 200, 300, 500, 1000], ["100", "200", "300", "500", "1000"])
    axes[0].set_xlabel("TBT threshold (ms)")
    axes[0].set_ylabel("effective request capacity")
    axes[0].set_title("(c) effective capacity, 16 nodes (cf. Fig. 1)")
    axes[0].legend(fontsize=8)
    names = list(c["runs"])
    axes[1].bar(range(len(names)), [c["runs"][n]["summary"]["prefill_s_mean"] for n in names])
    axes[1].set_xticks(range(len(names)), [n.replace(" + ", "+\n") for n in names], fontsize=8)
    axes[1].set_ylabel("prefill compute per request (s)")
    axes[1].set_title("(c) prefill compute (cf. Fig. 8)")
    return _save(fig, out / "c_capacity.png")


def plot_d(d: dict[str, Any], out: Path) -> str:
    labels = [f"{p}P{q}D" for p, q in d["splits"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    xs = list(range(len(labels)))
    axes[0].plot(xs, d["scales"], marker="o")
    axes[0].set_ylabel("max arrival scale with >= 90% effective")
    axes[0].set_title("(d) P/D split of 16 nodes (cf. Fig. 15a)")
    axes[1].plot(xs, [r["summary"]["ttft_mean"] for r in d["runs"]], marker="o", label="avg TTFT (s)")
    twin = axes[1].twinx()
    twin.plot(xs, [r["summary"]["tbt_mean"] * 1000 for r in d["runs"]], "r^-", label="avg TBT (ms)")
    for ax in axes:
        ax.set_xticks(xs, labels)
    axes[1].set_ylabel("avg TTFT (s)")
    twin.set_ylabel("avg TBT (ms)", color="r")
    axes[1].set_title("(d) latency at 1x (cf. Fig. 15b)")
    return _save(fig, out / "d_pd_split.png")


def plot_e(e: dict[str, Any], out: Path) -> str:
    fig, axes = plt.subplots(1, len(e), figsize=(10, 3.4))
    for ax, (tbt, runs) in zip(axes, e.items()):
        names = list(runs)
        early = [runs[n]["summary"]["rejected_early"] for n in names]
        late = [runs[n]["summary"]["rejected_late"] for n in names]
        ax.bar(names, early, label="rejected before prefill")
        ax.bar(names, late, bottom=early, label="rejected after prefill")
        ax.set_title(f"(e) 2x speed, 8P+8D, TBT SLO {float(tbt) * 1000:.0f} ms")
        ax.set_ylabel("requests rejected")
        ax.legend(fontsize=8)
    return _save(fig, out / "e_rejections.png")
