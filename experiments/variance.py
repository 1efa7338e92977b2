"""experiments/variance.py: GRPO-MA's variance claim, simulated and measured on real rollouts.

    python experiments/variance.py --models assets/tiny-model runs/exp/grpo_ma_t4a4-s0/final --out variance.json

1. Simulation (thought_advantage_variance): the error of the standardised thought
   advantage against its noise-free value, for K thoughts x M answers. The claim: a floor in K,
   falling about as 1/M.
2. Real rollouts of each model on held-out prompts: K thoughts x M answers per prompt with
   sampler.sample_tree, rewarded by the task. Per prompt, the between-thought variance of the
   thought values V_i = mean_j R_ij and the within-thought variance of R_ij; the noise-corrected
   between-thought variance S^2 = Var_i(V_i) - within / M; and the thought-advantage error of m < M
   answers per thought against the advantage from all M (the real-rollout analogue of step 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from advantage import group_advantages, grpo_ma_advantages  # noqa: E402
from hf import load_model  # noqa: E402
from sampler import sample_tree  # noqa: E402
from tasks import get_task, render_prompt  # noqa: E402
from tokenizer import decode_completion, load_tokenizer  # noqa: E402


def thought_advantage_variance(
    k: int, m: int, *, n_trials: int = 1000, q_low: float = 0.1, q_high: float = 0.9, seed: int = 0
) -> float:
    """Monte-Carlo check of GRPO-MA's variance claim (reference doc §1.6): E[(A_hat_i - z_i)^2].

    Per trial: K thoughts with true success probability q_i ~ U(q_low, q_high), M answers per
    thought with reward ~ Bernoulli(q_i). A_hat = grpo_ma_advantages' thought advantage; z = the
    same normalisation applied to the true q (noise-free). Returns the mean squared error over trials
    and thoughts. Claim: flat in K (a floor), falling ~1/M (limit E[q(1-q)] / (M Var q) as K, M grow).
    """
    gen = torch.Generator().manual_seed(seed)
    q = q_low + (q_high - q_low) * torch.rand(n_trials, k, generator=gen, dtype=torch.float64)  # (N, K)
    rewards = (torch.rand(n_trials, k, m, generator=gen, dtype=torch.float64) < q[..., None]).double()
    a_hat, _ = grpo_ma_advantages(rewards)  # (N, K): trials play the role of prompts
    z = group_advantages(q)
    return float(((a_hat - z) ** 2).mean())


def simulate(ks=(4, 16, 64), ms=(1, 2, 4, 8, 16), trials: int = 2000) -> dict:
    return {
        f"K{k}": {f"M{m}": thought_advantage_variance(k, m, n_trials=trials, seed=k * 100 + m) for m in ms} for k in ks
    }


@torch.no_grad()
def measure(path: str, task, n_prompts: int, k: int, m: int, seed: int) -> dict:
    model, tok = load_model(path), load_tokenizer(path)
    examples = task.test(n_prompts, seed)
    prompts = [render_prompt(tok, ex, task.system_prompt) for ex in examples]
    tree = sample_tree(
        model,
        prompts,
        k=k,
        m=m,
        max_thought_tokens=64,
        max_answer_tokens=16,
        end_of_thought=tok.encode("</think>"),
        temperature=1.0,
        stop_ids=tok.stop_ids,
        seed=[seed + i for i in range(len(prompts))],
    )
    texts = [decode_completion(tok, tree.thoughts[a // m] + ans) for a, ans in enumerate(tree.answers)]
    r = torch.tensor([task.reward(t, examples[a // (k * m)]) for a, t in enumerate(texts)], dtype=torch.float64)
    r = r.view(n_prompts, k, m)
    within = r.var(dim=2, unbiased=True).mean(dim=1)  # (P,) noise of one answer
    between_raw = r.mean(dim=2).var(dim=1, unbiased=True)  # (P,) spread of thought values
    between = (between_raw - within / m).clamp(min=0)  # (P,) minus the answer noise
    full, _ = grpo_ma_advantages(r)  # (P, K) advantage from all M answers
    err = {}
    for sub in [s for s in (1, 2, 4, 8) if s < m]:
        a, _ = grpo_ma_advantages(r[..., :sub])
        err[f"M{sub}"] = float(((a - full) ** 2).mean())
    informative = (r.flatten(1).std(dim=1) > 0).double().mean()
    return {
        "model": path,
        "prompts": n_prompts,
        "K": k,
        "M": m,
        "reward_mean": float(r.mean()),
        "between_raw": float(between_raw.mean()),
        "between": float(between.mean()),
        "within": float(within.mean()),
        "within_over_between": float(within.mean() / between.mean()) if between.mean() > 0 else float("inf"),
        "frac_prompts_with_signal": float(informative),
        "adv_error_vs_all_answers": err,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--models", nargs="+", required=True, help="checkpoint directories (start and end policies)")
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts per model")
    p.add_argument("--k", type=int, default=8, help="thoughts per prompt")
    p.add_argument("--m", type=int, default=16, help="answers per thought")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    task = get_task("synthetic")
    res = {
        "simulation": simulate(),
        "rollouts": [measure(m, task, args.prompts, args.k, args.m, args.seed) for m in args.models],
    }
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
