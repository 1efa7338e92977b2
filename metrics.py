"""metrics.py: what a training step logs (step 7 of train.py), as plain functions of the step's record and the
update's sums: every figure global over ranks (distributed.all_sum) unless its comment says otherwise."""

from __future__ import annotations

import time

import torch

from advantage import dynamic_sampling_keep, gradient_spike_score
from distributed import all_sum, memory_peak
from pack import Group, completions, per_completion


def rollout_metrics(groups: list[Group], world: int, m: int) -> dict:
    """What the policy sampled this step (global over ranks unless noted), read before a transform of the
    rollouts puts other tokens in (DaGRPO's anchors). m: M, the answers per thought."""
    reward, correct = per_completion(groups, "reward"), per_completion(groups, "correct")
    lengths = torch.tensor([len(t.tokens) + len(a.tokens) for _, t, a in completions(groups)]).view(reward.shape)
    thoughts = [t for g in groups for t in g.thoughts]
    answers = [a for t in thoughts for a in t.answers]
    parts = {f"reward/{k}": all_sum(sum(a.components[k] for a in answers), world) for k in answers[0].components}
    return {
        **{k: (v / all_sum(len(answers), world)).item() for k, v in parts.items()},
        "reward/mean": (all_sum(reward.sum(), world) / all_sum(reward.numel(), world)).item(),
        "reward/std": reward.std().item(),  # this rank's (rank 0's) rollouts
        "accuracy": (all_sum(correct.sum(), world) / all_sum(correct.numel(), world)).item(),
        "frac_zero_std_groups": (~dynamic_sampling_keep(reward.view(len(groups), -1))).float().mean().item(),
        "len/completion_mean": lengths.float().mean().item(),
        "truncated_frac": sum(a.finish == "length" for a in answers) / len(answers),
        "thought_truncated_frac": sum(t.truncated for t in thoughts) / len(thoughts) if m > 1 else 0.0,
        "tokens/generated": all_sum(sum(len(t.tokens) for t in thoughts + answers), world).item(),
    }


SUMS = ("loss", "clip_frac", "kl", "logp_gap", "entropy", "off_tokens", "off_p")  # the update's sums of diagnostics


def add_micro_batch(
    sums: dict,
    n: float,
    loss: torch.Tensor,
    metrics: dict,
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    sampled: torch.Tensor,
    entropy: torch.Tensor,
    off_policy: torch.Tensor | None,
) -> None:
    """Adds one micro-batch of the first epoch to the update's sums: its loss, and per trained token (n of them, the
    mask's) its KL and entropy (update() adds the clip fraction of every epoch); per sampled token the log-prob gap
    to the sampler; per trained token the policy did not sample (off_policy, or None: DaGRPO's anchors) its count
    and probability. update_metrics divides them by the step's token counts."""
    sums["loss"] += loss.item()
    sums["kl"] += metrics.get("kl", 0.0) * n
    sums["logp_gap"] += ((logp.detach() - sampler_logp).abs() * sampled).sum().item()
    sums["entropy"] += (entropy * mask.float()).sum().item()
    if off_policy is not None:
        off = off_policy & mask
        sums["off_tokens"] += off.sum().item()
        sums["off_p"] += (logp.detach().exp() * off).sum().item()


def update_metrics(
    sums: dict, trained: torch.Tensor, grad_norm: torch.Tensor, state: dict, world: int, **fields
) -> dict:
    """The update's diagnostics, global over ranks, per trained token (logp_gap and tis: per sampled token);
    the gradient norm and its spike score (GRPO-MA's GSS over the run's norms so far, state["grad_norms"]), skipped
    steps; trained: this rank's trained-token mask; fields: more entries of the row (kl: None without a reference)."""
    n_tok = max(all_sum(trained.sum(), world).item(), 1)
    n_sampled = max(n_tok - all_sum(sums["off_tokens"], world).item(), 1)
    state["grad_norms"].append(grad_norm.item())
    gss, gss10 = gradient_spike_score(state["grad_norms"])
    return {
        "loss": all_sum(sums["loss"], world).item(),
        "clip_frac": all_sum(sums["clip_frac"], world).item() / n_tok,
        "kl": all_sum(sums["kl"], world).item() / n_tok,
        "entropy": all_sum(sums["entropy"], world).item() / n_tok,
        "logp_gap": all_sum(sums["logp_gap"], world).item() / n_sampled,
        **{k: all_sum(sums[s], world).item() / n_sampled for k, s in METRIC_TIS.items() if s in sums},
        "grad_norm": grad_norm.item(),
        "gss": gss[-1].item(),
        "gss10_frac": gss10,
        "skipped_steps": state["skipped_steps"],
        **fields,
    }


# per sampled token: --tis-cap's correction (capped_frac: weights at a bound), DeepSeek-V3.2's mask
METRIC_TIS = {"tis/mean": "tis", "tis/capped_frac": "tis_capped", "opsm/masked_frac": "opsm_masked"}


class StepClock:
    """A step's phases, each with its seconds and peak memory (distributed.memory_peak: the peak RSS on CPU, the
    allocated memory on CUDA): lap(name) ends the phase that began at the last lap (or at the clock's start)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.start, self.times, self.mem = device, time.perf_counter(), {}, {}
        self.last = self.start
        memory_peak(device)  # the peaks are measured from here

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name], self.mem[name], self.last = now - self.last, memory_peak(self.device), now

    def row(self, generated: float) -> dict:
        """time/<phase>_s, time/step_s, tokens_per_s (of sampling: `generated` tokens), mem/<phase>_gib."""
        times = self.times | {"step": time.perf_counter() - self.start}
        row = {f"time/{k}_s": v for k, v in times.items()} | {"tokens_per_s": generated / max(times["sample"], 1e-9)}
        return row | {f"mem/{k}_gib": v for k, v in self.mem.items()}
