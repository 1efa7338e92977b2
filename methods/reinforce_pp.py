"""REINFORCE++ and REINFORCE++-baseline (arXiv 2501.03262): critic-free advantages normalised over the whole step's
tokens (--advantage reinforce_pp | reinforce_pp_baseline).

  reinforce_pp           each token's return with gamma = 1 (the outcome reward, minus beta times the KL of the rest
                         of the completion with --kl-in-reward), then whitened over every trained token of the step:
                         A_t = (G_t - mean) / sqrt(var + 1e-8), mean and unbiased var over the step's tokens.
  reinforce_pp_baseline  the same with each outcome reward first minus its group's mean reward (over the prompt's
                         K*M answers): the group mean removes the prompt's difficulty, the step's whitening sets
                         one scale for all prompts (robust to reward scales, the paper's point against GRPO's
                         per-group std).

Seam: advantages, token level. The estimator gives adv [B, T] directly (not one advantage per completion spread over
its tokens): returns = reinforce_pp_returns(...) (methods/kl.py shaped_returns), then
  stats = distributed.all_sum(batch_std.moments(returns, mask), world)   # the step's sums, over every rank
  adv = whiten(returns, mask, stats)
so neither the world size nor the micro-batch split can change the statistics (whiten takes precomputed global sums;
the returns themselves are per row). mask: the tokens the update trains. GRPO-MA's tree composes: thought tokens
carry their thought's return (the mean of its answers' returns), answer tokens their answer's, each counted once in
the whitening, as in the loss.

References read:
  verl v0.7.0+125 (b178a3c) verl/trainer/ppo/core_algos.py: compute_reinforce_plus_plus_outcome_advantage (returns
    with config.gamma, default 1, then verl_F.masked_whiten over response_mask) and
    compute_reinforce_plus_plus_baseline_outcome_advantage (score = sum of token rewards minus the group mean,
    spread over the tokens, masked_whiten); verl/utils/torch_functional.py masked_whiten (mean over the mask,
    unbiased var, (x - mean) * rsqrt(var + 1e-8)); examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf*.sh.
  OpenRLHF v0.11.0 (3c3be62) openrlhf/trainer/ppo_utils/experience_maker.py compute_advantages_and_returns
    ("reinforce", "reinforce_baseline": the group mean subtracted from the outcome reward BEFORE the token KL
    penalties are added, cumulative returns with gamma = 1, then mean and BIASED var over all tokens, rsqrt(max(var,
    1e-8))).
Stated: gamma = 1 returns, a group-mean baseline for the -baseline variant, whitening over the step's tokens.
Chosen: verl's whitening (unbiased var, rsqrt(var + 1e-8)); OpenRLHF's order for the baseline with the KL in the
reward (the group mean of the outcome rewards, then token returns of the KL-shaped rewards: each token keeps the KL of
the rest of its completion, where verl sums the KL into one score per completion); without the KL in the reward the
two references agree up to the var's Bessel factor. A step with fewer than 2 trained tokens gets 0 (verl raises).
Left out: gamma != 1 (both references force 1 for the baseline variant), OpenRLHF's reward clipping to [-10, 10].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from distributed import all_sum
from methods.batch_std import mean_std, moments
from methods.kl import shaped_returns, step_kl

VALUES = ("reinforce_pp", "reinforce_pp_baseline")  # the values this file adds to --advantage


@dataclass
class Flags:
    """REINFORCE++ is two values of the core's --advantage flag; it has no flag of its own."""


# verl's example runs (run_qwen2-7b_math_rf.sh, run_qwen2-7b_math_rf_baseline.sh): the k1 KL in the reward at verl's
# kl_coef 0.001, token-mean loss (verl's loss_agg_mode default). OpenRLHF's RLVR script instead puts k2 in the loss.
PRESETS = {
    name: dict(
        advantage=name, std_normalize=False, kl_in_reward=True, kl_estimator="k1", beta=1e-3, aggregation="token_mean"
    )
    for name in VALUES
}


def enabled(cfg) -> bool:
    return cfg.advantage in VALUES


def check(cfg) -> Iterator[FlagError]:
    if cfg.advantage not in VALUES:
        return
    subject = f"--advantage {cfg.advantage}"
    if cfg.std_normalize:
        why = "whitens over the step's tokens instead of a group std: it needs --no-std-normalize, or --algo "
        why += cfg.advantage
        yield FlagError(("advantage",), why, ("std_normalize",), subject)
    gtpo = tuple(f for f in ("entropy_gate", "entropy_gamma", "gtpo_conflict") if getattr(cfg, f, False))
    if gtpo:
        why = "gives token-level advantages; GTPO's gate, shift and conflict weights act on one per completion"
        yield FlagError(("advantage",), why, gtpo, subject)


def reinforce_pp_returns(
    outcome: Tensor,
    thought: Tensor,
    answer_id: Tensor,
    *,
    baseline: bool = False,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> Tensor:
    """Token returns before the whitening: outcome [P, K, M] rewards, thought [B, T] bool, answer_id [B, T]
    (pack.Batch's layout), kl [B, T] at pi_old for --kl-in-reward (None: no KL) -> returns [B, T], 0 off the tokens.
    baseline: each reward minus the mean of its prompt's K*M rewards first (REINFORCE++-baseline)."""
    r = outcome if outcome.is_floating_point() else outcome.float()
    if baseline:
        r = r - r.flatten(1).mean(1)[:, None, None]
    return shaped_returns(r, thought, answer_id, kl, beta)[0]


def whiten(x: Tensor, mask: Tensor, stats: Tensor | None = None, *, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) on the mask, 0 elsewhere: [B, T] -> [B, T], detached.
    stats: batch_std.moments of the whole step's x on its mask, summed over ranks; default this tensor's (one
    process, the whole step). mean and the unbiased var come from the sums; a step of one token gives 0 (its var is
    taken as 0 and it is its own mean)."""
    m = mask.bool()
    mean, std = mean_std(moments(x, m) if stats is None else stats)
    out = (x.detach().double() - mean) / (std * std + eps) ** 0.5
    return torch.where(m, out, torch.zeros_like(out)).to(x.dtype)


def token_advantages(run, adv: Tensor, groups: list, batch, mask: Tensor, reward: Tensor, metrics: dict) -> Tensor:
    """The token returns of the rewards [P, K, M] (the KL in them with --kl-in-reward), whitened over the step's
    trained tokens on every rank: [B, T], in place of the per-completion advantages."""
    cfg = run.cfg
    kl = step_kl(run, batch) if cfg.kl_in_reward else None
    kw = dict(baseline=cfg.advantage == "reinforce_pp_baseline", kl=kl, beta=cfg.beta)
    returns = reinforce_pp_returns(reward.to(adv.device), batch.thought, batch.answer_id, **kw)
    return whiten(returns, mask, all_sum(moments(returns, mask), run.world)).to(adv.dtype)


def sequence_level(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[None, None]:
    """The per-completion advantages stay the core's (unused: token_advantages replaces them)."""
    return None, None


ADVANTAGES = dict.fromkeys(VALUES, sequence_level)
