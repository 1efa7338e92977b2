"""Reward noise: injected for controlled experiments (--reward-noise), and corrected (--noise-correct;
noise-corrected GRPO, arXiv 2510.18924). Formulas: advantage.py (flip_rewards, noise_corrected_rewards,
estimate_noise_rates). The wiring:
- transform rewards: each prompt's 0/1 rewards are flipped at the injected rates, by a generator seeded from the
  prompt's rollout seed (so batching and world size cannot change the flips);
- state: the correction's rates, given or ("auto") fitted once on rollouts of the starting model (calibrate),
  kept in the trainer state so that a resumed run keeps them, and logged every step;
- advantages: the rewards are unbiased with those rates before the (Dr. GRPO) group advantage."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from advantage import estimate_noise_rates, flip_rewards, noise_corrected_rewards
from cli import FlagError
from distributed import derive_seed
from sampler import generate
from tasks import render_prompt
from tokenizer import decode_completion


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- rewards
    reward_noise: str = ""  # RHO_PLUS,RHO_MINUS: flip 0/1 rewards (wrong->1, right->0) at these rates ("" = off)
    noise_correct: str = ""  # RHO+,RHO-|auto: unbias rewards (with --no-std-normalize: adv. x 1/(1-RHO+-RHO-))


def parse_rates(text: str, field: str, *, auto: bool = False) -> tuple[float, float] | None:
    """A `RHO_PLUS,RHO_MINUS` flag -> the two flip rates (each in [0, 1), their sum below 1), else a FlagError
    naming the flag; "" (off), and "auto" where `auto` allows it, give None."""
    if not text or (auto and text == "auto"):
        return None
    try:
        rho_plus, rho_minus = (float(x) for x in text.split(","))
    except ValueError:
        raise FlagError((field,), f"must be RHO_PLUS,RHO_MINUS, two numbers such as 0.2,0.1, got {text!r}") from None
    if not (0 <= rho_plus < 1 and 0 <= rho_minus < 1 and rho_plus + rho_minus < 1):
        why = "each flip rate must be in [0, 1) and RHO_PLUS + RHO_MINUS below 1 (at 1 or more the noisy reward"
        raise FlagError((field,), f"{text}: {why} carries no signal)")
    return rho_plus, rho_minus


def check(cfg) -> Iterator[FlagError]:
    for field in ("reward_noise", "noise_correct"):
        try:
            parse_rates(getattr(cfg, field), field, auto=field == "noise_correct")
        except FlagError as e:
            yield e
    if cfg.noise_correct and cfg.std_normalize:
        why = "needs --no-std-normalize (or --algo dr_grpo): a std normalisation cancels the correction exactly"
        yield FlagError(("noise_correct",), why, ("std_normalize",))


def enabled(cfg) -> bool:
    return bool(cfg.reward_noise or cfg.noise_correct)


def start(run) -> None:
    """--noise-correct: the rates, fixed or fit once on the starting model ("auto"); a resumed run keeps its own."""
    cfg = run.cfg
    if cfg.noise_correct and "noise_rates" not in run.state:
        new = cfg.completion_limit + len(run.marker.ids) * (cfg.answers > 1)
        with run.rollout_weights(), run.precision():
            run.state["noise_rates"] = rates(run.sampler, run.tokenizer, run.task, cfg, max_new_tokens=new)


def rewards(run, reward: torch.Tensor, step) -> torch.Tensor:
    """--reward-noise: the step's 0/1 rewards [N] flipped, by each prompt's rollout seed."""
    if not run.cfg.reward_noise:
        return reward
    return inject(reward.view(step.groups, -1), step.seeds, run.cfg).flatten()


def advantage_rewards(run, reward: torch.Tensor, batch) -> torch.Tensor:
    """--noise-correct: rewards [P, K, M] unbiased before the advantages."""
    return corrected(reward, run.state) if run.cfg.noise_correct else reward


def inject(reward: torch.Tensor, seeds: list[int], cfg) -> torch.Tensor:
    """--reward-noise: 0/1 rewards [P, G] flipped at its rates, one generator per prompt from its rollout seed."""
    gens = [torch.Generator().manual_seed(derive_seed(s, 2)) for s in seeds]
    return flip_rewards(reward, *parse_rates(cfg.reward_noise, "reward_noise"), gens)


def rates(model, tokenizer, task, cfg, max_new_tokens: int) -> tuple[float, float]:
    """--noise-correct's rates: the typed ones, or for "auto" calibrate's fit on the starting model."""
    return parse_rates(cfg.noise_correct, "noise_correct", auto=True) or calibrate(
        model, tokenizer, task, cfg, max_new_tokens
    )


@torch.no_grad()
def calibrate(model, tokenizer, task, cfg, max_new_tokens: int, rollouts: int = 256) -> tuple[float, float]:
    """The flip rates (rho_plus, rho_minus) of the training reward against the task's own correctness, fit once
    on `rollouts` samples of `model` (a group of K*M per prompt, one batch, at the run's temperature) on training
    prompts of their own stream. The reward is task.reward, flipped at the --reward-noise rates (per prompt seed)
    when the run injects them; advantage.estimate_noise_rates compares it with task.correct, so the sample needs
    right and wrong completions both. Kept simple: fit on the starting model only, then held fixed (the rates may
    drift)."""
    n, seed, noise = cfg.thoughts * cfg.answers, derive_seed(cfg.seed, 3), parse_rates(cfg.reward_noise, "reward_noise")
    examples = task.train(-(-rollouts // n), seed)
    seeds = [seed + i for i in range(len(examples))]
    prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in examples]
    stop, temperature = tokenizer.stop_ids, cfg.temperature
    out = generate(
        model, prompts, max_new_tokens=max_new_tokens, n=n, temperature=temperature, stop_ids=stop, seed=seeds
    )
    pairs = [(decode_completion(tokenizer, t), examples[i // n]) for i, t in enumerate(out.tokens)]
    reward = torch.tensor([float(task.reward(t, ex)) for t, ex in pairs]).view(len(examples), n)
    correct = torch.tensor([float(task.correct(t, ex)) for t, ex in pairs]).view(len(examples), n)
    if noise is not None:
        reward = flip_rewards(reward, *noise, [torch.Generator().manual_seed(s) for s in seeds])
    return estimate_noise_rates(reward, correct)


def corrected(reward: torch.Tensor, state: dict) -> torch.Tensor:
    """Rewards [P, K, M] unbiased with the run's rates (state["noise_rates"])."""
    return noise_corrected_rewards(reward, *state["noise_rates"])


def metrics(run, sums: dict, counts: dict) -> dict:
    """The correction's rates, logged every step (none without --noise-correct)."""
    return dict(zip(("noise/rho_plus", "noise/rho_minus"), run.state.get("noise_rates") or ()))
