"""eval.py: the evaluation command line (heldout.evaluate: greedy accuracy, mean@n, unbiased pass@k), the
pass-rate pass for train.py --select (methods/hard_examples.py) and plots of runs (eval.py --plot RUN [RUN ...];
its flags: eval.py --help --plot).

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

import sys

import cli

if __name__ == "__main__" and "--plot" not in sys.argv:  # a mistyped flag fails here, before torch loads
    cli.check_flag_names("eval.py:EvalFlags", "methods/tools*.py:Flags")

import json
import math
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch

from checkpoint import hold_lock
from cli import first_error, user_errors
from fused import fuse_for_sampling
from graphs import can_compile, check_torch, decode_runner
from heldout import evaluate
from hf import BUNDLED, bundled
from methods import tools
from methods.hard_examples import pass_rate_examples, resume_pass_rates, write_pass_rates
from tasks import TASK_NAMES, Task, check_prompt_lengths, check_sizes, get_task

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
        raise ValueError(f"--plot {run}: no metrics.jsonl in that directory")
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
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    if x not in X_AXES:
        raise ValueError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    titles = dict(PLOTS)
    panels = [(k, titles.get(k, k)) for k in keys] if keys else PLOTS
    groups: dict[str, list[list[dict]]] = {}
    for run in runs:
        groups.setdefault(run_label(run), []).append(read_metrics(run))
    colors = {label: f"C{i}" for i, label in enumerate(groups)}  # a run's colour, the same in every panel
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False)
    for label, seeds in groups.items():
        xs = [x_of_step(rows, x) for rows in seeds]
        name = label + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else "")
        for ax, (key, title) in zip(axes.flat, panels):
            series = [{r["step"]: r[key] for r in rows if r.get(key) is not None} for rows in seeds]
            steps = sorted(set.intersection(*(set(s) for s in series)).intersection(*xs))
            if steps:
                vals = [[s[t] for s in series] for t in steps]
                xv = [sum(xm[t] for xm in xs) / len(xs) for t in steps]
                marker = "." if key.startswith("eval") else None
                ax.plot(xv, [sum(v) / len(v) for v in vals], label=name, marker=marker, color=colors[label])
                if len(seeds) > 1:
                    ax.fill_between(xv, [min(v) for v in vals], [max(v) for v in vals], color=colors[label], alpha=0.15)
            ax.set_title(title)
            ax.set_xlabel(X_AXES[x])
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_by_config(runs: list[str], out: str, **kw) -> list[str]:
    """plot_runs for each group of runs that share a task and a model (their config.json): curves of different tasks
    or models never share axes. One group: `out`; several: out's name plus -TASK-MODEL each (make plot)."""
    groups: dict[str, list[str]] = {}
    for run in runs:
        flags = json.load(open(path)) if os.path.isfile(path := os.path.join(run, "config.json")) else {}
        key = f"{flags.get('task', 'task')}-{os.path.basename(str(flags.get('model', 'model')).rstrip('/'))}"
        groups.setdefault(re.sub(r"[^\w.-]+", "_", key), []).append(run)
    stem, ext = os.path.splitext(out)
    return [plot_runs(runs, out if len(groups) == 1 else f"{stem}-{key}{ext}", **kw) for key, runs in groups.items()]


@dataclass
class EvalFlags:  # eval.py's own flags, ahead of the tool flags in --help (EvalConfig adds those)
    # -- run
    model: str = BUNDLED  # HF checkpoint directory to evaluate
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
    system_prompt: str | None = None  # system turn of every prompt, replacing the task's ("" = no system turn)
    enable_thinking: bool = True  # Qwen3 chat template's thinking switch (off: an empty thought is pre-filled)
    compile: bool = False  # torch.compile the decode step (inside the CUDA graphs on a GPU; on CPU it takes minutes)
    cuda_graphs: bool = True  # CUDA: CUDA-graph decode, small functions compiled (graphs.py); --no-cuda-graphs: eager
    # -- output
    device: str = "auto"  # where to run (auto: cuda when available, else cpu; cuda:N picks a GPU)
    out: str = ""  # write the results as JSON here (empty = print only)
    pass_rates: bool = False  # rate the first --examples TRAINING examples, --k samples each, into --out (resumes)


@dataclass
class EvalConfig(tools.Flags, EvalFlags):  # --tools python: evaluate with the tool (methods/tools.py), as trained
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = dict(task=TASK_NAMES, device=("auto", "cpu", "cuda", "cuda:N"))
    CHOICES |= tools.CHOICES

    def __post_init__(self) -> None:
        """Validate, never rewrite: every impossible flag is one sentence, before any data or model is read."""
        device = re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)
        cuda = self.device in ("auto", "cpu") or torch.cuda.is_available()
        checks = [
            (not self.pass_rates or bool(self.out), "--pass-rates writes one row per example to --out FILE.jsonl"),
            (not (self.pass_rates and self.tools != "off"), "--pass-rates samples without a tool: drop --tools"),
            (self.task in TASK_NAMES, f"--task must be one of {', '.join(TASK_NAMES)}, got {self.task!r}"),
            (self.examples >= 1, f"--examples must be >= 1 (held-out prompts to evaluate), got {self.examples}"),
            (self.n >= 0, f"--n must be >= 0 (samples per prompt; 0 = greedy only), got {self.n}"),
            (self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1] (1 = off), got {self.top_p}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (device is not None, f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}"),
            (cuda, f"--device {self.device}: no CUDA device is available; use --device cpu"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if errors := list(tools.check_flags(self)):  # the tool flags' checks, as train.py runs them
            raise first_error(errors)
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
    import lora
    from hf import load_model
    from tokenizer import load_tokenizer

    # Data first, then the model: a bad file or flag fails in seconds, not after loading weights.
    # A user's error (data, checkpoint, a prompt too long) ends in one sentence, not a traceback.
    with user_errors():
        check_torch()
        cfg = replace(cfg, device="cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg
        task, examples = load_examples(cfg)
        task = task if cfg.system_prompt is None else replace(task, system_prompt=cfg.system_prompt)
        tokenizer = load_tokenizer(cfg.model, enable_thinking=cfg.enable_thinking)
        if lora.is_adapter_dir(cfg.model):  # a LoRA run's checkpoint: its base model with the adapters merged in
            model = lora.merged_copy(lora.load_adapted(cfg.model, device=cfg.device)[0])
        else:
            model = load_model(cfg.model, device=cfg.device)
        if model.lm_head.weight.is_cuda:  # fused projections, compiled small functions: fewer kernels (fused.py)
            model = fuse_for_sampling(model, can_compile(model.lm_head.weight.device, cfg.cuda_graphs))
        context = model.config.max_position_embeddings
        if cfg.max_new_tokens >= context:
            raise ValueError(
                f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the model's context of "
                f"{context} tokens; lower --max-new-tokens."
            )
        limit = f"the model's context of {context} tokens minus --max-new-tokens {cfg.max_new_tokens}"
        check_prompt_lengths(tokenizer, examples, task.system_prompt, context - cfg.max_new_tokens, limit)
        tools.ready(cfg, tokenizer)  # --tools: the tokenizer writes the call's marker, a call runs under the limits
        keys = ("model", "task", "data", "examples", "temperature", "top_p", "max_new_tokens", "seed")
        keys += ("system_prompt", "enable_thinking")  # they change the prompts
        settings = {**{key: getattr(cfg, key) for key in keys}, "k": cfg.rate_samples()} if cfg.pass_rates else {}
        if cfg.pass_rates:  # one writer per file: a second pass on the same --out is refused while this one runs
            hold_lock(cfg.out, f"--out {cfg.out}")
        done = resume_pass_rates(cfg.out, settings, examples) if cfg.pass_rates else {}
    # CUDA graphs by default on a GPU (graphs.py); --compile compiles the decode step they capture
    static_step = decode_runner(torch.device(cfg.device), graphs=cfg.cuda_graphs, compile=cfg.compile)
    sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    sampling.update(static_step=static_step)
    if cfg.pass_rates:
        rates = write_pass_rates(model, tokenizer, task, examples, cfg.out, settings, done, k=settings["k"], **sampling)
        res = {"pass_rate_mean": sum(rates) / len(rates), "zero_frac": sum(r == 0 for r in rates) / len(rates)}
        mean, zero = res["pass_rate_mean"], res["zero_frac"]
        print(f"{cfg.out}: {len(rates)} pass rates over k={settings['k']}; mean {mean:.4f}, {zero:.1%} at 0")
        return res
    sampling.update(rollout=tools.evaluator(cfg, tokenizer, task))  # --tools: the trainer's multi-turn rollouts
    res = evaluate(model, tokenizer, task, examples, n=cfg.n, ks=cfg.pass_ks(), **sampling)
    width = max(map(len, res))
    print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in res.items()))
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump({"config": asdict(cfg), "results": res}, f, indent=2)
    return res


if __name__ == "__main__":
    if "--plot" in sys.argv[1:]:  # `eval.py --plot RUN [RUN ...] [--out PNG]`
        p = cli.Parser(description="Plot the curves of one or more runs into one PNG.", allow_abbrev=False)
        add = p.add_argument
        add("--plot", nargs="+", required=True, metavar="RUN", help="run directories (each with metrics.jsonl)")
        add("--out", default="", help="PNG path (default: RUN/plot.png of the first run)")
        add("--x", default="step", choices=list(X_AXES), help="x axis: step, training time or generated tokens")
        add("--metrics", default="", help="comma-separated metric keys, one panel each (default: six standard ones)")
        args = p.parse_args()
        keys = [k for k in args.metrics.split(",") if k] or None
        with user_errors():
            print(*plot_by_config(args.plot, args.out or os.path.join(args.plot[0], "plot.png"), x=args.x, keys=keys))
    else:
        with user_errors():
            cfg = cli.parse_config(EvalConfig, description=__doc__.split("\n\n")[0])[0]
            main(replace(cfg, model=bundled(cfg.model)))
