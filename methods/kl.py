"""KL to the reference model: the per-token estimators one --kl-estimator flag chooses among, and KL in the reward
(--kl-in-reward) as the alternative to KL in the loss.

Estimators (d = logp - ref_logp), each estimator(logp, ref_logp, old_logp, mask) -> [B, T], 0 off the mask, gradient
through logp only. The names are Schulman's ("Approximating KL divergence", 2020); whose convention each follows:
  k1          d                                          OpenRLHF k1, verl "kl"/"k1", TRL RLOO's
  k2          d^2 / 2                                    OpenRLHF k2, verl "mse"/"k2"
  k3          exp(-d) + d - 1, unclamped                 losses.kl3: the GRPO paper's and TRL GRPOTrainer's (the
                                                         project's default); OpenRLHF's k3 before its [-10, 10] clamp
  low_var_kl  exp(x) - x - 1 with x = clamp(-d, -20, 20), then clamped to [-10, 10]
                                                         verl's "low_var_kl" AND verl's "k3": verl sends both names to
                                                         this clamped branch (its kl_loss_type default)
  unbiased    k3 * pi / pi_old                           losses.unbiased_kl (DeepSeek-V3.2)
So "k3" here is not verl's "k3": at logp = -5, ref_logp = 0 the project's k3 is e^5 - 6 = 142.4, verl's k3 is 10.0;
to reproduce a verl run configured with kl_loss_type k3 (or low_var_kl), pass --kl-estimator low_var_kl.
In the loss the gradient is what matters: k1's is grad logp, whose expectation under the sampling policy is 0, so k1
as a loss term pulls nowhere on average (check refuses it; OpenRLHF warns); k2's, d grad logp, is the KL's own
gradient on-policy; k3's (1 - exp(-d)) grad logp; low_var_kl's is k3's where no clamp binds, 0 where one does.

KL in the reward (verl apply_kl_penalty, OpenRLHF compute_reward): each token's reward is -beta * kl_t, and the
outcome reward is added at the completion's last token. The KL is taken at the sampling-time policy (pi_old, the
score pass's log-probs, detached) and the reference, before the advantages. Then the loss carries NO KL term
(policy_loss with beta 0): the same beta must not penalise twice. Which advantages can consume it:
  - the token-level estimators, REINFORCE++ and REINFORCE++-baseline (methods/reinforce_pp.py), take each token's
    return (reward-to-go, gamma = 1): the KL penalty then reaches each token by its position;
  - the group estimators take each completion's return, the sum of its token rewards r - beta * sum_t kl_t: verl's
    GRPO and RLOO sum token_level_rewards into the score before the group statistics, TRL's RLOO subtracts
    beta * sum_t k1 from the reward. Allowed where the advantage's scale is the step's, not the group's: RLOO,
    Dr. GRPO (--no-std-normalize), --batch-std, REINFORCE++-baseline. Refused with GRPO's per-group std (and
    2-GRPO's sign, and A-GRAE's group std): in a group whose outcome rewards are all equal the returns differ by
    KL noise alone, and the group's std would blow that noise up to advantages of +-1. verl allows it; this rule is
    the project's choice.
With GRPO-MA's tree (shaped_returns): a completion is its thought and one answer, so answer j's return is
R_j - beta * (thought's KL sum + answer j's KL sum); an answer token's reward-to-go is R_j minus beta times the KL of
the rest of its answer; a thought token's is the mean over the thought's M answers of their returns (the thought's
value, GRPO-MA's V) minus beta times the KL of the rest of the thought. M = 1 with an empty thought is the plain chain.

References read: verl v0.7.0+125 (b178a3c) verl/trainer/ppo/core_algos.py (kl_penalty, kl_penalty_forward,
compute_grpo_outcome_advantage, compute_rloo_outcome_advantage), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty,
compute_advantage); OpenRLHF v0.11.0 (3c3be62) openrlhf/models/utils.py (compute_approx_kl, compute_reward),
openrlhf/trainer/ppo_utils/experience_maker.py; TRL v1.9.0+26 (f2cd577) trl/trainer/rloo_trainer.py.
Departures: OpenRLHF clamps every estimator to [-10, 10], verl only its k3 / low_var_kl branch; here only
low_var_kl is clamped (k3 is TRL's, unclamped). verl's
straight-through "k3+" variants (k2's gradient under another estimator's value) and its adaptive KL controller are
left out: beta is fixed. A completion with no trained token has no last token: its outcome reward is dropped there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from losses import KL_ESTIMATORS, Tokens

TOKEN_LEVEL = ("reinforce_pp", "reinforce_pp_baseline")  # --advantage values that take the token returns themselves


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    kl_in_reward: bool = False  # each token's reward minus beta * its KL (--kl-estimator), and no KL in the loss


def enabled(cfg) -> bool:
    return cfg.kl_in_reward


def check(cfg) -> Iterator[FlagError]:
    estimator = f"--kl-estimator {cfg.kl_estimator}"
    if cfg.kl_in_reward and cfg.beta == 0:
        yield FlagError(("kl_in_reward",), "needs --beta > 0 (the KL coefficient)", ("beta",))
    if cfg.kl_in_reward and cfg.kl_estimator == "unbiased":
        why = "corrects the loss's KL for pi != pi_old; in the reward the KL is taken at pi_old: use k1, k2, k3"
        yield FlagError(("kl_estimator",), f"{why} or low_var_kl with --kl-in-reward", ("kl_in_reward",), estimator)
    if not cfg.kl_in_reward and cfg.beta > 0 and cfg.kl_estimator == "k1":
        why = "in the loss has zero expected gradient (E[grad log pi] = 0): use it with --kl-in-reward, or use k2 or k3"
        yield FlagError(("kl_estimator",), why, ("kl_in_reward",), estimator)
    per_group = cfg.advantage == "two_grpo" or (
        cfg.advantage in ("grpo", "agrae") and cfg.std_normalize and not getattr(cfg, "batch_std", False)
    )
    if cfg.kl_in_reward and per_group:
        why = (
            "would let a per-group scale blow KL noise up to advantages of +-1 in groups of equal rewards: use "
            "--advantage rloo or reinforce_pp_baseline, --no-std-normalize or --batch-std"
        )
        yield FlagError(("kl_in_reward",), why, ("advantage", "std_normalize"))


def needs_scores(cfg) -> bool:
    """KL in the reward: the score pass measures the policy's log-probs (pi_old) before the advantages."""
    return True


def step_kl(run, batch) -> Tensor:
    """The step's per-token KL [B, T] at pi_old (the score pass's log-probs) against the reference, by
    --kl-estimator, on every completion token."""
    mask = batch.thought | (batch.answer_id >= 0)
    return token_kl(run.cfg.kl_estimator, batch.score_logp, batch.ref_logp, batch.score_logp, mask)


def advantage_rewards(run, reward: Tensor, batch) -> Tensor:
    """The group estimators' rewards [P, K, M] become the completions' KL-shaped returns (R minus beta times the
    completion's KL sum); the token-level estimators (REINFORCE++) take the token returns themselves."""
    if run.cfg.advantage in TOKEN_LEVEL:
        return reward
    return shaped_returns(reward, batch.thought, batch.answer_id, step_kl(run, batch), run.cfg.beta)[1]


def micro_batch(run, tok: Tokens, mb, sampled: Tensor, sums: dict, epoch: int) -> Tokens:
    """The KL is in the reward: none in the loss (its metric is still measured)."""
    tok.beta = 0.0
    return tok


def token_kl(name: str, logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """The --kl-estimator's per-token KL [B, T] (0 off the mask): losses.KL_ESTIMATORS, the loss's table."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"token_kl: unknown estimator {name!r}; choose one of {', '.join(KL_ESTIMATORS)}.")
    return KL_ESTIMATORS[name](logp, ref_logp, old_logp, mask)


# ----------------------------------------------------------------------------------------------
# KL in the reward


def kl_token_rewards(outcome: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Token-level rewards of a completion per row: outcome [B], kl [B, T], mask [B, T] -> rewards [B, T].
    r_t = -beta * kl_t on the mask (0 elsewhere), plus the outcome reward at the row's last masked token
    (verl apply_kl_penalty with the reward manager's score at the last response token; OpenRLHF compute_reward).
    Detached. A row without a masked token gets all zeros (its outcome has no token to sit on)."""
    m = mask.bool()
    r = torch.where(m, -beta * kl.detach(), torch.zeros_like(kl))
    T = m.shape[1]
    last = T - 1 - m.flip(1).int().argmax(1)  # (B,) the last masked column (T - 1 for an empty row)
    at_last = torch.arange(T, device=m.device)[None, :] == last[:, None]
    return r + torch.where(at_last & m, outcome.detach().to(r.dtype)[:, None], torch.zeros_like(r))


def reward_to_go(rewards: Tensor, mask: Tensor) -> Tensor:
    """Returns with gamma = 1: G_t = sum_{s >= t} r_s over the row's masked tokens; [B, T] -> [B, T], 0 off the mask
    (verl compute_reinforce_plus_plus_outcome_advantage's returns; OpenRLHF get_cumulative_returns)."""
    m = mask.bool()
    r = torch.where(m, rewards, torch.zeros_like(rewards))
    return torch.where(m, r.flip(1).cumsum(1).flip(1), torch.zeros_like(r))


def shaped_returns(
    outcome: Tensor, thought: Tensor, answer_id: Tensor, kl: Tensor | None = None, beta: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Returns of the step's completions on GRPO-MA's packed rows, with the KL in the reward when kl is given.

    outcome [P, K, M] (the rewards R), thought [B, T] bool and answer_id [B, T] (pack.Batch's layout, B = P*K rows,
    answer j's tokens marked j, -1 elsewhere), kl [B, T] (token_kl at pi_old, or None for no KL) ->
      token_returns [B, T]: answer j's token t: R_j - beta * (KL of answer j from t on);
                            thought token t: mean_j (R_j - beta * answer j's KL) - beta * (KL of the thought from t on);
                            0 off the trained tokens;
      seq_returns [P, K, M]: R_j - beta * (the thought's KL + answer j's KL), each completion's summed token rewards,
                             what the group estimators consume in place of R.
    With M = 1 and empty thoughts this is reward_to_go(kl_token_rewards(R, kl, mask, beta), mask) and its row sums.
    Detached."""
    P, K, M = outcome.shape
    th = thought.bool()
    mask = th | (answer_id >= 0)
    pen = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl is not None and beta != 0:
        pen = torch.where(mask, -beta * kl.detach().double(), pen)
    R = outcome.detach().double().reshape(P * K, M)
    rows = torch.zeros_like(pen)
    answer_total = torch.zeros_like(R)  # (B, M) beta-weighted KL sums of each answer
    for j in range(M):
        seg = answer_id == j
        answer_total[:, j] = (pen * seg).sum(1)
        rows = rows + torch.where(seg, R[:, j : j + 1] + reward_to_go(pen, seg), torch.zeros_like(pen))
    value = (R + answer_total).mean(1, keepdim=True)  # (B, 1) the thought's value: its answers' mean return
    rows = rows + torch.where(th, value + reward_to_go(pen, th), torch.zeros_like(pen))
    seq = R + answer_total + (pen * th).sum(1, keepdim=True)
    return rows.to(outcome.dtype), seq.view(P, K, M).to(outcome.dtype)
