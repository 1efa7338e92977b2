"""Every RL formula of the project, as pure functions over tensors: no classes, no state, no I/O.

Conventions:
- rewards are [P, G]: P prompts x G completions. Token tensors are [B, T] with B = P*G rows in
  prompt-major order (prompt p's completions are rows p*G .. p*G+G-1).
- std is torch.std (unbiased, as TRL and verl); eps = 1e-6 is added to it.
- A degenerate group (all rewards equal, which includes G == 1) gets advantage exactly 0, set by an
  explicit mask, never by trusting 0 / (0 + eps).

One step of the trainer: rewards -> group advantages (section 1; DAPO in 2; GTPO's controls in 3) -> per-token
adv [B, T] and weight [B, T] for the WHOLE step (4), whose weight carries the loss normaliser, so summing the
micro-batches' losses.policy_loss gives the full-batch loss whatever the split or world size -> diagnostics (5).
"""

import math

import torch
from torch import Tensor

# ----------------------------------------------------------------------------------------------
# 1. Group advantages: GRPO / Dr. GRPO, GRPO-MA, 2-GRPO, A-GRAE, noise-corrected rewards, DaGRPO


def _degenerate(rewards: Tensor) -> Tensor:
    """[..., G] -> [..., 1] bool: True where every reward of the group is equal (or G == 1)."""
    return rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True)


def group_advantages(rewards: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage A = (r - mean_g r) / (std_g r + eps) over the last dim; Dr. GRPO: r - mean_g r.

    rewards: [P, G] (any leading dims) -> [P, G]. GRPO eq.: A_i = (r_i - mean(r)) / std(r).
    Unbiased std; degenerate groups and G == 1 give exactly 0."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    adv = r - r.mean(-1, keepdim=True)
    if std_normalize and r.shape[-1] > 1:  # torch.std of one sample is nan (and warns)
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.masked_fill(_degenerate(r), 0.0)


def grpo_ma_advantages(rewards: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GRPO-MA (arXiv 2509.24494): K thoughts per prompt, M answers per thought.

    rewards: [P, K, M] -> (thought_adv [P, K], answer_adv [P, K, M]).
    Thought value V[p,i] = mean_j R[p,i,j]; thought adv = group normalisation of V over the K
    thoughts; answer adv = group normalisation of R over all K*M answers of the prompt (not within
    one thought, so the answers of a good thought mostly get positive advantages).
    M = 1 gives GRPO's advantages bit for bit (V = R and both normalise over the same K values)."""
    if rewards.dim() != 3:
        raise ValueError(f"grpo_ma_advantages: rewards must be [P, K, M], got shape {tuple(rewards.shape)}.")
    P, K, M = rewards.shape
    thought = group_advantages(rewards.mean(-1), std_normalize=std_normalize, eps=eps)
    answer = group_advantages(rewards.reshape(P, K * M), std_normalize=std_normalize, eps=eps)
    return thought, answer.reshape(P, K, M)


def two_grpo_advantages(rewards: Tensor) -> Tensor:
    """2-GRPO (arXiv 2510.00977 §5.1): [P, 2] -> [P, 2], +1 for the better, -1 for the worse, 0 on ties.

    This is the paper's population-std normalisation of a pair: (r - mean) / std_pop = sign(r1 - r2)
    for any two distinct rewards (the gap's size is discarded). torch.std would give +-0.707."""
    if rewards.dim() != 2 or rewards.shape[-1] != 2:
        raise ValueError(f"two_grpo_advantages: rewards must be [P, 2], got shape {tuple(rewards.shape)}.")
    r = rewards if rewards.is_floating_point() else rewards.float()
    s = torch.sign(r[:, 0] - r[:, 1])  # 0 on ties, so tied pairs carry no gradient
    return torch.stack([s, -s], dim=-1)


def agrae_advantages(
    rewards: Tensor,
    *,
    correct: Tensor | None = None,
    alpha: float = 1.0,
    batch_accuracy: float | Tensor | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """A-GRAE (arXiv 2602.05548; released code's compute_grpo_outcome_advantage): [P, G] -> [P, G].

    p = group accuracy (from the 0/1 `correct` if given, else rewards, which must then be in [0, 1]);
    P = batch mean accuracy, or `batch_accuracy` (e.g. measured before dynamic sampling drops groups).
    A = GRPO (or Dr. GRPO) advantage
        * w(p, P),  w = (1-P) * 0.5/(1 - sqrt(p) + eps) + P * 0.5/(sqrt(p) + eps)
        * min(1, P/alpha) on positive entries only.
    Low P favours easy groups (p -> 1) and damps correct answers (explore); high P favours hard ones.
    Degenerate groups stay 0."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    acc = r if correct is None else correct.to(r.dtype)
    p = acc.mean(-1, keepdim=True).clamp(0.0, 1.0)  # (P, 1)
    P_bar = p.mean() if batch_accuracy is None else torch.as_tensor(batch_accuracy, dtype=r.dtype, device=r.device)
    adv = group_advantages(r, std_normalize=std_normalize, eps=eps)
    sp = p.sqrt()
    w = (1 - P_bar) * 0.5 / (1 - sp + eps) + P_bar * 0.5 / (sp + eps)  # (P, 1)
    # Departure (not in the paper or code): with `correct` given, a group can be all correct (or all
    # wrong) while its rewards still differ (format, overlong penalty). w would be ~5e5 there; we
    # keep the plain advantage (w = 1) instead, as the difficulty weight is undefined at p in {0, 1}.
    w = torch.where((p > 0) & (p < 1), w, torch.ones_like(w))
    adv = adv * w  # degenerate groups are already exactly 0 and w is finite, so they stay 0
    return torch.where(adv > 0, adv * torch.clamp(P_bar / alpha, max=1.0), adv)


def _check_noise_rates(name: str, rho_plus: float | Tensor, rho_minus: float | Tensor) -> None:
    """Raise unless 0 <= rho_plus, rho_minus < 1 and rho_plus + rho_minus < 1 (nan fails too)."""
    rho_p, rho_m = torch.as_tensor(rho_plus, dtype=torch.float64), torch.as_tensor(rho_minus, dtype=torch.float64)
    ok = (rho_p >= 0) & (rho_p < 1) & (rho_m >= 0) & (rho_m < 1) & (rho_p + rho_m < 1)
    if not bool(ok.all()):
        raise ValueError(
            f"{name}: need flip rates rho_plus, rho_minus in [0, 1) with rho_plus + rho_minus < 1 (got {rho_plus}, "
            f"{rho_minus}); at rho_plus + rho_minus >= 1 the noisy reward carries no (or inverted) signal."
        )


def noise_corrected_rewards(rewards: Tensor, rho_plus: float | Tensor, rho_minus: float | Tensor) -> Tensor:
    """Noise-corrected GRPO (arXiv 2510.18924): r_hat = (r - rho_plus) / (1 - rho_plus - rho_minus).

    rewards: observed 0/1 rewards, any shape; rho_plus = P(r=1 | truly wrong), rho_minus =
    P(r=0 | truly right), scalars or broadcastable tensors (e.g. [P, 1] per-prompt rates).
    E[r | r*] = rho_plus + (1 - rho_plus - rho_minus) * r*, so E[r_hat | r*] = r* (the clean reward).
    Centre the result with group_advantages(..., std_normalize=False) (Dr. GRPO): the z-score is
    affine-invariant, so with one rate pair per group a std normalisation cancels the correction
    (exactly at eps = 0; with eps the two differ only by eps scaling as 1 - rho_plus - rho_minus).
    With global constant rates the centred correction is a constant rescale by 1 / (1 - rho_plus -
    rho_minus), which Adam mostly ignores (a derivation, not the paper's claim). Equal rewards stay equal, so
    degenerate groups stay 0."""
    _check_noise_rates("noise_corrected_rewards", rho_plus, rho_minus)
    return (rewards - rho_plus) / (1 - rho_plus - rho_minus)


def _check_binary(name: str, **tensors: Tensor) -> None:
    for arg, t in tensors.items():
        if not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"{name}: {arg} must hold only 0/1 values (a verifier's right/wrong).")


def flip_rewards(
    rewards: Tensor, rho_plus: float | Tensor, rho_minus: float | Tensor, generator: torch.Generator | list
) -> Tensor:
    """Inject class-conditional Bernoulli reward noise, for controlled noise experiments.

    rewards: clean 0/1 rewards, any shape (and dtype) -> same shape and dtype. A wrong (0) becomes 1
    with probability rho_plus, a right (1) becomes 0 with probability rho_minus, independently per
    entry; the rates may be broadcastable tensors. One uniform is drawn per entry from `generator`
    (on the rewards' device) whatever the rates, so zero rates return the rewards unchanged. `generator` may
    instead be a list of one generator per row of rewards [P, G] (the trainer seeds one per prompt from its
    rollout seed, so the flips do not depend on how prompts are batched or spread over ranks)."""
    _check_noise_rates("flip_rewards", rho_plus, rho_minus)
    _check_binary("flip_rewards", rewards=rewards)
    if isinstance(generator, list) and len(generator) != rewards.shape[0]:
        raise ValueError(f"flip_rewards: {len(generator)} generators for {rewards.shape[0]} rows of rewards.")
    gens = generator if isinstance(generator, list) else [generator]
    shape = rewards.shape[1:] if isinstance(generator, list) else rewards.shape
    u = torch.stack([torch.rand(shape, generator=g, dtype=torch.float64, device=rewards.device) for g in gens])
    u = u.view(rewards.shape)
    rho_p = torch.as_tensor(rho_plus, dtype=torch.float64, device=rewards.device)
    rho_m = torch.as_tensor(rho_minus, dtype=torch.float64, device=rewards.device)
    flip = torch.where(rewards == 1, u < rho_m, u < rho_p)
    return torch.where(flip, rewards == 0, rewards == 1).to(rewards.dtype)


def estimate_noise_rates(noisy_reward: Tensor, correct: Tensor) -> tuple[float, float]:
    """Flip rates from a labelled calibration sample: ([N] noisy 0/1 reward, [N] true 0/1) -> (rho_plus, rho_minus).

    rho_plus = #(noisy 1, truly wrong) / #(truly wrong), rho_minus = #(noisy 0, truly right) / #(truly right),
    the maximum-likelihood rates, each with standard error sqrt(rho (1 - rho) / n_class). Draw the sample
    from the policy being trained (the rates drift with it). Any matching shapes work."""
    if noisy_reward.shape != correct.shape:
        raise ValueError(
            f"estimate_noise_rates: noisy_reward {tuple(noisy_reward.shape)} and correct {tuple(correct.shape)} differ."
        )
    _check_binary("estimate_noise_rates", noisy_reward=noisy_reward, correct=correct)
    noisy, right = noisy_reward.double(), correct.bool()
    for present, what in ((~right, "truly wrong (correct == 0)"), (right, "truly right (correct == 1)")):
        if not bool(present.any()):
            raise ValueError(
                f"estimate_noise_rates: the calibration sample has no {what} examples, so a flip rate cannot be "
                "estimated; add labelled examples of both classes."
            )
    return float(noisy[~right].mean()), float(1 - noisy[right].mean())


def pairwise_distinct_advantages(
    rewards: Tensor, scores: Tensor, delta: float, *, std_normalize: bool = False, eps: float = 1e-6
) -> Tensor:
    """DaGRPO's distinctiveness mask (Xie et al., arXiv 2512.06337), as a RECONSTRUCTION: [P, G] x2 -> [P, G].

    No official code exists and the method text could not be read; the abstract states only that "a
    fine-grained score dynamically masks sample pairs with low distinctiveness". Reconstruction: Dr. GRPO's
    advantage is a sum over pairs, r_i - mean_j r_j =
    (1/G) sum_j (r_i - r_j); DaGRPO drops the pairs whose fine-grained scores are too close:
        A_i = (1/G) sum_j m_ij (r_i - r_j),   m_ij = 1[|s_i - s_j| >= delta]   (j == i adds 0 anyway)
    so a close-call right/wrong pair (sloppy right vs. nearly-right wrong) pushes neither way.
    scores: [P, G] fine-grained quality (e.g. in [0, 1]); the score and delta are UNVERIFIED (a
    third-party reading uses delta = 0.1). delta = 0 keeps every pair and returns
    group_advantages(rewards, std_normalize=False) bit for bit. std_normalize divides by the
    unmasked group std (GRPO form, also [D]). Groups stay centred (the summand is antisymmetric);
    degenerate groups, and rows whose pairs are all masked, get exactly 0."""
    if rewards.shape != scores.shape or rewards.dim() < 1:
        raise ValueError(
            f"pairwise_distinct_advantages: rewards {tuple(rewards.shape)} and scores {tuple(scores.shape)} "
            "must both be [P, G]."
        )
    if not delta >= 0:  # also rejects nan
        raise ValueError(f"pairwise_distinct_advantages: delta must be >= 0, got {delta}.")
    r = rewards if rewards.is_floating_point() else rewards.float()
    s = scores if scores.is_floating_point() else scores.float()
    G = r.shape[-1]
    keep = (s[..., :, None] - s[..., None, :]).abs() >= delta  # (P, G, G) m_ij
    keep = keep | torch.eye(G, dtype=torch.bool, device=r.device)  # the j == i term is 0 whatever m_ii
    masked = ((r[..., :, None] - r[..., None, :]) * keep).sum(-1) / G  # (P, G)
    # Rows that keep every pair take Dr. GRPO's own expression, so delta = 0 is bit-exact group_advantages.
    adv = torch.where(keep.all(-1), r - r.mean(-1, keepdim=True), masked)
    if std_normalize and G > 1:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.masked_fill(_degenerate(r), 0.0)


def splice_anchor_rewards(
    rewards: Tensor, correct: Tensor, *, anchor_reward: float = 1.0, max_correct: int = 0
) -> tuple[Tensor, Tensor]:
    """DaGRPO-style anchors (RECONSTRUCTION, as LUFFY): [P, G] rewards, [P, G] 0/1 correct -> (rewards, is_anchor).

    A group with at most max_correct correct completions gets an anchor: its LAST completion is replaced
    by the example's verified reference solution (an off-policy sample), whose reward is anchor_reward.
    The group size stays G. The advantage is then computed over the mixed group with the usual formula
    (LUFFY normalises over all n samples, anchor included), e.g. an all-wrong group of G gives the anchor
    (G-1)/G and every rollout -1/G under Dr. GRPO / pairwise_distinct_advantages(delta=0), or
    (G-1)/G / std = +2.47 at G = 8 under GRPO. The trainer swaps in the anchor's tokens where is_anchor
    [P, G] is True, passes them to policy_loss as off_policy, and for the distinctiveness mask gives the
    anchor the top score (scores.masked_fill(is_anchor, 1.0), an inference)."""
    if rewards.shape != correct.shape or rewards.dim() != 2:
        raise ValueError(
            f"splice_anchor_rewards: rewards {tuple(rewards.shape)} and correct {tuple(correct.shape)} "
            "must both be [P, G]."
        )
    _check_binary("splice_anchor_rewards", correct=correct)
    r = rewards if rewards.is_floating_point() else rewards.float()
    trigger = correct.sum(-1) <= max_correct  # (P,) no (or too few) valid positive samples
    is_anchor = torch.zeros_like(r, dtype=torch.bool)
    is_anchor[:, -1] = trigger
    return r.masked_fill(is_anchor, anchor_reward), is_anchor


# ----------------------------------------------------------------------------------------------
# 2. DAPO (arXiv 2503.14476): dynamic sampling and soft overlong penalty


def dynamic_sampling_keep(rewards: Tensor) -> Tensor:
    """[P, G] -> [P] bool: keep groups with some contrast; all-equal groups have zero advantage."""
    return rewards.amax(-1) != rewards.amin(-1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO soft overlong punishment, added to the reward: [B] lengths -> [B] float.

    0 if L <= max_len - buffer; ((max_len - buffer) - L) / buffer inside the buffer; -1 beyond max_len."""
    if not 0 <= buffer <= max_len:
        raise ValueError(f"overlong_penalty: need 0 <= buffer <= max_len, got buffer={buffer}, max_len={max_len}.")
    L = lengths.float()
    soft = max_len - buffer
    inside = (soft - L) / max(buffer, 1)  # buffer == 0 never selects this branch
    return torch.where(L <= soft, torch.zeros_like(L), torch.where(L <= max_len, inside, -torch.ones_like(L)))


# ----------------------------------------------------------------------------------------------
# 3. GTPO (Simoni et al., arXiv 2508.03772): conflict-token weights and entropy control


def gtpo_conflict_weights(
    token_ids: Tensor, mask: Tensor, seq_adv: Tensor, group_size: int, *, w_pos: float = 2.0, w_neg: float = 0.0
) -> Tensor:
    """Per-token weights that protect tokens shared by good and bad completions: [B, T] -> [B, T].

    token_ids, mask: [B, T] (mask 1 on completion tokens); seq_adv: [B] raw sequence advantage;
    rows prompt-major in groups of `group_size`. A token of completion i at completion position t
    is raw-conflicting if the same token at the same position occurs in at least one positive and one
    negative completion of the group (i counts for its own sign) and A_i != 0. Only the unbroken run
    from the completion's first token, and the unbroken run back from its last token (positions
    counted from the end, i.e. right-aligned), are conflict tokens. Weight w_pos on the conflict
    tokens of positive rows, w_neg on those of negative rows, 1 elsewhere, 0 off the mask.

    Follows the released code (gtpo_training.py build_conflict_mask: set membership per position,
    cumulative run from each end). Departure: a token in both runs gets w_pos once (a choice: a token is one
    token); the released code multiplies the two factors (w_pos**2 = 4), which only happens when the runs
    overlap. Positions are counted over masked tokens, so rows may also carry a prompt or left padding."""
    B, T = token_ids.shape
    if B % group_size != 0:
        raise ValueError(f"gtpo_conflict_weights: {B} rows do not split into groups of {group_size}.")
    valid = mask.bool()
    pos = (seq_adv > 0)[:, None] & valid  # (B, T) tokens of positive completions
    neg = (seq_adv < 0)[:, None] & valid
    ids = torch.where(valid, token_ids, torch.zeros_like(token_ids)).long()
    vocab = int(ids.max()) + 1
    group = (torch.arange(B, device=ids.device) // group_size)[:, None]  # (B, 1)
    idx = valid.long().cumsum(-1) - 1  # (B, T) index of the token inside its completion
    from_end = valid.sum(-1, keepdim=True) - 1 - idx  # (B, T) distance from the completion's last token

    def conflict_run(position: Tensor, from_start: bool) -> Tensor:
        # One integer key per (group, position, token): "same token at the same position of the same
        # group" becomes key equality, so one isin per sign replaces a G x G comparison.
        key = (group * T + position) * vocab + ids
        raw = torch.isin(key, key[pos]) & torch.isin(key, key[neg]) & (pos | neg)
        broken = ~raw & valid  # masked-out positions (padding, prompt) neither extend nor break the run
        if not from_start:
            broken = broken.flip(-1)
        run = broken.long().cumsum(-1) == 0  # True until the first non-conflict token
        return (run if from_start else run.flip(-1)) & valid

    conflict = conflict_run(idx, True) | conflict_run(from_end, False)
    w = torch.ones(B, T, dtype=torch.float32, device=ids.device)
    w = torch.where(conflict & pos, torch.full_like(w, w_pos), w)
    w = torch.where(conflict & neg, torch.full_like(w, w_neg), w)
    return w * valid


def gtpo_entropy_gate(
    token_entropy: Tensor, mask: Tensor, *, threshold: float = math.log(2), enabled: bool = True
) -> tuple[Tensor, Tensor]:
    """GTPO entropy gate: drop completions whose mean token entropy exceeds the threshold.

    token_entropy, mask: [B, T] -> (keep [B] bool, mean_entropy [B]). delta_i = 1[<H>_i <= ln 2].
    The trainer passes enabled=False when the starting policy's mean entropy is already above the
    threshold (README rule; then the gate would drop almost everything). The trainer applies it as
    adv = where(keep, gtpo_entropy_shift(adv, mean_entropy), 0)."""
    m = mask.float()
    mean_entropy = (token_entropy.float() * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    keep = mean_entropy <= threshold if enabled else torch.ones_like(mean_entropy, dtype=torch.bool)
    return keep, mean_entropy


def gtpo_entropy_shift(adv: Tensor, mean_entropy: Tensor, gamma: float = 0.1) -> Tensor:
    """GTPO advantage shift A - gamma * <H>: [B], [B] -> [B]. Entropy is detached, so this penalises
    high-entropy completions through the advantage (it is not a differentiable regulariser). Note it
    also gives all-equal groups a small negative signal, as in the released code."""
    return adv - gamma * mean_entropy.detach()


# ----------------------------------------------------------------------------------------------
# 4. Token weights: the loss normaliser of the whole step, computed before micro-batching

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def token_weights(
    mask: Tensor,
    aggregation: str,
    *,
    max_len: int | None = None,
    num_seqs: int | float | None = None,
    num_tokens: int | float | None = None,
) -> Tensor:
    """Per-token loss weight for one step: mask [B, T] -> weight [B, T]; loss = -sum(weight * obj).

    "seq_mean_token_mean"     GRPO: mean over sequences of per-sequence token means, 1/(n_seqs*len_row)
    "token_mean"              DAPO: every token of the step weighs the same, 1/n_tokens
    "seq_mean_token_sum_norm" Dr. GRPO: per-sequence token sums over a constant, 1/(n_seqs*max_len)
    num_seqs (non-empty rows) and num_tokens default to this mask's counts. Pass the global counts
    when the step is spread over ranks (all-reduced) or over dynamic-sampling top-ups, so the
    gradient equals the single-process full-batch gradient."""
    m = mask.float()
    lengths = m.sum(-1, keepdim=True)  # (B, 1)
    n_seqs = float((lengths > 0).sum()) if num_seqs is None else float(num_seqs)
    if aggregation == "seq_mean_token_mean":
        return m / (lengths.clamp(min=1.0) * max(n_seqs, 1.0))
    if aggregation == "token_mean":
        n_tokens = float(m.sum()) if num_tokens is None else float(num_tokens)
        return m / max(n_tokens, 1.0)
    if aggregation == "seq_mean_token_sum_norm":
        if max_len is None:
            raise ValueError(
                "token_weights: aggregation 'seq_mean_token_sum_norm' needs max_len (the maximum completion length)."
            )
        return m / (max(n_seqs, 1.0) * max_len)
    raise ValueError(f"token_weights: unknown aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}.")


def grpo_ma_token_weights(
    thought_mask: Tensor,
    answer_id: Tensor,
    *,
    thought_weight: float = 1.0,
    answer_weight: float = 1.0,
    num_thoughts: int | float | None = None,
    num_answers: int | float | None = None,
) -> Tensor:
    """GRPO-MA segment weights for the packed layout: each row is one thought then its M answers.

    thought_mask: [B, T] 1 on the thought's tokens (B = P*K rows, one per thought).
    answer_id:    [B, T] long, j in 0..M-1 on the tokens of answer j, -1 elsewhere.
    Returns weight [B, T] such that -sum(weight * obj) =
      -(thought_weight * mean over thoughts of per-thought token means
        + answer_weight * mean over answers of per-answer token means).
    Thought tokens are counted once, not M times. num_thoughts / num_answers (non-empty segments)
    default to this step's counts; pass global counts under DDP. An empty thought (no
    end-of-thought marker) drops out, so with M = 1 and empty thoughts this is GRPO's
    seq_mean_token_mean. With non-empty thoughts and M = 1 it is (thought mean + answer mean), not
    GRPO's length-weighted mean; for token-level aggregation use token_weights on the union mask."""
    is_answer = answer_id >= 0
    if bool((thought_mask.bool() & is_answer).any()):
        raise ValueError("grpo_ma_token_weights: a token is marked both as thought and as answer.")
    thought = thought_mask.float()
    thought_len = thought.sum(-1, keepdim=True)  # (B, 1)
    n_th = float((thought_len > 0).sum()) if num_thoughts is None else float(num_thoughts)
    B = answer_id.shape[0]
    M = int(answer_id.max()) + 1 if bool(is_answer.any()) else 1
    slot = answer_id.clamp(min=0).long()
    answer_len = torch.zeros(B, M, device=answer_id.device).scatter_add_(1, slot, is_answer.float())  # (B, M)
    n_ans = float((answer_len > 0).sum()) if num_answers is None else float(num_answers)
    w_thought = thought_weight * thought / (thought_len.clamp(min=1.0) * max(n_th, 1.0))
    w_answer = answer_weight * is_answer.float() / (answer_len.gather(1, slot).clamp(min=1.0) * max(n_ans, 1.0))
    return w_thought + w_answer


def grpo_ma_token_advantages(
    thought_adv: Tensor, answer_adv: Tensor, thought_mask: Tensor, answer_id: Tensor
) -> Tensor:
    """Per-token advantage for the packed GRPO-MA layout (see grpo_ma_token_weights).

    thought_adv [P, K], answer_adv [P, K, M], thought_mask / answer_id [P*K, T] -> adv [P*K, T]:
    thought tokens get their thought's advantage, answer j's tokens get A_ans[p, i, j]."""
    P, K, M = answer_adv.shape
    if bool((answer_id >= M).any()):
        raise ValueError(f"grpo_ma_token_advantages: answer_id holds ids >= M = {M}.")
    th = thought_adv.reshape(P * K, 1) * thought_mask.float()
    ans = answer_adv.reshape(P * K, M).gather(1, answer_id.clamp(min=0).long()) * (answer_id >= 0)
    return th + ans


# ----------------------------------------------------------------------------------------------
# 5. Diagnostics and data: gradient spikes, hard-example selection


def gradient_spike_score(grad_norms: list[float] | Tensor, tau: float = 10.0) -> tuple[Tensor, float]:
    """Gradient spike score (SPAM; GRPO-MA reports GSS@10): gss_t = ||g_t|| / mean_{s<=t} ||g_s||.

    grad_norms: [N] global grad norms before clipping -> (gss [N] float64, fraction of steps with
    gss > tau). Steps where every norm so far is 0 get gss 0."""
    g = torch.as_tensor(grad_norms, dtype=torch.float64).flatten()
    running_mean = g.cumsum(0) / torch.arange(1, g.numel() + 1, dtype=torch.float64)
    gss = torch.where(running_mean > 0, g / running_mean, torch.zeros_like(g))
    return gss, float((gss > tau).double().mean()) if g.numel() else 0.0


SELECTIONS = ("hardest", "medium", "easiest", "random")


def select_hard_examples(
    pass_rates: Tensor, fraction: float, *, mode: str = "hardest", generator: torch.Generator | None = None
) -> Tensor:
    """Difficulty-based data selection (Pikus, Tiwari, Ye, arXiv 2508.14094): [N] pass rates -> [n] indices.

    pass_rates: [N] success rate of each candidate prompt over K samples of the STARTING model.
    n = floor(N * fraction) (the released code's int(len * size)); fraction = 1 keeps every example,
    a fraction that keeps none is an error. Modes, as the released code's get_*_subset (src/src_utils.py):
      hardest  the n lowest pass rates, hardest first (the paper's choice, 10% of the pool)
      medium   the n around the median: ranks [(N - n) // 2, (N - n) // 2 + n) of the hardest-first order
      easiest  the n highest pass rates, easiest first
      random   a uniform draw of n without replacement from `generator` (required), in drawn order
    Ties are broken by data order (stable sorts), so equal pass rates keep the earlier index; with a
    small K many prompts tie at 0 and the "hardest 10%" is then the first of them in the file.
    The paper's "learnable percentage" (training steps with non-zero within-group reward std) builds on
    the per-step fraction of mixed groups, dynamic_sampling_keep(rewards).float().mean()."""
    if mode not in SELECTIONS:
        raise ValueError(f"select_hard_examples: unknown mode {mode!r}; choose one of {', '.join(SELECTIONS)}.")
    if pass_rates.dim() != 1:
        raise ValueError(f"select_hard_examples: pass_rates must be [N], got shape {tuple(pass_rates.shape)}.")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"select_hard_examples: fraction must be in (0, 1], got {fraction}.")
    N = pass_rates.numel()
    n = math.floor(N * fraction + 1e-9)  # 100 * 0.29 is 28.999..., still 29
    if n == 0:
        raise ValueError(f"select_hard_examples: fraction {fraction} of {N} examples keeps none; raise the fraction.")
    if mode == "random":
        if generator is None:
            raise ValueError(
                "select_hard_examples: mode 'random' needs a torch.Generator (generator=...), for a seeded draw."
            )
        return torch.randperm(N, generator=generator, device=pass_rates.device)[:n]
    if mode == "easiest":
        return torch.argsort(pass_rates, descending=True, stable=True)[:n]
    order = torch.argsort(pass_rates, stable=True)  # hardest first
    start = (N - n) // 2 if mode == "medium" else 0
    return order[start : start + n]
