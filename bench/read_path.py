"""read_path.py: how many lines a reader needs for one plain GRPO step, measured by running one.

    python bench/read_path.py              # --algo grpo on the bundled model: one step, a table per file
    python bench/read_path.py --algo dapo  # the same for a preset: what its methods add
    python bench/read_path.py --rollout-dtype bfloat16  # as on CUDA by default: a bf16 copy samples (mismatch.py)

Runs one training step of `python train.py --algo ALGO` (the bundled model, 16 prompts x 8 completions) under
a profiler and records every function of the project that the step enters, from sampling to the optimizer
step: sample -> score (rewards) -> pack -> score pass -> advantages -> update (policy_loss) -> AdamW. A
function counts with all its code lines (its whole body, whichever branches ran; not its docstring, comments or
blank lines), since a reader who opens it reads all of it; main()'s loop counts whole too.

Files are grouped by the README's layers. The read path is the loop, the RL core, the tasks and rewards and the
methods' seams (methods/__init__.py); the language model (sampler, KV cache, transformer, tokenizer) and the
run infrastructure (sums over ranks, metrics) are listed apart: a reader of the RL algorithm calls them as
`sample_tree(...)` or `token_stats(...)` without reading them, as GRPO-Zero's and nanochat's RL scripts call
their model and engine. Lines in methods/<paper>.py are the paper-specific lines a plain run still executes:
each method's `enabled(cfg)` (False: the method is off) is listed apart from the hooks that ran.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import methods  # noqa: E402
import train  # noqa: E402
from config import PRESETS, TrainConfig  # noqa: E402
from hf import bundled  # noqa: E402

LAYERS = {
    "the loop": ("train.py", "run.py", "config.py"),
    "the RL core": ("advantage.py", "losses.py", "pack.py", "lora.py"),
    "tasks and rewards": ("tasks.py", "data.py", "rewards.py", "math_answers.py", "math_equal.py", "sandbox.py"),
    "methods' seams": ("methods/__init__.py",),
}
LANGUAGE_MODEL = (
    "model.py",
    "deltanet.py",
    "logprobs.py",
    "hf.py",
    "tokenizer.py",
    "kvcache.py",
    "sampler.py",
    "stop_text.py",
)
STEP = ("sample", "score", "pack", "split_rows", "select_rows", "score_pass", "advantages", "update")
SEAMS = ("chain", "metrics")  # the seams main() calls itself
# The fields of the step's record (pack.Batch, losses.Tokens) that only methods fill: the tokens the policy did not
# sample (DaGRPO's anchors) and their LUFFY shaping, the selections (80/20, Clip-Cov, KL-Cov; GMPO's geometric
# mean), the rollout-mismatch weights. A core line that reads one carries a method into the plain path.
METHOD_FIELDS = re.compile(r"\b(off_policy|is_weight|selected)\b|\.keep\b|\"keep\"|\boff\b")


def code_lines(path: str, only: re.Pattern | None = None) -> dict[int, tuple[int, str]]:
    """{first line of each function: (its code lines, its name)}: docstrings, comments and blank lines left out;
    with `only`, the code lines that match it (comments stripped)."""
    src = open(path).read()
    lines, tree = src.splitlines(), ast.parse(src)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node) is not None:
            doc.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    spans = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            text = [lines[i - 1].strip() for i in range(node.lineno, node.end_lineno + 1) if i not in doc]
            text = [t for t in text if t and not t.startswith("#")]
            text = [t for t in text if only.search(t.split("  #")[0])] if only else text
            spans[node.lineno] = (len(text), node.name)
    return spans


def trace_step(algo: str, out: str, rollout_dtype: str = "auto") -> set[tuple[str, int]]:
    """(file, first line) of every project function entered by the step functions of one step of `algo`."""
    seen = set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        skip = path.startswith(os.path.join(ROOT, ".venv")) or path == os.path.abspath(__file__)
        if event == "call" and path.startswith(ROOT) and not skip:
            seen.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_firstlineno))

    def traced(fn):
        def call(*a, **k):
            before = sys.getprofile()  # a traced seam called inside a traced step leaves the step traced
            sys.setprofile(profile)  # the calls this function makes, at any depth
            try:
                return fn(*a, **k)
            finally:
                sys.setprofile(before)

        return call

    patched = [(train, name) for name in STEP] + [(methods, name) for name in SEAMS]
    originals = [getattr(module, name) for module, name in patched]
    for module, name in patched:
        setattr(module, name, traced(getattr(module, name)))
    preset = PRESETS[algo]
    run = dict(algo=algo, max_steps=1, out=out, eval_every=0, save_every=0, rollout_dtype=rollout_dtype)
    cfg = TrainConfig(**{**preset, **run})
    try:
        train.main(TrainConfig(**{**cfg.__dict__, "model": bundled(cfg.model), "eval_examples": 4}))
    finally:  # the modules as they were (a test measures in its own process)
        for (module, name), fn in zip(patched, originals):
            setattr(module, name, fn)
    first = next(line for line, (_, name) in code_lines(os.path.join(ROOT, "train.py")).items() if name == "main")
    return seen | {("train.py", first)}


def measure(algo: str = "grpo", rollout_dtype: str = "auto") -> dict:
    """One step of `algo`, measured: the functions it enters by file ({file: [(code lines, name)]}), the read
    path's lines, the hooks of methods/<paper>.py that ran, and the loop's and core's lines that read a field only
    a method fills (METHOD_FIELDS)."""
    with tempfile.TemporaryDirectory() as out:
        seen = trace_step(algo, os.path.join(out, "run"), rollout_dtype)
    by_file = collections.defaultdict(list)
    for path, first in seen:
        spans = code_lines(os.path.join(ROOT, path))
        if first in spans:
            by_file[path].append(spans[first])
    counts = {p: sum(n for n, _ in fns) for p, fns in by_file.items()}
    paper = {p: fns for p, fns in by_file.items() if p.startswith("methods/") and p != "methods/__init__.py"}
    hooks = {p: [(n, f) for n, f in fns if f != "enabled"] for p, fns in paper.items()}
    core = [f for layer in ("the loop", "the RL core") for f in LAYERS[layer]]
    fields = collections.Counter()
    for path, first in seen:
        if path in core:
            n, name = code_lines(os.path.join(ROOT, path), METHOD_FIELDS).get(first, (0, ""))
            fields[f"{path}:{name}"] += n
    ran = sum(n for fns in hooks.values() for n, _ in fns)
    read = sum(counts.get(f, 0) for files in LAYERS.values() for f in files) + ran
    return dict(by_file=by_file, counts=counts, paper=paper, hooks=hooks, hook_lines=ran, read_path=read,
                fields=fields, method_fields=sum(fields.values()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="grpo", choices=sorted(PRESETS))
    parser.add_argument("--functions", action="store_true", help="list each file's functions with their lines")
    parser.add_argument("--rollout-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()
    m = measure(args.algo, args.rollout_dtype)
    by_file, counts, paper, hooks = m["by_file"], m["counts"], m["paper"], m["hooks"]
    dtype = "" if args.rollout_dtype == "auto" else f" --rollout-dtype {args.rollout_dtype}"
    print(f"\none step of --algo {args.algo}{dtype}: the code lines of every function it enters\n")
    for layer, files in LAYERS.items():
        n = sum(counts.get(f, 0) for f in files)
        print(f"{layer:20s} {n:4d}  " + ", ".join(f"{f} {counts[f]}" for f in files if f in counts))
        for f in files if args.functions else ():
            print(f"{'':26s}{f}: " + ", ".join(f"{name} {k}" for k, name in sorted(by_file.get(f, []), reverse=True)))
    checks = sum(n for fns in paper.values() for n, f in fns if f == "enabled")
    print(
        f"{'methods/<paper>.py':20s} {m['hook_lines']:4d}  hooks: "
        + ", ".join(f"{p}:{f} {n}" for p, v in hooks.items() for n, f in v)
    )
    print(f"{'':20s} {checks:4d}  enabled(cfg) of {len(paper)} methods (each: is the method on?)")
    print(f"{'READ PATH':20s} {m['read_path']:4d}  (the loop, the RL core, tasks and rewards, the seams, the hooks)")
    listed = ", ".join(f"{k} {n}" for k, n in sorted(m["fields"].items()) if n)
    print(f"{'':20s} {m['method_fields']:4d}  of them read the methods' fields of the step's record: {listed}")
    lm = sum(counts.get(f, 0) for f in LANGUAGE_MODEL)
    rest = sorted(set(counts) - {f for fs in LAYERS.values() for f in fs} - set(LANGUAGE_MODEL) - set(paper))
    print(
        f"\ncalled, not read: the language model {lm} ("
        + ", ".join(f"{f} {counts[f]}" for f in LANGUAGE_MODEL if f in counts)
        + ")"
    )
    print("                  the run infrastructure " + ", ".join(f"{f} {counts[f]}" for f in rest))


if __name__ == "__main__":
    main()
