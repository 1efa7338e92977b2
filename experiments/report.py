"""experiments/report.py: tables (mean +- sd over seeds) and plots from the runs of experiments/run.py.

    python experiments/report.py --runs runs/exp --out docs/results

Writes OUT/tables.md and OUT/*.png. Every number comes from the runs' metrics.jsonl and the eval
JSON files; the plots are eval.py's plot_runs (seeds averaged, min-max band) plus one pass@k chart.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eval import plot_runs, read_metrics  # noqa: E402

GRPO_MA = ("grpo_t16a1", "grpo_t4a1", "grpo_ma_t4a4", "grpo_ma_t4a8")
STRESS = ("stress_grpo_t4a1", "stress_grpo_ma_t3a3")
TWO_GRPO = ("grpo_t16a1", "two_grpo_lr8x", "two_grpo_lr1x", "two_grpo_p16")
AGRAE = ("grpo_t8", "dr_grpo_t8", "agrae_t8_a1", "agrae_t8_a05")
GTPO = ("grpo_t16a1", "gtpo")
HARD = ("grpo_t16a1", "select_hardest10", "select_random10")
NOISE = ("dr_grpo", "dr_grpo_noisy", "dr_grpo_noisy_corrected", "dr_grpo_noisy_lr_scaled")
DAGRPO = ("grpo_t8", "dr_grpo_t8", "dagrpo_t8")
KS64 = (1, 2, 4, 8, 16, 32, 64)  # pass@k of eval.py --n 64 (evals/*.passk64.json)
RANKING_REFERENCE = "grpo_t8"  # the ranking takes every configuration trained at this one's budget


def summarise(run: str) -> dict:
    """One run -> its final held-out scores, cost and stability figures."""
    rows = read_metrics(run)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    norms = [r["grad_norm"] for r in train]
    return {
        "steps": len(train),
        "greedy": evals[-1]["eval/greedy_accuracy"],
        "mean4": evals[-1].get("eval/mean@4", float("nan")),  # nan: greedy only (--eval-samples 0)
        "greedy0": evals[0]["eval/greedy_accuracy"],
        "time": sum(r["time/step_s"] for r in train),
        "step_s": statistics.mean(r["time/step_s"] for r in train),
        "tokens": sum(r["tokens/generated"] for r in train),
        "gss10": train[-1]["gss10_frac"],
        "spikes": sum(r["gss"] > 10 for r in train),
        "gss_max": max(r["gss"] for r in train),
        "grad_mean": statistics.mean(norms),
        "grad_cv": statistics.pstdev(norms) / statistics.mean(norms),
        "entropy_first": train[0]["entropy"],
        "entropy_last": statistics.mean(r["entropy"] for r in train[-10:]),
        "entropy_min": min(r["entropy"] for r in train),
        "reward_last": statistics.mean(r["reward/mean"] for r in train[-10:]),
        "correct_last": statistics.mean(r["accuracy"] for r in train[-10:]),  # the task's correctness, not the reward
        "zero_std": statistics.mean(r["frac_zero_std_groups"] for r in train),
    }


def seeds_of(runs_dir: str, name: str) -> list[str]:
    """Finished seed runs of one configuration (runs still in progress have no final/ yet)."""
    return sorted(
        d
        for d in glob.glob(os.path.join(runs_dir, f"{name}-s*"))
        if os.path.isfile(os.path.join(d, "final", "trainer_state.pt"))
    )


def ms(values: list[float], fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    """mean +- sample sd (just the value for one seed; "-" where a run did not measure it: nan)."""
    v = [x * scale for x in values]
    if any(x != x for x in v):
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.mean(v))} ± {fmt.format(statistics.stdev(v))}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def load_json(path: str) -> dict | None:
    return json.load(open(path)) if os.path.isfile(path) else None


def evals_of(runs_dir: str, name: str, kind: str) -> list[dict]:
    """eval.py results (`kind`: passk, passk64 or ood) of a configuration's finished seeds, or of the start
    model (name "base"); missing files are skipped."""
    keys = ["base"] if name == "base" else [os.path.basename(d) for d in seeds_of(runs_dir, name)]
    found = [load_json(os.path.join(runs_dir, "evals", f"{k}.{kind}.json")) for k in keys]
    return [j["results"] for j in found if j]


def budget_of(runs_dir: str, name: str) -> tuple[int, int]:
    """(steps, rollouts per step) a configuration was trained with, from its first finished seed's config.json."""
    with open(os.path.join(seeds_of(runs_dir, name)[0], "config.json")) as f:
        cfg = json.load(f)
    return cfg["max_steps"], cfg["prompts_per_step"] * cfg["thoughts"] * cfg["answers"]


def ranking(runs_dir: str, S: dict[str, list[dict]], reference: str = RANKING_REFERENCE) -> str:
    """One table ranking every configuration trained at `reference`'s budget (steps x rollouts per step), best
    first by held-out greedy accuracy of eval.py on the same prompts for every checkpoint (configurations without
    that evaluation last, by their in-run greedy accuracy). Mean +- sample sd over seeds. Empty without `reference`."""
    if reference not in S:
        return ""
    steps, rollouts = budget_of(runs_dir, reference)
    names = [n for n in S if budget_of(runs_dir, n) == (steps, rollouts)]
    ev = {n: evals_of(runs_dir, n, "passk64") for n in names}

    def order(n: str) -> tuple[bool, float, float]:
        greedy = statistics.mean(r["greedy_accuracy"] for r in ev[n]) if ev[n] else 0.0
        return bool(ev[n]), greedy, statistics.mean(s["greedy"] for s in S[n])

    col = lambda n, k: [s[k] for s in S[n]]  # noqa: E731
    pct = lambda res, k: ms([r[k] for r in res], scale=100) if res else "-"  # noqa: E731
    rows = [
        [str(rank), n, str(len(S[n])), pct(ev[n], "greedy_accuracy")]
        + [pct(ev[n], f"pass@{k}") for k in (1, 16, 64)]
        + [ms(col(n, "greedy"), scale=100), ms(col(n, "tokens"), "{:.0f}", 1e-3), ms(col(n, "time"), "{:.0f}")]
        + [ms(col(n, "gss10"), "{:.3f}"), ms(col(n, "gss_max"), "{:.1f}")]
        for rank, n in enumerate(sorted(names, key=order, reverse=True), 1)
    ]
    base = evals_of(runs_dir, "base", "passk64")
    start = f" Start model: {pct(base, 'greedy_accuracy')}% greedy, {pct(base, 'pass@64')}% pass@64." if base else ""
    header = ["rank", "config", "seeds", "greedy % (eval.py)", "pass@1 %", "pass@16 %", "pass@64 %"]
    header += ["greedy % (in run)", "generated tokens (k)", "training s", "GSS@10", "max GSS"]
    return (
        "## Every method at one budget: a toy-scale ranking\n\n"
        f"Every configuration trained for {steps} steps of {rollouts} rollouts, as {reference}. This is a TOY-SCALE "
        "ranking: the bundled 0.74M-parameter model on synthetic addition; it says how the methods behave here, not "
        "how they rank on real models and tasks, and rows whose spreads overlap are ties. Ranked by held-out greedy "
        "accuracy of eval.py (the same held-out prompts for every checkpoint); pass@k from 64 samples per prompt; "
        "in-run greedy on each seed's own prompts; training s sums the step times (sample + score + update)."
        f"{start}\n\n" + table(header, rows) + "\n"
    )


STALE_ARMS = ("plain_is", "clip_rollout", "tis", "icepop", "m2po")  # experiments/run.py's stale-rollout study
STALE_LAGS = (0, 1, 2, 4, 8)


def stale_name(arm: str, k: int) -> str:
    return "stale_k0" if k == 0 else f"stale_k{k}_{arm}"


def staleness_study(S: dict[str, list[dict]], runs_dir: str, out_dir: str) -> str:
    """The stale-rollout study: per correction (row) and lag K (column), the held-out greedy accuracy at the last
    step and the sampled accuracy of the last 10 steps (fresh prompts), mean +- sd over seeds, and the accuracy
    each step of lag costs (the slope of a least-squares line over K, in points per step); one plot per correction
    (eval.py's plot_runs: seeds averaged, min-max band) of its curves at every lag."""
    if "stale_k0" not in S:
        return ""
    rows = []
    for arm in STALE_ARMS:
        names = [stale_name(arm, k) for k in STALE_LAGS]
        cells = [
            ms([s[key] for s in S[n]], scale=100) if n in S else "-"
            for key in ("greedy", "correct_last")
            for n in names
        ]
        done = [(k, statistics.mean(s["greedy"] for s in S[n])) for k, n in zip(STALE_LAGS, names) if n in S]
        slope = statistics.linear_regression(*zip(*done)).slope * 100 if len(done) > 2 else float("nan")
        seeds = ",".join(str(len(S[n])) if n in S else "0" for n in names)
        rows.append([arm, seeds, *cells, f"{slope:+.2f}"])
        runs = [d for n in names for d in seeds_of(runs_dir, n)]
        keys = ["eval/greedy_accuracy", "accuracy", "stale/kl_k3", "clip_frac"]
        print(plot_runs(runs, os.path.join(out_dir, f"stale_{arm}.png"), x="step", keys=keys))
    lags = [f"K={k}" for k in STALE_LAGS]
    header = ["correction", "seeds per K", *[f"greedy % {k}" for k in lags], *[f"sampled % {k}" for k in lags]]
    return "## Stale rollouts (--staleness K)\n\n" + table(header + ["greedy points per lag step"], rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--runs", default="runs/exp", help="directory of experiments/run.py")
    p.add_argument("--out", default="docs/results", help="directory for tables.md and the plots")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = sorted({os.path.basename(d).rsplit("-s", 1)[0] for d in glob.glob(os.path.join(args.runs, "*-s*"))})
    S = {n: [summarise(r) for r in seeds_of(args.runs, n)] for n in names}
    S = {n: v for n, v in S.items() if v}
    col = lambda n, key: [s[key] for s in S[n]]  # noqa: E731
    n_seeds = max(len(v) for v in S.values())
    out = [
        f"Seeds per configuration: {n_seeds}. Values are mean ± sample sd over seeds; accuracies in %, "
        f"held-out greedy accuracy and mean@4 at the last step (200 prompts per seed unless --quick).\n"
    ]
    base = S[next(iter(S))][0]["greedy0"]

    # 1. GRPO-MA against GRPO at matched compute, and at matched generated tokens in the stress setting
    ref_t = statistics.mean(col("grpo_t16a1", "step_s")) if "grpo_t16a1" in S else None
    rows = []
    for n in [n for n in GRPO_MA if n in S]:
        rows.append(
            [
                n,
                ms(col(n, "greedy"), scale=100),
                ms(col(n, "mean4"), scale=100),
                ms(col(n, "step_s"), "{:.2f}"),
                f"{statistics.mean(col(n, 'step_s')) / ref_t:.2f}" if ref_t else "",
                ms(col(n, "tokens"), "{:.0f}", 1e-3),
                ms(col(n, "gss10"), "{:.3f}"),
                ms(col(n, "gss_max"), "{:.1f}"),
                ms(col(n, "grad_cv"), "{:.2f}"),
            ]
        )
    out.append("## GRPO-MA against GRPO\n\nStart: greedy %.1f%%.\n" % (100 * base))
    out.append(
        table(
            [
                "config",
                "greedy %",
                "mean@4 %",
                "s/step",
                "time vs T16A1",
                "generated tokens (k)",
                "GSS@10",
                "max GSS",
                "grad-norm CV",
            ],
            rows,
        )
        + "\n"
    )
    rows = [
        [
            n,
            str(S[n][0]["steps"]),
            ms(col(n, "greedy"), scale=100),
            ms(col(n, "mean4"), scale=100),
            ms(col(n, "tokens"), "{:.0f}", 1e-3),
            ms(col(n, "gss10"), "{:.3f}"),
            f"{sum(x > 0 for x in col(n, 'spikes'))} of {len(S[n])}",
            ms(col(n, "spikes"), "{:.1f}"),
            ms(col(n, "gss_max"), "{:.1f}"),
            ms(col(n, "grad_cv"), "{:.2f}"),
            ms(col(n, "zero_std"), "{:.2f}"),
        ]
        for n in STRESS
        if n in S
    ]
    if rows:
        out.append("## Gradient spikes: GRPO T4A1 against GRPO-MA T3A3 at matched generated tokens (stress setting)\n")
        header = ["config", "steps", "greedy %", "mean@4 %", "generated tokens (k)", "GSS@10", "seeds with a spike"]
        header += ["steps with GSS > 10", "max GSS", "grad-norm CV", "zero-std groups"]
        out.append(table(header, rows) + "\n")

    # 2. the variance claim
    var = load_json(os.path.join(args.runs, "evals", "variance.json"))
    if var:
        sim = var["simulation"]
        ms_keys = list(next(iter(sim.values())))
        out.append("## Variance of the thought advantage\n\nSimulation, E[(A_hat - A_true)^2]:\n")
        out.append(
            table(["K \\ M"] + [m[1:] for m in ms_keys], [[k[1:]] + [f"{sim[k][m]:.3f}" for m in ms_keys] for k in sim])
            + "\n"
        )
        rrows = []
        for r in var["rollouts"]:
            err = r["adv_error_vs_all_answers"]
            rrows.append(
                [
                    os.path.relpath(r["model"], os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    f"{100 * r['reward_mean']:.1f}",
                    f"{r['between_raw']:.4f}",
                    f"{r['between']:.4f}",
                    f"{r['within']:.4f}",
                    f"{r['within_over_between']:.1f}",
                    f"{100 * r['frac_prompts_with_signal']:.0f}",
                ]
                + [f"{err[k]:.3f}" for k in err]
            )
        r0 = var["rollouts"][0]
        out.append(f"Real rollouts: {r0['prompts']} held-out prompts x K={r0['K']} thoughts x M={r0['M']} answers:\n")
        out.append(
            table(
                [
                    "policy",
                    "reward %",
                    "Var_i V_i",
                    "between S^2",
                    "within",
                    "within / between",
                    "prompts with signal %",
                ]
                + [f"adv err, {k[1:]} of {r0['M']} answers" for k in r0["adv_error_vs_all_answers"]],
                rrows,
            )
            + "\n"
        )

    # 3. 2-GRPO against 16-GRPO
    if "grpo_t16a1" in S:
        ref_acc, ref_time = statistics.mean(col("grpo_t16a1", "greedy")), statistics.mean(col("grpo_t16a1", "time"))
        rows = []
        for n in [n for n in TWO_GRPO if n in S]:
            rows.append(
                [
                    n,
                    str(S[n][0]["steps"]),
                    ms(col(n, "greedy"), scale=100),
                    ms(col(n, "mean4"), scale=100),
                    f"{100 * statistics.mean(col(n, 'greedy')) / ref_acc:.0f}%",
                    ms(col(n, "time"), "{:.0f}"),
                    f"{100 * statistics.mean(col(n, 'time')) / ref_time:.0f}%",
                    ms(col(n, "tokens"), "{:.0f}", 1e-3),
                ]
            )
        out.append("## 2-GRPO against 16-GRPO\n")
        out.append(
            table(
                [
                    "config",
                    "steps",
                    "greedy %",
                    "mean@4 %",
                    "greedy vs 16-GRPO",
                    "training s",
                    "time vs 16-GRPO",
                    "generated tokens (k)",
                ],
                rows,
            )
            + "\n"
        )

    # 4. A-GRAE at 300 steps: pass@1..64 on the same held-out prompts (eval.py --n 64)
    pct = lambda res, key: ms([r[key] for r in res], scale=100) if res else ""  # noqa: E731
    passk64 = {n: res for n in ("base",) + AGRAE + DAGRPO if (res := evals_of(args.runs, n, "passk64"))}
    agrae = {n: res for n, res in passk64.items() if n == "base" or n in AGRAE}
    rows = [
        [n, pct(res, "greedy_accuracy")] + [pct(res, f"pass@{k}") for k in KS64] + [pct(res, "format_rate")]
        for n, res in agrae.items()
    ]
    if rows:
        out.append("## A-GRAE at 300 steps: pass@k (eval.py, 64 samples on the same held-out prompts)\n")
        out.append(table(["config", "greedy %"] + [f"pass@{k} %" for k in KS64] + ["format %"], rows) + "\n")
        plot_passk(agrae, os.path.join(args.out, "agrae_passk.png"))
        dagrpo = {n: res for n, res in passk64.items() if n == "base" or n in DAGRPO}
        plot_passk(dagrpo, os.path.join(args.out, "dagrpo_passk.png"))
    rows = [
        [n, ms(col(n, "greedy"), scale=100), ms(col(n, "mean4"), scale=100), ms(col(n, "reward_last"), "{:.3f}")]
        + [ms(col(n, "entropy_last"), "{:.3f}"), ms(col(n, "zero_std"), "{:.2f}")]
        for n in AGRAE
        if n in S
    ]
    if rows:
        out.append("A-GRAE training (300 steps, 16 prompts x 8 samples):\n")
        header = ["config", "greedy %", "mean@4 %", "train reward, last 10", "entropy, last 10", "zero-std groups"]
        out.append(table(header, rows) + "\n")

    # 5. GTPO: entropy, stability, in-distribution and synthetic-vertical (out-of-distribution) accuracy
    ev = lambda n, kind: evals_of(args.runs, n, kind)  # noqa: E731
    rows = [["base", pct(ev("base", "passk"), "greedy_accuracy"), "", pct(ev("base", "passk"), "pass@16")]]
    rows[0] += ["", "", "", ""] + [pct(ev("base", "ood"), k) for k in ("greedy_accuracy", "pass@1", "pass@16")]
    for n in [n for n in GTPO if n in S]:
        rows.append(
            [
                n,
                ms(col(n, "greedy"), scale=100),
                ms(col(n, "mean4"), scale=100),
                pct(ev(n, "passk"), "pass@16"),
                ms(col(n, "entropy_first"), "{:.3f}"),
                ms(col(n, "entropy_last"), "{:.3f}"),
                ms(col(n, "grad_mean"), "{:.2f}"),
                ms(col(n, "gss10"), "{:.3f}"),
            ]
            + [pct(ev(n, "ood"), k) for k in ("greedy_accuracy", "pass@1", "pass@16")]
        )
    out.append("## GTPO against GRPO (in distribution, and synthetic-vertical: out of distribution)\n")
    header = ["config", "greedy %", "mean@4 %", "pass@16 %", "entropy, step 1", "entropy, last 10 steps"]
    header += ["mean grad norm", "GSS@10", "OOD greedy %", "OOD pass@1 %", "OOD pass@16 %"]
    out.append(table(header, rows) + "\n")

    # 6. Hard examples: the hardest or a random 10% of the rated training examples, against all of them
    rows = [
        [n, ms(col(n, "greedy"), scale=100), ms(col(n, "mean4"), scale=100)]
        + [pct(ev(n, "passk"), "pass@1"), pct(ev(n, "passk"), "pass@16")]
        + [pct(ev(n, "ood"), "greedy_accuracy"), pct(ev(n, "ood"), "pass@16")]
        + [ms(col(n, "reward_last"), "{:.3f}"), ms(col(n, "zero_std"), "{:.2f}")]
        for n in HARD
        if n in S
    ]
    if len(rows) > 1:
        out.append("## Hard examples: training on the hardest 10%, a random 10% or all of the data (100 steps)\n")
        header = ["config", "greedy %", "mean@4 %", "pass@1 %", "pass@16 %", "OOD greedy %", "OOD pass@16 %"]
        out.append(table(header + ["train reward, last 10", "zero-std groups"], rows) + "\n")

    # 7. Reward noise: flipped rewards, their correction, and the learning rate scaled instead (Dr. GRPO)
    rows = [
        [n, ms(col(n, "greedy"), scale=100), ms(col(n, "mean4"), scale=100), pct(ev(n, "passk"), "pass@16")]
        + [ms(col(n, "correct_last"), "{:.3f}"), ms(col(n, "reward_last"), "{:.3f}"), ms(col(n, "grad_mean"), "{:.2f}")]
        for n in NOISE
        if n in S
    ]
    if len(rows) > 1:
        out.append("## Reward noise (rho+ = rho- = 0.2) and its correction, on Dr. GRPO (100 steps)\n")
        header = ["config", "greedy %", "mean@4 %", "pass@16 %", "train correct, last 10", "train reward, last 10"]
        out.append(table(header + ["mean grad norm"], rows) + "\n")

    # 8. DaGRPO (a reconstruction) against GRPO and Dr. GRPO: accuracy, gradient spikes, pass@k
    rows = [
        [n, ms(col(n, "greedy"), scale=100), ms(col(n, "mean4"), scale=100)]
        + [pct(passk64.get(n), f"pass@{k}") for k in (1, 16, 64)]
        + [ms(col(n, "gss10"), "{:.3f}"), ms(col(n, "gss_max"), "{:.1f}"), ms(col(n, "grad_cv"), "{:.2f}")]
        + [ms(col(n, "zero_std"), "{:.2f}")]
        for n in DAGRPO
        if n in S
    ]
    if len(rows) > 1:
        out.append("## DaGRPO (reconstruction) against GRPO and Dr. GRPO (300 steps, 16 prompts x 8 samples)\n")
        header = ["config", "greedy %", "mean@4 %", "pass@1 %", "pass@16 %", "pass@64 %", "GSS@10", "max GSS"]
        out.append(table(header + ["grad-norm CV", "zero-std groups"], rows) + "\n")

    # every method at one budget, ranked
    if text := ranking(args.runs, S):
        out.append(text)

    if text := staleness_study(S, args.runs, args.out):
        out.append(text)

    # every configuration in one table
    rows = [
        [
            n,
            str(len(S[n])),
            ms(col(n, "greedy"), scale=100),
            ms(col(n, "mean4"), scale=100),
            ms(col(n, "reward_last"), "{:.3f}"),
            ms(col(n, "step_s"), "{:.2f}"),
            ms(col(n, "zero_std"), "{:.2f}"),
        ]
        for n in S
    ]
    out.append("## Every configuration\n")
    out.append(
        table(["config", "seeds", "greedy %", "mean@4 %", "train reward, last 10", "s/step", "zero-std groups"], rows)
        + "\n"
    )
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write("\n".join(out))
    print("\n".join(out))

    runs = lambda group: [d for n in group for d in seeds_of(args.runs, n)]  # noqa: E731
    plots = [
        ("grpo_ma_time.png", GRPO_MA, "time", ["eval/accuracy", "eval/mean@4", "reward/mean"]),
        ("grpo_ma_tokens.png", GRPO_MA, "tokens", ["eval/accuracy", "eval/mean@4", "reward/mean"]),
        ("grpo_ma_grad.png", GRPO_MA, "step", ["grad_norm", "gss", "frac_zero_std_groups"]),
        ("two_grpo_time.png", TWO_GRPO, "time", ["eval/accuracy", "eval/mean@4", "reward/mean"]),
        ("stress_grad.png", STRESS, "tokens", ["grad_norm", "gss", "eval/accuracy"]),
        ("agrae.png", AGRAE, "step", ["eval/accuracy", "eval/mean@4", "reward/mean", "entropy"]),
        ("gtpo.png", GTPO, "step", ["entropy", "eval/accuracy", "grad_norm"]),
        ("hard_examples.png", HARD, "step", ["eval/accuracy", "eval/mean@4", "reward/mean"]),
        ("noise.png", NOISE, "step", ["eval/accuracy", "accuracy", "reward/mean", "grad_norm"]),
        ("dagrpo.png", DAGRPO, "step", ["eval/accuracy", "grad_norm", "gss"]),
    ]
    for file, group, x, keys in plots:
        if runs(group):
            print(plot_runs(runs(group), os.path.join(args.out, file), x=x, keys=keys))


def plot_passk(passk: dict, out: str, ks: tuple[int, ...] = KS64) -> None:
    """pass@k against k (log scale), one line per configuration (mean over seeds); A-GRAE dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, res in passk.items():
        ax.plot(
            ks,
            [100 * statistics.mean(r[f"pass@{k}"] for r in res) for k in ks],
            marker="o",
            label=n,
            linestyle="--" if "agrae" in n else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k %")
    ax.set_title("held-out pass@k (mean over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(out)


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
