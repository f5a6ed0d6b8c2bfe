"""Markdown for docs/SIMULATION.md from the experiment results (numbers are never typed in by hand)."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.sim_cpp import section_f
from benchmarks.sim_plots import PAPER_FIG5
from halfmoon.sim.profile import DEFAULT_PROFILE, PROFILE_DIR, load_profile

PAPER_FIG1 = {"I": 4.98, "II": 1.57, "III": 0.59}
PAPER_TABLE3 = {"none": 4183, "early": 3771, "predictive": 3589}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{x:.1%}"


def delta(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.0f}%" if old else "n/a"


def _s(run: dict) -> dict:
    return run["summary"]


def section_setup(meta: dict) -> str:
    raw = json.loads((PROFILE_DIR / f"{DEFAULT_PROFILE}.json").read_text())
    cost = load_profile().cost
    rows = [[f"prefill {n:,} new tokens, {p:,} cached", f"{cost.prefill.predict(n, p):.2f} s"]
            for n, p in ((2_000, 0), (12_000, 0), (2_000, 10_000), (32_000, 0), (100_000, 0))]
    rows += [[f"decode step, batch {b}, {c:,} context tokens", f"{cost.decode.predict(b, c) * 1000:.1f} ms"]
             for b, c in ((1, 12_000), (16, 200_000), (100, 1_220_000))]
    rows.append(["pull 12,000 tokens of KV (one 12k prompt)", f"{cost.transfer.seconds(12_000) * 1000:.0f} ms"])
    return "\n".join([
        "## Set-up",
        f"Generated {meta['generated']} in {meta['wall_s'] / 60:.1f} min on the 2-core build machine ({meta['machine']}),",
        "by `python -m benchmarks.sim_report` (add `--reuse` to redraw from `docs/sim/results.json`).",
        "The machine was shared with other test runs while this was generated, so wall times are upper bounds.",
        "",
        "The simulator (`shared/halfmoon/sim/`) replays `conversation_trace.jsonl` (12,031 requests, 512-token blocks) through",
        "the very classes the live conductor uses (`shared/halfmoon/policy/`): prefill choice, decode choice, admission,",
        "eviction and the cost models. Prefill nodes run one prefill at a time in FIFO order; decode and coupled",
        "nodes run continuous batching, advanced one *epoch* (stretch of iterations with the same batch) at a time,",
        "so a 12k-request replay costs tens of thousands of events, not millions of token events.",
        "The cost models are both the Conductor's predictor and the simulated hardware, so predictions are exact",
        "here except for decode end times (the Conductor only knows a moving average of decode durations) and on",
        "aggregated nodes, whose steps mix prompts and decodes (below).",
        "Unless a section says otherwise: Halfmoon = 8 prefill + 8 decode nodes, global-cache-aware scheduling,",
        "LRU, a pool of 3M tokens (5,859 blocks) of DRAM per prefill node, TTFT SLO 30 s, TBT SLO 100 ms, TBT =",
        "mean of a request's slowest 10% token intervals, trace at its own timestamps.",
        "Coupled baselines run 16 nodes that each prefill and decode (vLLM 0.5-like: a waiting prompt batch stalls",
        "the decodes for one iteration; *prefix* keeps a prefix cache in the node's 1.22M-token HBM KV pool and is",
        "routed local-cache-aware; *chunked* adds 512 prompt tokens to every decode iteration).",
        "Coupled nodes with an admission policy (`--admission`) are Halfmoon's aggregated instances alone, the",
        "Conductor's scheduler placing and admitting as live. A request turned away as overloaded that the Conductor",
        "expects to let in soon asks again, as the gateway's does (`overload_pause`, `--overload-wait`, 30 s; 0 answers",
        "it at once, as the paper's system does): only instances that prefill and decode alike",
        "expect an overload to clear, so the disaggregated runs here, section (e)'s among them, reject at once.",
        "An aggregated node is judged as a live conductor judges an aggregated instance: its TBT predictions start",
        "from the pace of the steps it ran in the last 10 s or more (`policy.step_window`: the decode-only level plus",
        "what the prompt chunks sharing its steps added), its decoders' own output lengths spread its queued prompt",
        "work, and its prompts are priced by a prefill model learned from each prompt's share (by tokens) of the",
        "steps it ran in, which also decoded the node's batch (`OnlineFitter`, the live conductor's). Priced by the",
        "profile's prefill model alone, on 2,000 trace requests over 6 chunked nodes at a 200 ms TBT SLO, admitted",
        "requests got 1.67x their predicted TTFT at the median and 948 of 1,736 passed the 30 s TTFT SLO; learned,",
        "0.99x and 7 of 1,868 (each admitted request's predicted TTFT recorded from the scheduler's decision, a",
        "one-off diagnosis at 3f2cf01 and at cdba969; the bound is tests/sim,",
        "`test_aggregated_nodes_are_judged_as_a_live_conductor_judges_aggregated_instances`).",
        "A prompt whose own prefill would hold a node's decoding sequences past the TBT SLO is admitted paced, as",
        "the live conductor admits one on an engine that paces prompts: its chunks are sized to keep the steps they",
        "share within 0.75x the SLO (`SloAwareDecode.paced`; the node sizes them from its decode step and the",
        "chunk's cost per token), and its TTFT is predicted at that pace.",
        "`halfmoon sim --mode coupled --coupled-variant chunked --nodes 6 --admission predictive --limit 3000",
        "--tbt-slo 0.1` turns away 500 requests with `--overload-wait 0` and 235 with the default wait, in which 1,046",
        "waited; 83.0% and 92.0% of the trace met TTFT 30 s and TBT 200 ms (the policy predicts a mean gap, and the",
        "TBT here is a request's slowest 10%). Before prompts were paced: 545 and 238, 81.2% and 91.5%.",
        "",
        f"### Cost profile `{raw['name']}` (`shared/halfmoon/sim/profiles/{raw['name']}.json`)",
        raw["description"],
        "",
        "Sources: " + " ".join(f"({i + 1}) {s}" for i, s in enumerate(raw["sources"])),
        "",
        "Assumptions: " + " ".join(f"({i + 1}) {s}" for i, s in enumerate(raw["assumptions"])),
        "",
        "The profile states the derivation (Equation 1 for prefill, bytes over HBM bandwidth for decode); the loader",
        "turns it into a grid of samples and fits the same non-negative least-squares models a live instance's measurements feed",
        "(`OnlineFitter`). Resulting predictions:",
        "",
        table(["operation", "predicted time"], rows),
    ])


def section_a(a: dict, plot: str) -> str:
    g, loc = _s(a["global-cache-aware"]), _s(a["local-cache-aware"])
    rows = [[n, f"{_s(r)['ttft_mean']:.2f}", f"{PAPER_FIG5[n]:.2f}", f"{_s(r)['ttft_p90']:.2f}", pct(_s(r)["hit_rate"]),
             f"{_s(r)['prefill_s_mean']:.2f}", r["pulled"], _s(r)["rejected_early"]] for n, r in a.items()]
    hot = a["global-cache-aware"]["replicas"]
    return "\n".join([
        "## (a) Prefill scheduling policy — paper Figure 5",
        table(["policy", "avg TTFT (s)", "paper avg TTFT (s)", "p90 TTFT (s)", "hit rate", "prefill compute/req (s)",
               "blocks pulled", "rejected (TTFT SLO)"], rows),
        "",
        f"![(a)](sim/{plot})",
        "",
        f"Global-cache-aware cuts average TTFT by {delta(g['ttft_mean'], loc['ttft_mean'])} against local-cache-aware",
        f"(paper: -14%) and by {delta(g['ttft_mean'], _s(a['random'])['ttft_mean'])} against random (paper: -84%);",
        "the order of the four policies is the paper's. Hot blocks replicate as a side effect of pulls: "
        + ", ".join(f"the #{h['rank']} hottest block averaged {h['mean_replicas']:.1f} replicas (peak {h['peak_replicas']})" for h in hot) + ".",
        "",
        "**Differences.** Our absolute TTFTs are 2.5-3.5x lower. The paper does not give its P/D split for this",
        "experiment nor its prefill speed; with our profile (55% MFU) a 12k-token prompt prefills in 1.3 s and eight",
        "prefill nodes are under half busy at the trace's own rate, so queues stay short. The random policy suffers",
        "less than in the paper for the same reason (queueing is what makes random bad). Hot blocks reach fewer",
        "nodes than the paper's Figure 11 (where the top keys sit on almost every prefill node): our pulls only",
        "happen when the holder's queue makes local recompute slower, which with short queues is rare.",
    ])


def section_b(b: dict, plot: str) -> str:
    caps = [c for c, e in b["grid"] if e == "lru"]
    label = lambda c: "unbounded" if c is None else f"{c:,}"  # noqa: E731
    rows = []
    for ev in ("lru", "lfu", "length-aware"):
        idx = [i for i, (_, e) in enumerate(b["grid"]) if e == ev]
        rows.append([f"{ev} (cache-only replay)"] + [pct(b["theory"][i]) for i in idx])
        rows.append([f"{ev} (simulator, 8P+8D)"] + [pct(_s(b["sim"][i])["hit_rate"]) for i in idx])
    lru = {c: b["theory"][i] for i, (c, e) in enumerate(b["grid"]) if e == "lru"}
    loc, glo = _s(b["local"]), _s(b["global"])
    return "\n".join([
        "## (b) Cache hit rate by eviction policy and pool capacity — paper Figures 9 and 10",
        "Capacity in 512-token blocks (5,859 blocks = 3M tokens, one node's DRAM in the paper; 100,000 blocks = 51M tokens).",
        table(["policy"] + [label(c) for c in caps], rows),
        "",
        f"![(b)](sim/{plot})",
        "",
        f"One node's 3M tokens reach {pct(lru[5859])} against the {pct(lru[None])} an unbounded cache gets, i.e.",
        f"{lru[5859] / lru[None]:.0%} of the maximum (paper: under 50% in most workloads); 51M tokens reach",
        f"{lru[100000] / lru[None]:.0%} of it (paper: 50M tokens nearly reach the maximum).",
        "",
        table(["10 prefill nodes x 3M tokens", "hit rate", "prefill compute/req (s)", "avg TTFT (s)"],
              [["local caches, local-cache-aware routing", pct(loc["hit_rate"]), f"{loc['prefill_s_mean']:.3f}", f"{loc['ttft_mean']:.2f}"],
               ["global pool, global-cache-aware", pct(glo["hit_rate"]), f"{glo['prefill_s_mean']:.3f}", f"{glo['ttft_mean']:.2f}"]]),
        "",
        f"The global pool raises the hit rate by {delta(glo['hit_rate'], loc['hit_rate'])} and cuts prefill compute by",
        f"{delta(glo['prefill_s_mean'], loc['prefill_s_mean'])} (paper, across its three workloads: up to +136% and -48%).",
        "",
        "**Eviction rule of `length-aware`:** deepest position in the prefix chain first, least recently used among",
        "equals (a block can only be hit when all its ancestors are, and evicting a parent strands its children).",
        "**Differences.** LRU wins on this trace and length-aware loses at mid capacities: the reuse here is",
        "multi-turn conversation, where the next turn re-reads the *whole* previous prompt soon after, so the deep",
        "blocks are exactly the ones about to be reused and recency predicts reuse better than frequency or depth.",
        "The local/global gap is far smaller than the paper's maximum because local-cache-aware routing already",
        "sends each conversation's next turn to the node holding its history, and because the conversation",
        "workload is the paper's least cache-friendly one (its 136%/48% maxima come from the other workloads).",
    ])


def section_c(c: dict, plot: str) -> str:
    runs, scales = c["runs"], c["scales"]
    ours = "Halfmoon 8P+8D"
    thr = ["0.1", "0.2", "0.3", "0.5", "1.0"]
    rows = [[n] + [pct(r["capacity"][t]) for t in thr] + [f"{_s(r)['prefill_s_mean']:.2f}", f"{_s(r)['ttft_mean']:.2f}",
            f"{_s(r)['tbt_p50'] * 1000:.0f}", f"{_s(r)['tbt_p90'] * 1000:.0f}"] for n, r in runs.items()]
    gain_rows = []
    for name, t in (("I", "0.1"), ("II", "0.2"), ("III", "0.3")):
        base = {n: runs[n]["capacity"][t] for n in runs if n != ours}
        best = max(base, key=base.get)
        gain_rows.append([name, delta(runs[ours]["capacity"][t], base["coupled (vLLM)"]),
                          f"{delta(runs[ours]['capacity'][t], base[best])} ({best})", f"+{PAPER_FIG1[name]:.0%}",
                          f"{scales[ours][name]:.2f}x"] + [f"{scales[n][name]:.2f}x" for n in base])
    pf = {n: _s(r)["prefill_s_mean"] for n, r in runs.items()}
    return "\n".join([
        "## (c) Effective request capacity vs TBT threshold — paper Figures 1 and 8",
        "Share of all 12,031 requests with TTFT <= 30 s and TBT <= threshold, trace at its own timestamps:",
        table(["system", "100 ms", "200 ms", "300 ms", "500 ms", "1 s", "prefill compute/req (s)", "avg TTFT (s)",
               "TBT p50 (ms)", "TBT p90 (ms)"], rows),
        "",
        f"![(c)](sim/{plot})",
        "",
        "Gains of Halfmoon, and our stricter figure: the largest arrival-rate scale (x trace rate) at which at least",
        "90% of requests stay effective (log bisection between 0.25x and 8x, 6 runs per cell, so each value is",
        "a lower bound within a factor of 1.25):",
        table(["threshold", "vs coupled vLLM", "vs best coupled", "paper (vs vLLM)", "Halfmoon max scale"]
              + [f"{n} max scale" for n in runs if n != ours], gain_rows),
        "",
        f"Prefill compute per request (Figure 8): Halfmoon {pf[ours]:.2f} s, {delta(pf[ours], pf['coupled (vLLM)'])} against",
        "coupled vLLM (paper: -36%); prefix caching in HBM needs "
        f"{pf['coupled + prefix cache'] / pf[ours]:.2f}x Halfmoon's (paper 1.43x), chunked prefill "
        f"{pf['coupled + chunked prefill'] / pf[ours]:.2f}x (paper 1.90x).",
        "",
        "**Differences.** At the trace's own rate our gains are far smaller than the paper's +498/+157/+59%: the",
        "coupled baseline here is an idealised vLLM with the *same* cost model and a load-aware router, no",
        "preemption or scheduling overhead, and 16 nodes run it only about 40% busy, so many requests never meet a",
        "prefill stall. The paper's vLLM runs saw far more interference (its text notes severe TBT fluctuation",
        "from long prefills). Under load, measured by the max-scale figure, Halfmoon's lead grows to several",
        "times, which is the paper's order of magnitude. Halfmoon's own capacity is flat in the threshold because",
        "its decode nodes never stall for prefill (TBT p90 under 30 ms); its missing 0.5% are the 58 prompts of",
        "107,855 tokens or more, which one 8xA800 node cannot prefill within 30 s under our profile, so the",
        "Conductor rejects them up front (the paper spreads such prompts over several nodes with chunked pipeline",
        "parallelism, which (f) models; the coupled baselines simply serve them late). Chunked prefill does",
        "better here than in the paper from 200 ms up, because we charge a chunk only its compute plus a fixed",
        "20 ms, with no loss of kernel efficiency for small chunks.",
    ])


def section_d(d: dict, plot: str) -> str:
    rows = [[f"{p}P:{q}D", pct(r["capacity"]["0.1"]), f"{s:.2f}x", f"{_s(r)['ttft_mean']:.2f}", f"{_s(r)['tbt_mean'] * 1000:.1f}"]
            for (p, q), r, s in zip(d["splits"], d["runs"], d["scales"])]
    return "\n".join([
        "## (d) P/D split of 16 nodes — paper Figure 15",
        table(["split", "effective @1x (TBT 100 ms)", "max scale >= 90%", "avg TTFT (s)", "avg TBT (ms)"], rows),
        "",
        f"![(d)](sim/{plot})",
        "",
        "As in Figure 15b, more prefill nodes lower TTFT and raise TBT. **Difference:** the paper finds its best",
        "capacity near 1:1; here capacity keeps growing with prefill nodes. With the bandwidth-derived decode",
        "model a decode step stays near 25-30 ms even with 5 decode nodes, far under the 100 ms SLO, and the",
        "conversation trace is prefill-heavy (12k input vs 343 output tokens on average), so the binding resource is",
        "always prefill. The paper ran this on its synthetic workload with a 10 s TTFT SLO and its real decode",
        "nodes reported 30-50 ms average TBT; a decode model with larger per-request costs would move the optimum",
        "toward 1:1. At the trace's own rate every split keeps about 99.5% effective, so only the max-scale",
        "figure separates them.",
    ])


def section_e(e: dict, plot: str) -> str:
    rows = []
    for tbt, runs in e.items():
        for name, r in runs.items():
            s = _s(r)
            rows.append([f"{float(tbt) * 1000:.0f} ms", name, s["rejected_early"], s["rejected_late"],
                         s["rejected_early"] + s["rejected_late"], f"{r['wasted_s']:.0f}", pct(r["capacity_at_slo"]),
                         PAPER_TABLE3[name]])
    tight = e["0.025"]
    total = {n: _s(r)["rejected_early"] + _s(r)["rejected_late"] for n, r in tight.items()}
    return "\n".join([
        "## (e) Rejections under overload, 2x speed, 8P+8D — arXiv Table 3",
        table(["TBT SLO", "admission", "rejected before prefill", "rejected after prefill", "total", "prefill wasted (s)",
               "effective at SLO", "paper total (own trace)"], rows),
        "",
        f"![(e)](sim/{plot})",
        "",
        "At the issue's setting (TBT SLO 100 ms) nothing separates the policies: every rejection is a request whose",
        "predicted TTFT exceeds 30 s, because at 2x this trace keeps the decode pool far under its SLO (see (d)).",
        "To exercise admission we also tighten the TBT SLO to 25 ms, where the decode pool is the bottleneck.",
        f"There, early rejection rejects {delta(total['early'], total['none'])} as many requests as no early rejection",
        f"and prediction-based early rejection {delta(total['predictive'], total['none'])} (paper: -10% and -14%);",
        f"prediction rejects {delta(total['predictive'], total['early'])} against plain early rejection.",
        "",
        "**Differences.** Judging the decode pool *now* rejects requests whose prefill would end after the load has",
        "drained, the over-reaction the paper describes; prediction removes most of it. Unlike the paper, neither",
        "beats rejecting at hand-off here, because in this set-up late rejection costs only prefill time that no",
        "other request was waiting for (prefill is lightly loaded at 2x with caching), while the hand-off check",
        "sees the decode load exactly. The paper's trace for Table 3 overloads both pools, so prefill wasted on",
        "doomed requests delays others; the absolute counts are not comparable (different trace and cluster load).",
    ])


def section_perf(results: dict) -> str:
    lat = results["sched_latency"]
    rows = [[n, f"{p50:.3f}", f"{p99:.3f}", f"{p50 / lat['random'][0]:.1f}x"] for n, (p50, p99) in lat.items()]
    thr = [[n, f"{wall:.2f}", f"{rate:,.0f}", f"{60 / wall:.0f}x"] for n, (wall, rate) in results["throughput"].items()]
    return "\n".join([
        "## Performance",
        "Scheduling decision latency (`python -m benchmarks.sched_latency`): one `KVCentricScheduler.schedule` call",
        "with 64 prefill and 64 decode instances, 128-block prompts over 400 cached chains, prediction-based admission",
        "(24 running requests per decode instance); the random policy is the in-run baseline.",
        table(["prefill policy", "p50 (ms)", "p99 (ms)", "p50 vs random"], rows),
        "",
        "Simulator speed (`python -m benchmarks.sim_throughput`): full conversation trace, 16 nodes, wall time including",
        "trace parsing; the issue's budget is 60 s.",
        table(["system", "wall (s)", "requests / wall s", "under budget by"], thr),
    ])


def section_plan() -> str:
    return "\n".join([
        "## Capacity planning: `halfmoon plan`",
        "`halfmoon plan` sizes the pools with this simulator: given a trace window and SLOs it finds the fewest",
        "instances whose replay keeps at least the target share of requests within both SLOs (attainment, the",
        "effective capacity of (c)). The search is `shared/halfmoon/sim/plan.py`; each candidate layout is one replay.",
        "",
        "```",
        "halfmoon plan --trace conversation_trace.jsonl --limit 10000 --ttft-slo 30 --tbt-slo 0.1 --target 0.9 \\",
        "              [--offset N] [--time-scale X] [--cpp 2,4] [--no-aggregated] [--plot plan.png] [--json plan.json]",
        "halfmoon plan --spans .halfmoon/traces.jsonl ...   # the requests a running deployment served",
        "```",
        "",
        "It assumes attainment never falls when a role gains an instance, which lets it skip most of the grid:",
        "it doubles a balanced layout (1P+1D, 2P+2D, 4P+4D, ...) until one meets the target; bisects the fewest",
        "prefill instances that meet it beside that many decode instances, and the fewest decode instances",
        "beside that many prefill ones; their sum is a lower bound, so it tries totals upward from it, every split",
        "of a total, and stops at the first total with a split that meets the target. The same runs with CPP for",
        "each `--cpp` stage count (pipelines only for prompts one node would prefill past the TTFT SLO, the",
        "setting that pays in (f)), and a doubling then bisection over aggregated instances (every instance",
        "prefills and decodes, the *prefix* coupled variant by default); each later search stops at the best",
        "count found so far. It prints every layout it simulated (instances, attainment, goodput in requests",
        "within both SLOs per simulated second, TTFT and TBT p90), the choice with its reason, or why no layout",
        "up to `--max-instances` can meet the target (for example prompts no single node can prefill within the",
        "TTFT SLO, with CPP off), and draws attainment against instances. A window's arrivals start at 0 and",
        "replay from a cold cache. A span file gives arrival, prompt and output lengths but no block hashes,",
        "so a plan from spans assumes no prefix reuse and overstates prefill work. How long a 10,000-request",
        "window takes, and the planner against the best fixed P:D split of a grid search on this trace, are in",
        "docs/BENCHMARKS.md (`python -m benchmarks.plan_speed`).",
    ])


def render(results: dict, plots: dict[str, str]) -> str:
    return "\n\n".join([
        "# Simulation: the Conductor's policies on the Mooncake conversation trace",
        "<!-- generated by `python -m benchmarks.sim_report`; edit benchmarks/sim_report_text.py, not this file -->",
        section_setup(results["meta"]),
        section_a(results["a"], plots["a"]),
        section_b(results["b"], plots["b"]),
        section_c(results["c"], plots["c"]),
        section_d(results["d"], plots["d"]),
        section_e(results["e"], plots["e"]),
        *([section_f(results["f"], table)] if "f" in results else []),
        section_plan(),
        section_perf(results),
    ]) + "\n"
