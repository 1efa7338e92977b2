"""bench_trl.py: one GRPO step of train.py against TRL's GRPOTrainer, side by side on the CPU (or a GPU).

    python bench/bench_trl.py                  # about a minute on 2 CPU cores (make bench)
    python bench/bench_trl.py --device cuda    # both sides on the GPU (memory: CUDA's peak allocated)
    python bench/bench_trl.py --threads 1      # steadier when other processes share the cores
    python bench/bench_trl.py --no-share-prompt   # train.py runs each prompt once per completion, like TRL
    python bench/bench_trl.py --model DIR --system-words 235   # 256-token Qwen3.5 prompts: 235 filler words

Both trainers get the same tiny model (assets/tiny-model, or a random model of the same shape
when it has not been built), the same prompt tokens (the synthetic task's prompts rendered with
our chat template, given to TRL as text, in the same order), group size, completion limit,
sampling settings (temperature 1, no top-k/top-p), reward function (the task's `reward`), loss
(per-sequence token mean, clip 0.2, beta 0, one update per batch), optimizer, float32 and thread
count. Each side runs in a fresh process of its own, as a user would run it: one warm-up step, then
`--steps` timed steps; the sides take turns, `--rounds` times each (ours, TRL, ours, TRL, ...), so
a change in machine load hits both, and the table shows the median over all timed steps.
(Running both trainers in one process is not neutral: a constructed GRPOTrainer alone was measured
to slow train.py's steps in the same process by about 30%.)

Time per step is split into sample (prompt tokens -> completion tokens), score (rewards from
text), update (log-probs, loss, backward, optimizer step) and other (the rest of the loop body:
packing, the score pass, advantages). For train.py all four are its own `time/*` metrics: the
total is `time/step_s`, from the step's start to its metrics row (the held-out evaluations,
the last step's included, and the saves are outside it); for TRL the total runs from
`on_step_begin` to `on_step_end` and the parts come from timing its `_generate`,
`_calculate_rewards` and `_generate_and_score_completions`.
The policies stop at different points, so the mean completion length of each side is printed
with the ratio per generated token. TRL is an optional dev dependency (`pip install trl`).
This is a comparison to read, not a test: nothing asserts on a time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = "BENCH_TRL_CHILD"  # set in a child process: the JSON job it runs (one side, one run)


@dataclass
class BenchConfig:
    model: str = "assets/tiny-model"  # HF checkpoint; a random model of the bundled shape if absent
    steps: int = 3  # timed steps per run, after one warm-up step
    rounds: int = 2  # runs per side, in turns, each in a fresh process
    prompts_per_step: int = 8  # prompts per step (both sides)
    group_size: int = 16  # completions per prompt (our --thoughts, TRL's num_generations)
    max_completion_tokens: int = 80  # completion limit (our 64 thought + 16 answer tokens, answers = 1)
    micro_batch_rows: int = 64  # completions per forward/backward (TRL: per_device_train_batch_size)
    share_prompt: bool = (
        True  # train.py --share-prompt (its default): each prompt runs once, its completions attend to it
    )
    lr: float = 3e-4  # learning rate (both sides)
    rollout_dtype: str = "float32"  # train.py --rollout-dtype (TRL samples with the training model, float32)
    threads: int = 2  # torch.set_num_threads for both sides
    device: str = "cpu"  # where both sides train: cpu or cuda (memory: CUDA's peak allocated, not the RSS)
    seed: int = 0  # seed of both trainers and of the prompt order
    system_words: int = 0  # > 0: every prompt's system turn is this many filler words (a longer prompt); 0: the task's

    def __post_init__(self) -> None:
        if (
            self.steps < 1
            or self.rounds < 1
            or self.group_size < 2
            or self.max_completion_tokens < 1
            or self.threads < 1
            or self.system_words < 0
        ):
            raise ValueError(
                "--steps, --rounds, --max-completion-tokens and --threads must be >= 1, --group-size >= 2 and "
                "--system-words >= 0"
            )
        if (self.prompts_per_step * self.group_size) % self.micro_batch_rows:
            raise ValueError(
                "--micro-batch-rows must divide prompts-per-step x group-size (TRL accumulates whole micro-batches)"
            )


# -----------------------------------------------------------------------------
# The model both sides train, and their prompts' system turn


def system_prompt(cfg: BenchConfig, task_prompt: str | None) -> str | None:
    """The system turn of every prompt: the task's, or --system-words filler words (" seven" is one token in the
    Qwen vocabularies), so that a prompt is longer than the synthetic task's question."""
    return " ".join(["seven"] * cfg.system_words) if cfg.system_words else task_prompt


def rss_gib() -> float:
    """The process's resident set size now, in GiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def random_model(path: str) -> str:
    """A random checkpoint with the bundled tiny model's shape and tokenizer (sft.py's recipe)."""
    import torch

    from hf import save_model
    from sft import SFTConfig, build_char_tokenizer, build_model, write_tokenizer
    from tasks import SYNTHETIC_CHARS
    from tokenizer import load_tokenizer

    tok_dir = path + ".tokenizer"
    write_tokenizer(build_char_tokenizer(SYNTHETIC_CHARS), tok_dir)
    torch.manual_seed(0)
    save_model(build_model(SFTConfig(), load_tokenizer(tok_dir)), path, tokenizer_dir=tok_dir)
    return path


# -----------------------------------------------------------------------------
# Ours: train.main, timed from its metrics


def run_ours(cfg: BenchConfig, model_dir: str, work: str) -> tuple[list[dict], list[dict]]:
    """Per-step timings and the examples train.py rendered, in its order."""
    from tqdm import tqdm

    import train

    examples: list[dict] = []

    def recording_render_prompt(tokenizer, example: dict, system_prompt):
        examples.append(example)  # the loop renders each step's prompts once (no dynamic sampling here)
        return render_prompt(tokenizer, example, system_prompt)

    class SilentTqdm(tqdm):
        """The loop's progress bar, off."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    n = cfg.steps + 1
    answer_tokens = min(16, cfg.max_completion_tokens)  # with answers = 1 only the sum of the two limits matters
    tc = train.TrainConfig(
        algo="grpo",
        model=model_dir,
        task="synthetic",
        out=os.path.join(work, "ours"),
        seed=cfg.seed,
        device=cfg.device,
        dtype="float32",
        max_steps=n,
        prompts_per_step=cfg.prompts_per_step,
        thoughts=cfg.group_size,
        answers=1,
        max_thought_tokens=cfg.max_completion_tokens - answer_tokens,
        max_answer_tokens=answer_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        lr=cfg.lr,
        micro_batch_rows=cfg.micro_batch_rows,
        share_prompt=cfg.share_prompt,
        rollout_dtype=cfg.rollout_dtype,
        system_prompt=system_prompt(cfg, None),
        eval_every=0,
        eval_examples=4,
        eval_samples=0,
        samples_every=0,
        save_every=0,
    )
    render_prompt, saved_tqdm = train.render_prompt, train.tqdm
    train.render_prompt, train.tqdm = recording_render_prompt, SilentTqdm
    try:
        train.main(tc)
    finally:
        train.render_prompt, train.tqdm = render_prompt, saved_tqdm
    with open(os.path.join(tc.out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/sample_s" in r]
    steps = []
    for r in rows:  # time/step_s: from the step's start to its metrics row (not the held-out eval that may end it)
        parts = dict(sample=r["time/sample_s"], score=r["time/score_s"], update=r["time/update_s"])
        total = r["time/step_s"]
        steps.append(dict(parts, other=total - sum(parts.values()), total=total, length=r["len/completion_mean"]))
        # memory: the update's peak, and what the process held when it began (the score pass's peak:
        # with mu = 1 and no reference model that phase runs no forward, only packing)
        steps[-1].update(mem_update=r["mem/update_gib"], mem_base=r["mem/score_pass_gib"])
    return steps, examples


# -----------------------------------------------------------------------------
# TRL: GRPOTrainer with the same settings, timed by a callback and wrapped methods


def make_trl(cfg: BenchConfig, model_dir: str, work: str, examples: list[dict]):
    """A GRPOTrainer on the same model, prompts and reward; returns (trainer, function that
    turns its recorded timings into per-step rows once it has trained)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from distributed import memory_peak
    from tasks import get_task, render_prompt
    from tokenizer import decode_completion, load_tokenizer

    task, ours_tok = get_task("synthetic"), load_tokenizer(model_dir)
    prompt_ids = [render_prompt(ours_tok, ex, system_prompt(cfg, task.system_prompt)) for ex in examples]
    # TRL takes prompt text; our char-level tokenizer round-trips it to the same ids (checked below).
    prompts = [ours_tok.decode(ids) for ids in prompt_ids]
    prompt_tokens = sum(map(len, prompt_ids)) / len(prompt_ids)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(model_dir, "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if tokenizer(text=prompts)["input_ids"] != prompt_ids:
        raise SystemExit("bench_trl: TRL's tokenizer does not reproduce our prompt ids; the comparison would be unfair")

    def reward(prompts, completions, completion_ids, idx, **kwargs) -> list[float]:
        """The task's training reward on the completion text, as train.py scores it."""
        texts = [decode_completion(ours_tok, ids) for ids in completion_ids]  # same text as train.py sees
        return [task.reward(text, examples[i]) for text, i in zip(texts, idx)]

    args = GRPOConfig(
        output_dir=os.path.join(work, "trl"),
        seed=cfg.seed,
        use_cpu=cfg.device == "cpu",
        bf16=False,
        fp16=False,
        max_steps=cfg.steps + 1,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        per_device_train_batch_size=cfg.micro_batch_rows,
        gradient_accumulation_steps=cfg.prompts_per_step * cfg.group_size // cfg.micro_batch_rows,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_completion_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": prompts, "idx": list(range(len(prompts)))})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer)

    timings: dict[str, list[float]] = {"sample": [], "score": [], "gen_and_score": [], "step": []}
    memory: dict[str, list[float]] = {"base": [], "update": []}  # GiB, as train.py measures its phases
    lengths: list[float] = []

    def timed(name: str, key: str) -> None:
        fn = getattr(trainer, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timings[key].append(time.perf_counter() - t)
            if name == "_generate":  # (prompt_ids, completion_ids, ...): completion lengths incl. the stop token
                lengths.append(statistics.mean(len(c) for c in out[1]))
            if name == "_generate_and_score_completions":  # the update begins: its baseline, then its peak
                memory["base"].append(rss_gib() if cfg.device == "cpu" else torch.cuda.memory_allocated() / 2**30)
                memory_peak(torch.device(cfg.device))  # resets the peak (VmHWM, or CUDA's) to what is held now
            return out

        setattr(trainer, name, wrapper)

    timed("_generate", "sample")
    timed("_calculate_rewards", "score")
    timed("_generate_and_score_completions", "gen_and_score")

    class StepClock(TrainerCallback):
        """Times each optimizer step."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["step"].append(time.perf_counter() - self.t0)
            memory["update"].append(memory_peak(torch.device(cfg.device)))

    trainer.add_callback(StepClock())

    def results() -> list[dict]:
        steps = []
        for sample, score, gs, total, length, base, peak in zip(
            timings["sample"], timings["score"], timings["gen_and_score"], timings["step"], lengths,
            memory["base"], memory["update"],
        ):  # fmt: skip
            times = dict(sample=sample, score=score, update=total - gs, other=gs - sample - score, total=total)
            steps.append(dict(times, length=length, mem_update=peak, mem_base=base, prompt=prompt_tokens))
        return steps

    return trainer, results


# -----------------------------------------------------------------------------
# Taking turns: each side in a fresh process, ours, TRL, ours, TRL, ...


def run_side(side: str, cfg: BenchConfig, model_dir: str, work: str) -> list[dict]:
    """One run of one side in this process: its per-step rows, warm-up step dropped."""
    import torch

    from tasks import get_task

    torch.set_num_threads(cfg.threads)
    n = cfg.steps + 1
    # train.py's prompts: the first n * P training examples, in order (checked against what it renders).
    examples = get_task("synthetic").train(n * cfg.prompts_per_step, cfg.seed)
    if side == "ours":
        steps, rendered = run_ours(cfg, model_dir, work)
        if rendered != examples:
            raise SystemExit(
                "bench_trl: train.py trained on other prompts than TRL is given; update run_side to match "
                "how train.py draws its examples"
            )
    else:
        with warnings.catch_warnings():  # transformers' deprecation notices about TRL's own arguments
            warnings.simplefilter("ignore", FutureWarning)
            trainer, trl_results = make_trl(cfg, model_dir, work, examples)
            with contextlib.redirect_stdout(io.StringIO()):  # TRL prints a summary
                trainer.train()
        steps = trl_results()
    if len(steps) != n:
        raise SystemExit(f"bench_trl: timed {len(steps)} steps of {side}, expected {n}")
    return steps[1:]


def run_both(cfg: BenchConfig, model_dir: str, work: str) -> tuple[list[dict], list[dict]]:
    """Per-step rows of train.py and TRL over all rounds, each run a fresh `python bench_trl.py` child."""
    out = {"ours": [], "trl": []}
    for r in range(cfg.rounds):
        for side in ("ours", "trl"):
            job = dict(
                side=side,
                cfg=asdict(cfg),
                model_dir=model_dir,
                work=os.path.join(work, f"{side}{r}"),
                result=os.path.join(work, f"{side}{r}.json"),
            )
            proc = subprocess.run(
                [sys.executable, __file__], env={**os.environ, CHILD: json.dumps(job)}, capture_output=True, text=True
            )
            if proc.returncode:
                raise SystemExit(f"bench_trl: the {side} run failed:\n{proc.stderr[-3000:]}")
            with open(job["result"]) as f:
                out[side] += [dict(row, round=r) for row in json.load(f)]
    return out["ours"], out["trl"]


# -----------------------------------------------------------------------------
# Report


def mean_of(steps: list[dict], key: str) -> float:
    return statistics.mean(s[key] for s in steps)


def median_of(steps: list[dict], key: str) -> float:
    """Median over the timed steps: one step slowed by another process does not move it."""
    return statistics.median(s[key] for s in steps)


def report(cfg: BenchConfig, ours: list[dict], trl: list[dict], model_note: str) -> None:
    keys = ("sample", "score", "update", "other", "total")
    print(
        f"\none GRPO step: {cfg.prompts_per_step} prompts x {cfg.group_size} completions, "
        f"<= {cfg.max_completion_tokens} "
        f"tokens, {model_note}, float32 CPU, {cfg.threads} threads; median of {cfg.rounds} runs x {cfg.steps} steps "
        f"(each run a fresh process, after 1 warm-up step)"
    )
    n_seqs = cfg.prompts_per_step * cfg.group_size
    print(f"prompts: {mean_of(trl, 'prompt'):.0f} tokens on average (the same ids on both sides)")
    print(f"{'seconds/step':<16}" + "".join(f"{k:>9}" for k in keys) + f"{'mean len':>10}{'tok/step':>10}")
    for name, steps in (("train.py", ours), ("TRL", trl)):
        length = mean_of(steps, "length")
        print(
            f"{name:<16}"
            + "".join(f"{median_of(steps, k):9.3f}" for k in keys)
            + f"{length:10.1f}{length * n_seqs:10.0f}"
        )
    print(
        f"{'TRL / train.py':<16}" + "".join(f"{median_of(trl, k) / max(median_of(ours, k), 1e-9):8.1f}x" for k in keys)
    )
    # Time per generated token, so a side whose policy stops earlier does not look faster for it.
    per_tok = (median_of(trl, "total") / mean_of(trl, "length")) / (median_of(ours, "total") / mean_of(ours, "length"))
    print(f"step time per generated token, TRL / train.py: {per_tok:.1f}x")
    # the spread: each round's ratio of medians (the sides ran back to back), and each side's range over steps
    for key in ("total", "update"):
        per_round = [
            median_of([s for s in trl if s["round"] == r], key) / median_of([s for s in ours if s["round"] == r], key)
            for r in range(cfg.rounds)
        ]
        ranges = ", ".join(
            f"{name} {min(s[key] for s in steps):.2f}-{max(s[key] for s in steps):.2f} s"
            for name, steps in (("train.py", ours), ("TRL", trl))
        )
        rounds = ", ".join(f"{x:.2f}x" for x in per_round)
        print(f"{key}: TRL / train.py per round {rounds}; range over steps: {ranges}")
    # memory of the update (last timed step: AdamW's state exists throughout), CPU peak RSS in GiB
    o, t = ours[-1], trl[-1]
    o_act, t_act = o["mem_update"] - o["mem_base"], t["mem_update"] - t["mem_base"]
    print(
        f"update peak RSS: train.py {o['mem_update']:.2f} GiB, TRL {t['mem_update']:.2f} GiB "
        f"(train.py / TRL = {o['mem_update'] / t['mem_update']:.2f}x); above the RSS at its start (activations, "
        f"logits, gradients): train.py {o_act:.2f}, TRL {t_act:.2f} GiB ({o_act / max(t_act, 1e-9):.2f}x)"
    )
    print(
        "(train.py 'other' = pack, score pass and advantages; TRL 'other' = padding, advantages and "
        "metrics inside _generate_and_score_completions)"
    )


def main(cfg: BenchConfig) -> None:
    try:
        import trl  # noqa: F401  (optional dev dependency)
    except ImportError:
        print("TRL not installed: pip install trl (optional)")
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:  # other processes compete for the cores: both sides slow down, not always equally
        print(
            f"note: load average {load:.1f} on {cores} cores: other processes share them, so times are inflated and "
            f"noisy, more so with --threads > 1 (--threads 1 is steadier)"
        )
    with tempfile.TemporaryDirectory(prefix="bench_trl-") as work:
        model_dir = str(ROOT / cfg.model) if cfg.model == BenchConfig.model else cfg.model  # the default: from any cwd
        model_note = f"model {cfg.model}"
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            if cfg.model != BenchConfig.model:
                raise SystemExit(f"--model {cfg.model}: no config.json there; pass an HF checkpoint directory")
            model_dir = random_model(os.path.join(work, "random-tiny-model"))
            model_note = f"random model of the bundled shape ({cfg.model} not built)"
        t0 = time.perf_counter()
        ours, trl_steps = run_both(cfg, model_dir, work)
        elapsed = time.perf_counter() - t0
    report(cfg, ours, trl_steps, model_note)
    print(f"(all runs, start-up and train.py's start/end evaluation included: {elapsed:.0f}s)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for var, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ):
        os.environ.setdefault(var, value)
    if CHILD in os.environ:  # one run of one side, started by run_both
        job = json.loads(os.environ[CHILD])
        rows = run_side(job["side"], BenchConfig(**job["cfg"]), job["model_dir"], job["work"])
        with open(job["result"], "w") as f:
            json.dump(rows, f)
    else:
        from cli import parse_config

        main(parse_config(BenchConfig, description=__doc__.split("\n\n")[0])[0])
