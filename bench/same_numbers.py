"""same_numbers.py: a change that should alter no number, checked: short runs on another commit and on this tree.

    python bench/same_numbers.py --base HEAD~3             # every configuration below, 3 steps each (~4 min, 2 cores)
    python bench/same_numbers.py --base main --only dagrpo,offload --steps 5

For each configuration it runs `train.py FLAGS --max-steps N` on the bundled model twice, once in a git worktree
of --base and once in this working tree, and compares what the runs wrote: every metrics.jsonl value of every
step except timings and memory (time/, mem/, tokens_per_s), and the final weights (a SHA-256 of the safetensors'
tensors, LoRA adapters included). A refactor of the loop, the seams or the packing should print "same" on every
line; a change that means to alter numbers names the configurations it alters, and the first values that differ.
Keys only one side logs are listed, not compared. Exit status 1 when anything differs or a run fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One configuration per path through the step: the default tree, the methods' hooks, the loss table, the
# sampler copy's correction, the optimizer offload, LoRA.
RUNS = {
    "grpo_ma": [],
    "grpo_mu2": ["--algo", "grpo", "--mu", "2"],
    "dagrpo": ["--algo", "dagrpo", "--task", "synthetic-hard"],
    "dagrpo_dual_clip": ["--algo", "dagrpo", "--task", "synthetic-hard", "--dual-clip", "3", "--mu", "2"],
    "dagrpo_gspo": ["--algo", "dagrpo", "--task", "synthetic-hard", "--sequence-ratio", "--mu", "2"],
    "gmpo_entropy_mask": ["--algo", "dr_grpo", "--loss", "gmpo", "--top-entropy-fraction", "0.5", "--mu", "2"],
    "kl_cov": ["--algo", "kl_cov"],
    "clip_cov": ["--algo", "clip_cov"],
    "gtpo": ["--algo", "gtpo"],
    "dapo": ["--algo", "dapo"],
    "gpg": ["--algo", "grpo", "--gpg-alpha"],
    "reinforce_pp": ["--algo", "grpo", "--advantage", "reinforce_pp", "--no-std-normalize"],
    "kl_in_reward": ["--algo", "grpo", "--beta", "0.01", "--kl-in-reward", "--no-std-normalize"],
    "entropy_bonus": ["--algo", "grpo", "--entropy-coef", "0.01"],
    "mask_truncated": ["--algo", "grpo", "--mask-truncated"],
    "bf16_sampler": ["--algo", "grpo", "--rollout-dtype", "bfloat16"],
    "offload": ["--algo", "grpo", "--optimizer-offload", "--mu", "2"],
    "lora": ["--algo", "grpo", "--lora-rank", "4", "--beta", "0.01"],
    "dsv32": ["--algo", "dsv32"],
}
SHORT = ["--prompts-per-step", "4", "--eval-every", "0", "--eval-examples", "4", "--eval-samples", "0"]


def run(tree: str, flags: list[str], out: str, steps: int) -> tuple[list[dict] | None, str]:
    """(the steps' metrics without timings, the final weights' digest), or (None, the error's last lines)."""
    argv = [sys.executable, "train.py", *flags, *SHORT, "--max-steps", str(steps), "--out", out]
    proc = subprocess.run(argv, cwd=tree, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        return None, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/", "tokens_per_s"))} for r in rows]
    digest = hashlib.sha256()
    final = os.path.join(out, "final")
    for name in sorted(f for f in os.listdir(final) if f.endswith(".safetensors")):
        for key, t in sorted(load_file(os.path.join(final, name)).items()):
            digest.update(key.encode())
            digest.update(t.float().numpy().tobytes())
    return rows, digest.hexdigest()


def compare(base: list[dict], here: list[dict]) -> tuple[list[str], list[str]]:
    """(the first differing values as 'step k: key base -> here', the keys one side alone logs)."""
    diffs = [
        f"step {r['step']}: {k} {r[k]!r} -> {s[k]!r}" for r, s in zip(base, here) for k in r if k in s and r[k] != s[k]
    ]
    if len(base) != len(here):
        diffs.append(f"{len(base)} steps -> {len(here)} steps")
    only = sorted(set(base[0]) ^ set(here[0])) if base and here else []
    return diffs, only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--only", default="", help=f"comma-separated configurations (of: {', '.join(RUNS)})")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"same_numbers: unknown configuration {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "--detach", "-q", base_tree, args.base], cwd=ROOT, check=True)
        try:
            for name in names:
                a, wa = run(base_tree, RUNS[name], os.path.join(tmp, "out-base", name), args.steps)
                b, wb = run(ROOT, RUNS[name], os.path.join(tmp, "out-here", name), args.steps)
                if a is None or b is None:
                    failed = True
                    print(f"{name:18s} FAILED  base: {wa if a is None else 'ran'}; here: {wb if b is None else 'ran'}")
                    continue
                diffs, only = compare(a, b)
                same = not diffs and wa == wb
                failed |= not same
                what = "same" if same else "DIFFERENT: " + "; ".join(diffs[:3] or ["the final weights"])
                print(f"{name:18s} {what}" + (f"  (logged on one side only: {', '.join(only)})" if only else ""))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=ROOT, check=False)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
