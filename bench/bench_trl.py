"""bench_trl.py: one GRPO step of train.py against TRL's GRPOTrainer, side by side on the CPU.

    python bench/bench_trl.py                  # about 2 minutes on 2 CPU cores (make bench)
    python bench/bench_trl.py --steps 5 --threads 4

Both trainers get the same tiny model (assets/tiny-model, or a random model of the same shape
when it has not been built), the same prompt tokens (the synthetic task's prompts rendered with
our chat template, given to TRL as text, in the same order), group size, completion limit,
sampling settings (temperature 1, no top-k/top-p), reward function (the task's `score`), loss
(per-sequence token mean, clip 0.2, beta 0, one update per batch), optimizer, float32 and thread
count. Each side runs one warm-up step, then `--steps` timed steps.

Time per step is split into sample (prompt tokens -> completion tokens), score (rewards from
text), update (log-probs, loss, backward, optimizer step) and other (the rest of the loop body:
packing, advantages, bookkeeping). For train.py the first three are its own `time/*` metrics
and the total is the wall time of its loop body (the start/end evaluation and the final save
are outside it); for TRL the total runs from `on_step_begin` to `on_step_end` and the parts
come from timing its `_generate`, `_calculate_rewards` and `_generate_and_score_completions`.
The policies stop at different points, so the mean completion length of each side is printed
with the ratio per generated token. TRL is an optional dev dependency (`pip install trl`).
This is a comparison to read, not a test: nothing asserts on a time.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BenchConfig:
    model: str = "assets/tiny-model"  # HF checkpoint; a random model of the bundled shape if absent
    steps: int = 3  # timed steps per side, after one warm-up step
    prompts_per_step: int = 8  # prompts per step (both sides)
    group_size: int = 16  # completions per prompt (our --thoughts, TRL's num_generations)
    max_completion_tokens: int = 80  # completion limit (our 64 thought + 16 answer tokens, answers = 1)
    micro_batch_rows: int = 64  # completions per forward/backward (TRL: per_device_train_batch_size)
    lr: float = 3e-4  # learning rate (both sides)
    threads: int = 2  # torch.set_num_threads for both sides
    seed: int = 0  # seed of both trainers and of the prompt order


# -----------------------------------------------------------------------------
# Shared inputs: the model directory and the prompts of every step


def random_model(path: str) -> str:
    """A random checkpoint with the bundled tiny model's shape and tokenizer (sft.py's recipe)."""
    import torch
    from model import ModelConfig, Transformer, save_model
    from sft import SFTConfig, build_char_tokenizer, write_tokenizer
    from tasks import SYNTHETIC_CHARS
    s = SFTConfig()
    tok = build_char_tokenizer(SYNTHETIC_CHARS)
    tok_dir = path + ".tokenizer"
    write_tokenizer(tok, tok_dir)
    config = ModelConfig(vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=s.hidden_size,
                         intermediate_size=s.intermediate_size, num_hidden_layers=s.layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.hidden_size // s.heads,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True,
                         model_type="qwen2", max_position_embeddings=256, bos_token_id=None,
                         eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = Transformer(config)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 else torch.nn.init.zeros_(p) if "bias" in name else torch.nn.init.ones_(p)
    save_model(model, path, tokenizer_dir=tok_dir)
    return path


def step_examples(cfg: BenchConfig, n_steps: int) -> list[dict]:
    """The examples train.py draws for steps 0 .. n_steps-1, in its order (prompt-major per step)."""
    from tasks import get_task
    from train import example_index
    pool = get_task("synthetic").train()
    return [pool[example_index(cfg.seed, step * cfg.prompts_per_step + s, len(pool))]
            for step in range(n_steps) for s in range(cfg.prompts_per_step)]


# -----------------------------------------------------------------------------
# Ours: train.main, timed from its metrics and the loop's progress-bar iterator


def run_ours(cfg: BenchConfig, model_dir: str, work: str) -> list[dict]:
    import train
    from tqdm import tqdm

    ticks: list[float] = []

    class ClockedTqdm(tqdm):
        """The loop's progress bar, silent, recording the time each step starts (and the loop ends)."""
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def __iter__(self):
            for x in super().__iter__():
                ticks.append(time.perf_counter())
                yield x
            ticks.append(time.perf_counter())

    n = cfg.steps + 1
    tc = train.TrainConfig(algo="grpo", model=model_dir, task="synthetic", out=os.path.join(work, "ours"), seed=cfg.seed,
                           device="cpu", dtype="float32", max_steps=n, prompts_per_step=cfg.prompts_per_step,
                           thoughts=cfg.group_size, answers=1, max_thought_tokens=cfg.max_completion_tokens - 16,
                           max_answer_tokens=16, temperature=1.0, top_k=0, top_p=1.0, lr=cfg.lr,
                           micro_batch_rows=cfg.micro_batch_rows, eval_every=0, eval_examples=4, eval_samples=0,
                           samples_every=0, save_every=0)
    saved_tqdm, train.tqdm = train.tqdm, ClockedTqdm
    try:
        train.main(tc)
    finally:
        train.tqdm = saved_tqdm
    with open(os.path.join(tc.out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/sample_s" in r]
    steps = []
    for i, r in enumerate(rows):
        total = ticks[i + 1] - ticks[i]
        parts = dict(sample=r["time/sample_s"], score=r["time/score_s"], update=r["time/update_s"])
        steps.append(dict(parts, other=total - sum(parts.values()), total=total, length=r["len/completion_mean"]))
    return steps[1:]  # drop the warm-up step


# -----------------------------------------------------------------------------
# TRL: GRPOTrainer with the same settings, timed by a callback and wrapped methods


def run_trl(cfg: BenchConfig, model_dir: str, work: str) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from eval import decode_completion
    from model import load_tokenizer
    from tasks import get_task, render_prompt

    task, ours_tok = get_task("synthetic"), load_tokenizer(model_dir)
    n = cfg.steps + 1
    examples = step_examples(cfg, n)
    prompt_ids = [render_prompt(ours_tok, ex, task.system_prompt) for ex in examples]
    # TRL takes prompt text; our char-level tokenizer round-trips it to the same ids (checked below).
    prompts = [ours_tok.decode(ids) for ids in prompt_ids]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if tokenizer(text=prompts)["input_ids"] != prompt_ids:
        raise SystemExit("bench_trl: TRL's tokenizer does not reproduce our prompt ids; the comparison would be unfair")

    def reward(prompts, completions, completion_ids, idx, **kwargs) -> list[float]:
        """The task's training reward on the completion text, as train.py scores it."""
        texts = [decode_completion(ours_tok, ids) for ids in completion_ids]  # same text as train.py sees
        return task.score(texts, [examples[i] for i in idx])

    args = GRPOConfig(
        output_dir=os.path.join(work, "trl"), seed=cfg.seed, use_cpu=True, bf16=False, fp16=False,
        max_steps=n, learning_rate=cfg.lr, lr_scheduler_type="constant", weight_decay=0.0, adam_beta2=0.99,
        max_grad_norm=1.0, gradient_checkpointing=False, per_device_train_batch_size=cfg.micro_batch_rows,
        gradient_accumulation_steps=cfg.prompts_per_step * cfg.group_size // cfg.micro_batch_rows,
        num_generations=cfg.group_size, max_completion_length=cfg.max_completion_tokens, temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, num_iterations=1, loss_type="grpo", scale_rewards="group",
        shuffle_dataset=False, use_vllm=False, report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": prompts, "idx": list(range(len(prompts)))})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer)

    timings: dict[str, list[float]] = {"sample": [], "score": [], "gen_and_score": [], "step": []}
    lengths: list[float] = []

    def timed(name: str, key: str) -> None:
        fn = getattr(trainer, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timings[key].append(time.perf_counter() - t)
            if name == "_generate":  # (prompt_ids, completion_ids, ...): completion lengths incl. the stop token
                lengths.append(statistics.mean(len(c) for c in out[1]))
            return out
        setattr(trainer, name, wrapper)

    timed("_generate", "sample")
    timed("_calculate_rewards", "score")
    timed("_generate_and_score_completions", "gen_and_score")

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["step"].append(time.perf_counter() - self.t0)

    trainer.add_callback(StepClock())
    trainer.train()
    steps = []
    for i in range(n):
        sample, score, gs, total = (timings[k][i] for k in ("sample", "score", "gen_and_score", "step"))
        steps.append(dict(sample=sample, score=score, update=total - gs, other=gs - sample - score, total=total,
                          length=lengths[i]))
    return steps[1:]


# -----------------------------------------------------------------------------
# Report


def mean_of(steps: list[dict], key: str) -> float:
    return statistics.mean(s[key] for s in steps)


def report(cfg: BenchConfig, ours: list[dict], trl: list[dict], model_note: str) -> None:
    keys = ("sample", "score", "update", "other", "total")
    print(f"\none GRPO step: {cfg.prompts_per_step} prompts x {cfg.group_size} completions, <= {cfg.max_completion_tokens} "
          f"tokens, {model_note}, float32 CPU, {cfg.threads} threads; mean of {cfg.steps} steps after 1 warm-up")
    print(f"{'seconds/step':<16}" + "".join(f"{k:>9}" for k in keys) + f"{'mean len':>10}")
    for name, steps in (("train.py", ours), ("TRL", trl)):
        print(f"{name:<16}" + "".join(f"{mean_of(steps, k):9.3f}" for k in keys) + f"{mean_of(steps, 'length'):10.1f}")
    print(f"{'TRL / train.py':<16}" + "".join(f"{mean_of(trl, k) / max(mean_of(ours, k), 1e-9):8.1f}x" for k in keys))
    # Time per generated token, so a side whose policy stops earlier does not look faster for it.
    per_tok = (mean_of(trl, "total") / mean_of(trl, "length")) / (mean_of(ours, "total") / mean_of(ours, "length"))
    print(f"step time per generated token, TRL / train.py: {per_tok:.1f}x")
    print("(train.py 'other' = pack + advantages + logging inside its loop; TRL 'other' = padding, advantages and "
          "metrics inside _generate_and_score_completions)")


def main(cfg: BenchConfig) -> None:
    try:
        import trl  # noqa: F401  (optional dev dependency)
    except ImportError:
        print("TRL not installed: pip install trl (optional)")
        return
    import torch
    torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="bench_trl-") as work:
        model_dir = str(ROOT / cfg.model) if not os.path.isabs(cfg.model) else cfg.model
        model_note = f"model {cfg.model}"
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            model_dir = random_model(os.path.join(work, "random-tiny-model"))
            model_note = f"random model of the bundled shape ({cfg.model} not built)"
        t0 = time.perf_counter()
        ours = run_ours(cfg, model_dir, work)
        t1 = time.perf_counter()
        trl_steps = run_trl(cfg, model_dir, work)
        t2 = time.perf_counter()
        if torch.get_num_threads() != cfg.threads:
            print(f"warning: torch threads changed to {torch.get_num_threads()} during the run")
    report(cfg, ours, trl_steps, model_note)
    print(f"(whole runs incl. start-up: train.py {t1 - t0:.0f}s, TRL {t2 - t1:.0f}s)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)
    from cli import parse_config
    main(parse_config(BenchConfig, description=__doc__.split("\n\n")[0])[0])
