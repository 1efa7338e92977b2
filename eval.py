"""eval.py: held-out evaluation (greedy accuracy, mean@n, unbiased pass@k) and plots of runs.

    python eval.py --model assets/tiny-model --task synthetic --n 16 --k 1,4,16
    python eval.py --model runs/default/final --task gsm8k --test-data test.jsonl --out eval.json
    python eval.py --plot runs/grpo runs/grpo_ma      # curves of one or more runs in one PNG
    python eval.py --plot runs/exp/t4a4-s0 runs/exp/t4a4-s1 --x time --metrics eval/accuracy,grad_norm
    python eval.py --pass-rates --k 10 --examples 1000 --out rates.jsonl   # for train.py --select hardest

Correctness comes from the task's own functions (tasks.py / rewards.py), the same ones the trainer
rewards with, so the training signal and the metric cannot drift apart. Sampling goes through the
trainer's sampler (sampler.generate). Flags are checked when parsed and the data is read before
the model, so a wrong flag or a bad data file fails at once, in one sentence.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from tqdm import tqdm

from advantage import select_hard_examples
from cli import user_errors
from heldout import decode_completion, evaluate
from sampler import generate
from tasks import TASK_NAMES, Task, check_prompt_lengths, check_sizes, get_task, render_prompt, restrict_train

# -----------------------------------------------------------------------------
# Pass rates of the starting model on the training split (Hard Examples, arXiv 2508.14094), for train.py --select
# A file: one settings header line {"pass_rates": {...}}, then one row {"index", "prompt", "pass_rate"} per example.

PASS_RATE_CHUNK = 16  # prompts sampled together; fixed, so a resumed pass batches (and samples) as an uninterrupted one


def pass_rate_examples(task: Task, n: int) -> list[dict]:
    """The examples a pass-rate file rates: the first n of the training split in its fixed (seed 0) order,
    whatever a run's --seed (task.train is prefix-stable in n), so row index i is example i here and in train.py."""
    return task.train(n, 0)


def read_pass_rates(path: str) -> tuple[dict | None, list[dict]]:
    """(settings header or None, rows sorted by index) of a pass-rate file; a bad line is a ValueError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such pass-rate file; write one with eval.py --pass-rates --out {path}")
    header, rows = None, []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path} line {line_no}: not valid JSON (an interrupted pass? rerun it)") from None
            if line_no == 1 and isinstance(row, dict) and isinstance(row.get("pass_rates"), dict):
                header = row["pass_rates"]
                continue
            get = row.get if isinstance(row, dict) else {}.get
            rate_ok = type(get("pass_rate")) in (int, float) and 0 <= get("pass_rate") <= 1
            if not (type(get("index")) is int and get("index") >= 0 and isinstance(get("prompt"), str) and rate_ok):
                raise ValueError(f'{path} line {line_no}: expected {{"index": I, "prompt": TEXT, "pass_rate": 0..1}}')
            rows.append(row)
    rows.sort(key=lambda r: r["index"])
    for a, b in zip(rows, rows[1:]):
        if a["index"] == b["index"]:
            raise ValueError(f"{path}: example {a['index']} has two rows; keep one")
    return header, rows


def resume_pass_rates(path: str, settings: dict, examples: list[dict]) -> dict[int, float]:
    """The rates an interrupted pass left in `path` (index -> rate; {} when the file is absent or empty), after
    cutting a torn last line. A file made with other settings, or for other examples, is a ValueError."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return {}
    with open(path, "rb+") as f:  # a pass killed mid-write leaves a line without its newline: drop it
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
    header, rows = read_pass_rates(path)
    if header != settings:
        old = header or {}
        diff = "; ".join(f"{k} {v!r} here, {old.get(k)!r} in the file" for k, v in settings.items() if old.get(k) != v)
        raise ValueError(
            f"--out {path} holds pass rates made with other settings ({diff}); pass another --out or delete the file"
        )
    for r in rows:
        if r["index"] >= len(examples) or examples[r["index"]]["prompt"] != r["prompt"]:
            raise ValueError(f"--out {path}: row {r['index']} is not this task's training example {r['index']}")
    return {r["index"]: r["pass_rate"] for r in rows}


@torch.no_grad()
def write_pass_rates(
    model,
    tokenizer,
    task: Task,
    examples: list[dict],
    path: str,
    settings: dict,
    done: dict[int, float],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Per example, the fraction of k samples that task.correct accepts, appended to `path` as it goes (after the
    settings header, for a new file); the examples in `done` (resume_pass_rates) are skipped. Example i samples
    with seed + i in its fixed chunk of PASS_RATE_CHUNK, so a resumed pass writes an uninterrupted one's rows."""
    rates = dict(done)
    bar = tqdm(total=len(examples), initial=len(done), desc="pass rates", dynamic_ncols=True)
    with open(path, "a") as f, bar:
        if f.tell() == 0:
            f.write(json.dumps({"pass_rates": settings}) + "\n")
        for start in range(0, len(examples), PASS_RATE_CHUNK):
            chunk = examples[start : start + PASS_RATE_CHUNK]
            if all(start + j in done for j in range(len(chunk))):
                continue
            out = generate(
                model,
                [render_prompt(tokenizer, ex, task.system_prompt) for ex in chunk],
                max_new_tokens=max_new_tokens,
                n=k,
                temperature=temperature,
                top_p=top_p,
                stop_ids=tokenizer.stop_ids,
                seed=[seed + start + j for j in range(len(chunk))],
            )
            for j, ex in enumerate(chunk):
                if start + j not in done:
                    texts = [decode_completion(tokenizer, t) for t in out.tokens[j * k : (j + 1) * k]]
                    rates[start + j] = sum(task.correct(t, ex) for t in texts) / k
                    row = {"index": start + j, "prompt": ex["prompt"], "pass_rate": rates[start + j]}
                    f.write(json.dumps(row) + "\n")
                    bar.update(1)
            f.flush()
    return [rates[i] for i in range(len(examples))]


def select_examples(task: Task, path: str, mode: str, fraction: float, seed: int) -> Task:
    """train.py --select: `task` with its training split cut to the `mode` `fraction` of the examples rated in the
    pass-rate file `path` (advantage.select_hard_examples: ties in index order; random: a draw seeded by `seed`).
    Rows are matched to pass_rate_examples by index and checked by prompt; a mismatch, or an unfinished pass,
    is a ValueError."""
    header, rows = read_pass_rates(path)
    if header is not None and len(rows) < header.get("examples", 0):
        raise ValueError(
            f"--pass-rates {path} rates {len(rows)} of its {header['examples']} examples: the pass was interrupted; "
            "rerun the same eval.py --pass-rates command to finish it"
        )
    if not rows:
        raise ValueError(f"--pass-rates {path} has no rows; write it with python eval.py --pass-rates --out {path}")
    n = rows[-1]["index"] + 1
    if task.n_train is not None and n > task.n_train:
        raise ValueError(
            f"--pass-rates {path} rates example {n - 1} but {task.train_source} has {task.n_train} training "
            "examples; it was made for another task or data file"
        )
    examples = pass_rate_examples(task, n)
    bad = next((r["index"] for r in rows if examples[r["index"]]["prompt"] != r["prompt"]), None)
    if bad is not None:
        raise ValueError(
            f"--pass-rates {path}: row {bad}'s prompt is not training example {bad}'s "
            f"({examples[bad]['prompt'][:40]!r}); it was made for another task or data file"
        )
    rates = torch.tensor([r["pass_rate"] for r in rows], dtype=torch.float64)
    idx = select_hard_examples(rates, fraction, mode=mode, generator=torch.Generator().manual_seed(seed))
    chosen = [examples[rows[i]["index"]] for i in idx.tolist()]
    return restrict_train(task, chosen, f"the --select {mode} {fraction:g} of {path}")


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
    # -- run
    model: str = "assets/tiny-model"  # HF checkpoint directory to evaluate
    task: str = "synthetic"  # task name (see tasks.py)
    data: str = ""  # JSONL file for file-based tasks (held out: every 10th example, unless --test-data)
    test_data: str = ""  # JSONL file of held-out examples for file-based tasks (all of it; --data then unneeded)
    # -- sampling and pass@k
    examples: int = 200  # held-out prompts to evaluate (an error if the held-out split has fewer)
    n: int = 16  # samples per prompt for mean@n and pass@k (0 = greedy only)
    k: str = ""  # comma-separated k values for pass@k, each <= n (empty = 1, 4, 16, ... below n, and n)
    temperature: float = 1.0  # sampling temperature for mean@n and pass@k (0 = greedy)
    top_p: float = 1.0  # sampling nucleus, in (0, 1] (1 = off)
    max_new_tokens: int = 80  # completion length limit
    seed: int = 0  # sampling seed and held-out sample seed
    # -- output
    device: str = "cpu"  # where to run (cuda:N picks a GPU)
    out: str = ""  # write the results as JSON here (empty = print only)
    pass_rates: bool = False  # rate the first --examples TRAINING examples, --k samples each, into --out (resumes)

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(task=TASK_NAMES, device=("cpu", "cuda", "cuda:N"))

    def __post_init__(self) -> None:
        """Validate, never rewrite: every impossible flag is one sentence, before any data or model is read."""
        checks = [
            (not self.pass_rates or bool(self.out), "--pass-rates writes one row per example to --out FILE.jsonl"),
            (self.task in TASK_NAMES, f"--task must be one of {', '.join(TASK_NAMES)}, got {self.task!r}"),
            (self.examples >= 1, f"--examples must be >= 1 (held-out prompts to evaluate), got {self.examples}"),
            (self.n >= 0, f"--n must be >= 0 (samples per prompt; 0 = greedy only), got {self.n}"),
            (self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1] (1 = off), got {self.top_p}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (
                re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                f"--device must be cpu, cuda or cuda:N, got {self.device!r}",
            ),
            (
                self.device == "cpu" or torch.cuda.is_available(),
                f"--device {self.device}: no CUDA device is available; use --device cpu",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        self.rate_samples() if self.pass_rates else self.pass_ks()  # raise on a bad --k

    def rate_samples(self) -> int:
        """--pass-rates: the samples per example, --k's one value (empty = 10, as Hard Examples' code; --n unused)."""
        k = int(self.k) if self.k.strip().isdigit() else 0 if self.k.strip() else 10
        if k < 1:
            raise ValueError(f"--pass-rates takes one --k value >= 1 (samples per example, e.g. 10), got {self.k!r}")
        return k

    def pass_ks(self) -> tuple[int, ...]:
        """The k values of pass@k: --k, or when empty 1, 4, 16, ... below --n, and --n itself."""
        if not self.k.strip():
            return tuple(4**i for i in range(self.n.bit_length()) if 4**i < self.n) + (self.n,) if self.n else ()
        try:
            ks = sorted({int(k) for k in self.k.split(",") if k.strip()})
        except ValueError:
            ks = []
        if not ks:
            raise ValueError(f"--k must be comma-separated integers such as 1,4,16, got {self.k!r}")
        if ks[0] < 1:
            raise ValueError(f"--k values must be >= 1 (pass@k draws k samples), got {ks[0]}")
        if self.n == 0:
            raise ValueError(f"--k {self.k} needs sampled completions but --n 0 is greedy only; raise --n or drop --k")
        if ks[-1] > self.n:
            raise ValueError(
                f"--k {ks[-1]} is above --n {self.n}: pass@k needs at least k samples per prompt; "
                f"raise --n to {ks[-1]} or drop {ks[-1]} from --k"
            )
        return tuple(ks)


def load_examples(cfg: EvalConfig) -> tuple[Task, list[dict]]:
    """The task and its first `cfg.examples` held-out examples (--pass-rates: training examples, pass_rate_examples);
    a bad file or too few examples is a ValueError."""
    task = get_task(cfg.task, cfg.data or None, cfg.test_data or None)
    if cfg.pass_rates:
        check_sizes(task, train=cfg.examples, train_flag="--examples")
        return task, pass_rate_examples(task, cfg.examples)
    check_sizes(task, test=cfg.examples, test_flag="--examples")
    return task, task.test(cfg.examples, cfg.seed)


def main(cfg: EvalConfig) -> dict:
    from model import load_model, load_tokenizer

    # Data first, then the model: a bad file or flag fails in seconds, not after loading weights.
    # A user's error (data, checkpoint, a prompt too long) ends in one sentence, not a traceback.
    with user_errors():
        task, examples = load_examples(cfg)
        tokenizer = load_tokenizer(cfg.model)
        model = load_model(cfg.model, device=cfg.device)
        context = model.config.max_position_embeddings
        if cfg.max_new_tokens >= context:
            raise ValueError(
                f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the model's context of "
                f"{context} tokens; lower --max-new-tokens."
            )
        limit = f"the model's context of {context} tokens minus --max-new-tokens {cfg.max_new_tokens}"
        check_prompt_lengths(tokenizer, examples, task.system_prompt, context - cfg.max_new_tokens, limit)
        keys = ("model", "task", "data", "examples", "temperature", "top_p", "max_new_tokens", "seed")
        settings = {**{key: getattr(cfg, key) for key in keys}, "k": cfg.rate_samples()} if cfg.pass_rates else {}
        done = resume_pass_rates(cfg.out, settings, examples) if cfg.pass_rates else {}
    if cfg.pass_rates:
        rates = write_pass_rates(
            model,
            tokenizer,
            task,
            examples,
            cfg.out,
            settings,
            done,
            k=settings["k"],
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=cfg.seed,
        )
        res = {"pass_rate_mean": sum(rates) / len(rates), "zero_frac": sum(r == 0 for r in rates) / len(rates)}
        mean, zero = res["pass_rate_mean"], res["zero_frac"]
        print(f"{cfg.out}: {len(rates)} pass rates over k={settings['k']}; mean {mean:.4f}, {zero:.1%} at 0")
        return res
    res = evaluate(
        model,
        tokenizer,
        task,
        examples,
        n=cfg.n,
        ks=cfg.pass_ks(),
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
        with user_errors():
            main(parse_config(EvalConfig, description=__doc__.split("\n\n")[0])[0])
