"""eval.py: held-out evaluation (greedy accuracy, mean@n, unbiased pass@k) and plots of runs.

    python eval.py --model assets/tiny-model --task synthetic --n 16 --k 1,4,16
    python eval.py --model runs/default/final --task gsm8k --data test.jsonl --out eval.json
    python eval.py --plot runs/grpo runs/grpo_ma      # curves of one or more runs in one PNG
    python eval.py --plot runs/exp/t4a4-s0 runs/exp/t4a4-s1 --x time --metrics eval/accuracy,grad_norm

Correctness comes from the task's own functions (tasks.py / rewards.py), the same ones the trainer
rewards with, so the training signal and the metric cannot drift apart. Sampling goes through the
trainer's sampler (sampler.generate).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass

import torch

from rewards import format_reward
from sampler import generate


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as a product to stay exact for large n (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def decode_completion(tokenizer, tokens: list[int]) -> str:
    """Completion text as rewards see it: everything before the first stop token."""
    stops = set(tokenizer.stop_ids)
    end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:end])


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task,
    examples: list[dict],
    *,
    n: int = 4,
    ks: tuple[int, ...] = (1,),
    max_new_tokens: int = 80,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_prompts: int = 64,
) -> dict:
    """Greedy accuracy, mean@n and pass@k (k <= n) at `temperature`, format rate, length, truncation."""
    from tasks import render_prompt  # imported here: tasks is only needed once examples exist

    prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in examples]
    greedy_correct, sampled_correct, lengths, truncated, formats = [], [], [], [], []
    for start in range(0, len(prompts), batch_prompts):
        chunk, exs = prompts[start : start + batch_prompts], examples[start : start + batch_prompts]
        greedy = generate(
            model, chunk, max_new_tokens=max_new_tokens, n=1, temperature=0.0, stop_ids=tokenizer.stop_ids
        )
        greedy_correct += [task.correct(decode_completion(tokenizer, t), ex) for t, ex in zip(greedy.tokens, exs)]
        if n > 0:
            seeds = [seed + start + i for i in range(len(chunk))]  # per prompt: independent of batching
            sampled = generate(
                model,
                chunk,
                max_new_tokens=max_new_tokens,
                n=n,
                temperature=temperature,
                top_p=top_p,
                stop_ids=tokenizer.stop_ids,
                seed=seeds,
            )
            texts = [decode_completion(tokenizer, t) for t in sampled.tokens]
            sampled_correct += [[task.correct(texts[i * n + j], ex) for j in range(n)] for i, ex in enumerate(exs)]
            lengths += [len(t) for t in sampled.tokens]
            truncated += [f == "length" for f in sampled.finish]
            formats += [format_reward(t, {}) == 1.0 for t in texts]
    res = {"greedy_accuracy": sum(greedy_correct) / len(examples), "examples": len(examples)}
    if n > 0:
        counts = [int(sum(c)) for c in sampled_correct]
        res[f"mean@{n}"] = sum(counts) / (n * len(examples))
        for k in ks:
            if k <= n:
                res[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
        res.update(
            format_rate=sum(formats) / len(formats),
            len_mean=sum(lengths) / len(lengths),
            truncated_frac=sum(truncated) / len(truncated),
        )
    res["accuracy"] = res["greedy_accuracy"]
    return res


# -----------------------------------------------------------------------------
# Plots of one or more runs (matplotlib is an optional extra)

PLOTS = [
    ("reward/mean", "train reward"),
    ("eval/accuracy", "held-out greedy accuracy"),
    ("eval/mean@4", "held-out mean@4"),
    ("entropy", "token entropy"),
    ("grad_norm", "gradient norm"),
    ("len/completion_mean", "completion length"),
]


def read_metrics(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"--plot {run}: no metrics.jsonl in that directory")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


X_AXES = {"step": "step", "time": "training time (s, sample + update, evals excluded)", "tokens": "generated tokens"}


def run_label(run: str) -> str:
    """Runs named NAME-s<seed> are seeds of one configuration NAME (plotted as mean and min-max band)."""
    return re.sub(r"-s\d+$", "", os.path.basename(run.rstrip("/")))


def x_of_step(rows: list[dict], x: str) -> dict[int, float]:
    """Step -> x coordinate: the step, cumulative step time or cumulative generated tokens."""
    out, total = {0: 0.0}, 0.0
    for r in rows:
        if "step" not in r or any(k.startswith("eval/") for k in r):  # eval rows reuse their step's x
            continue
        total += {"step": 0.0, "time": r.get("time/step_s", 0.0), "tokens": r.get("tokens/generated", 0.0)}[x]
        out[r["step"]] = float(r["step"]) if x == "step" else total
    return out


def plot_runs(runs: list[str], out: str, x: str = "step", keys: list[str] | None = None) -> str:
    """One panel per metric; seeds of a configuration (NAME-s0, NAME-s1, ...) become one mean curve
    with a min-max band, at the steps every seed logged."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    if x not in X_AXES:
        raise SystemExit(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    titles = dict(PLOTS)
    panels = [(k, titles.get(k, k)) for k in keys] if keys else PLOTS
    groups: dict[str, list[list[dict]]] = {}
    for run in runs:
        groups.setdefault(run_label(run), []).append(read_metrics(run))
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False)
    for label, seeds in groups.items():
        xs = [x_of_step(rows, x) for rows in seeds]
        for ax, (key, title) in zip(axes.flat, panels):
            series = [{r["step"]: r[key] for r in rows if r.get(key) is not None} for rows in seeds]
            steps = sorted(set.intersection(*(set(s) for s in series)).intersection(*xs))
            if steps:
                vals = [[s[t] for s in series] for t in steps]
                xv = [sum(xm[t] for xm in xs) / len(xs) for t in steps]
                (line,) = ax.plot(
                    xv,
                    [sum(v) / len(v) for v in vals],
                    label=label + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else ""),
                    marker="." if key.startswith("eval") else None,
                )
                if len(seeds) > 1:
                    ax.fill_between(
                        xv, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15
                    )
            ax.set_title(title)
            ax.set_xlabel(X_AXES[x])
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@dataclass
class EvalConfig:
    model: str = "assets/tiny-model"  # HF checkpoint directory to evaluate
    task: str = "synthetic"  # task name (see tasks.py)
    data: str = ""  # JSONL file for file-based tasks
    examples: int = 200  # held-out prompts to evaluate
    n: int = 16  # samples per prompt for mean@n and pass@k (0 = greedy only)
    k: str = "1,4,16"  # comma-separated k values for pass@k (each <= n)
    temperature: float = 1.0  # sampling temperature for mean@n and pass@k
    top_p: float = 1.0  # sampling nucleus
    max_new_tokens: int = 80  # completion length limit
    seed: int = 0  # sampling seed and held-out sample seed
    device: str = "cpu"  # cpu | cuda
    out: str = ""  # write the results as JSON here (empty = print only)


def main(cfg: EvalConfig) -> dict:
    from model import load_model, load_tokenizer
    from tasks import get_task

    model = load_model(cfg.model, device=cfg.device)
    tokenizer = load_tokenizer(cfg.model)
    task = get_task(cfg.task, cfg.data or None)
    examples = task.test(cfg.examples, cfg.seed)
    res = evaluate(
        model,
        tokenizer,
        task,
        examples,
        n=cfg.n,
        ks=tuple(int(k) for k in cfg.k.split(",") if k),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
    )
    width = max(map(len, res))
    print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in res.items()))
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump({"config": asdict(cfg), "results": res}, f, indent=2)
    return res


if __name__ == "__main__":
    import argparse
    import sys

    from cli import parse_config

    if "--plot" in sys.argv[1:]:  # `eval.py --plot RUN [RUN ...] [--out PNG]`
        p = argparse.ArgumentParser(description="Plot the curves of one or more runs into one PNG.", allow_abbrev=False)
        p.add_argument(
            "--plot", nargs="+", required=True, metavar="RUN", help="run directories (each with metrics.jsonl)"
        )
        p.add_argument("--out", default="", help="PNG path (default: RUN/plot.png of the first run)")
        p.add_argument(
            "--x", default="step", choices=list(X_AXES), help="x axis: step, training time or generated tokens"
        )
        p.add_argument(
            "--metrics",
            default="",
            help="comma-separated metric keys, one panel each (default: the six standard curves)",
        )
        args = p.parse_args()
        print(
            plot_runs(
                args.plot,
                args.out or os.path.join(args.plot[0], "plot.png"),
                x=args.x,
                keys=[k for k in args.metrics.split(",") if k] or None,
            )
        )
    else:
        main(parse_config(EvalConfig, description=__doc__.split("\n\n")[0])[0])
