"""heldout.py: held-out evaluation, as the trainer and eval.py both run it: greedy accuracy, mean@n and unbiased
pass@k at a temperature, format rate, length and truncation, with the task's own correctness check (the function
the trainer rewards with, so the training signal and the metric cannot drift apart) and the trainer's sampler."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from rewards import format_reward
from sampler import generate
from tasks import render_prompt
from tokenizer import decode_completion


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as a product to stay exact for large n (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def texts_of(tokenizer, generation) -> list[str]:
    """The completions' texts as rewards see them; a rollout with a tool also returns each completion's context
    mask (methods/tools.py: its stop tokens end nothing)."""
    context = getattr(generation, "context", None) or [()] * len(generation.tokens)
    return [decode_completion(tokenizer, t, c) for t, c in zip(generation.tokens, context)]


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
    static_step: Callable | None = None,
    rollout: Callable | None = None,
) -> dict:
    """Greedy accuracy, mean@n and pass@k at `temperature`, format rate, length, truncation.
    n = 0: greedy only (`ks` unused); otherwise every k must be in 1..n (pass@k needs k samples).
    static_step: the decode step to sample through (sampler.decode), e.g. a compiled one. rollout: sampling that
    renders its own prompts from the examples, e.g. with a tool (methods/tools.py's evaluator), instead of generate."""
    if not examples:
        raise ValueError("evaluate: no examples; pass at least one.")
    if n < 0 or (n > 0 and not all(1 <= k <= n for k in ks)):
        raise ValueError(f"evaluate: need n >= 0 and every k in 1..n, got n={n}, ks={tuple(ks)}.")
    prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in examples]
    greedy_correct, sampled_correct, lengths, truncated, formats = [], [], [], [], []
    for start in range(0, len(prompts), batch_prompts):
        chunk, exs = prompts[start : start + batch_prompts], examples[start : start + batch_prompts]
        kw = dict(max_new_tokens=max_new_tokens, stop_ids=tokenizer.stop_ids, static_step=static_step)
        sample = functools.partial(rollout, model, exs) if rollout else functools.partial(generate, model, chunk)
        greedy = sample(temperature=0.0, n=1, **kw)
        greedy_correct += [task.correct(text, ex) for text, ex in zip(texts_of(tokenizer, greedy), exs)]
        if n > 0:
            seeds = [seed + start + i for i in range(len(chunk))]  # per prompt: independent of batching
            sampled = sample(n=n, temperature=temperature, top_p=top_p, seed=seeds, **kw)
            texts = texts_of(tokenizer, sampled)
            sampled_correct += [[task.correct(texts[i * n + j], ex) for j in range(n)] for i, ex in enumerate(exs)]
            lengths += [len(t) for t in sampled.tokens]
            truncated += [f == "length" for f in sampled.finish]
            formats += [format_reward(t, {}) == 1.0 for t in texts]
    res = {"greedy_accuracy": sum(greedy_correct) / len(examples), "examples": len(examples)}
    if n > 0:
        counts = [int(sum(c)) for c in sampled_correct]
        res[f"mean@{n}"] = sum(counts) / (n * len(examples))
        for k in ks:
            res[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
        res.update(
            format_rate=sum(formats) / len(formats),
            len_mean=sum(lengths) / len(lengths),
            truncated_frac=sum(truncated) / len(truncated),
        )
    res["accuracy"] = res["greedy_accuracy"]
    return res
