"""The math checker against someone else's verdicts (not a test): agreement and false credit of
`rewards.math_reward(pred, {"answer": gold})` on (gold, prediction, expected verdict) triples, with the
built-in checker alone and with math-verify, when it is installed.

    python bench/bench_math_checker.py PATH [--show]

PATH is a checkout of Hugging Face's Math-Verify repository (its tests/*.py hold the triples in
`pytest.mark.parametrize` lists, read here with `ast`, never imported) or a JSONL file with one
{"gold": ..., "pred": ..., "expected": 0 or 1} per line. Rows that ask Math-Verify for a non-default
comparison (strict=False, allow_set_relation_comp=True, a precision other than 6) and rows that are not
literals (f-strings) are left out and counted. Agreement: the share of rows whose reward equals the
expected verdict. False credit: the share of expected-0 rows given reward 1 (the number a policy can
exploit; it must be 0: each such row is printed, and the exit status is 1). --show lists every disagreement.
"""

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rewards import math_reward  # noqa: E402

DEFAULTS = {"precision": 6, "strict": True, "allow_set_relation_comp": False}  # Math-Verify's default comparison


def parametrize_rows(decorator: ast.expr) -> tuple[list[dict], int]:
    """Rows of one `@pytest.mark.parametrize("gold, pred, expected, ...", [...])`, and how many were skipped."""
    if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"):
        return [], 0
    names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")]
    if not {"gold", "pred"} <= set(names) or not {"expected", "result"} & set(names):
        return [], 0
    rows, skipped = [], 0
    for item in decorator.args[1].elts:
        try:
            row = dict(zip(names, (ast.literal_eval(v) for v in item.elts)))
        except ValueError:  # an f-string or another expression
            skipped += 1
            continue
        if any(row.get(k, v) != v for k, v in DEFAULTS.items()):
            skipped += 1
            continue
        rows.append({"gold": row["gold"], "pred": row["pred"], "expected": int(row.get("expected", row.get("result")))})
    return rows, skipped


def load_cases(path: Path) -> tuple[list[dict], int]:
    """(cases, skipped) from a Math-Verify checkout or a JSONL file."""
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()], 0
    files = sorted((path / "tests").glob("test_*.py"))
    if not files:
        raise SystemExit(f"{path}: neither a JSONL file nor a directory with tests/test_*.py.")
    cases, skipped = [], 0
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            for decorator in getattr(node, "decorator_list", []):
                rows, n = parametrize_rows(decorator)
                cases += [{**row, "where": file.name} for row in rows]
                skipped += n
    return cases, skipped


def score(cases: list[dict], show: bool, label: str) -> int:
    """Print agreement and false credit of math_reward on `cases`; return the number of false credits."""
    wrong = [c for c in cases if c["expected"] == 0]
    agree = credited = 0
    for case in cases:
        reward = math_reward(case["pred"], {"answer": case["gold"]})
        agree += reward == case["expected"]
        credited += case["expected"] == 0 and reward == 1.0
        if (show or case["expected"] == 0) and reward != case["expected"]:
            print(f"  [{label}] expected {case['expected']} got {reward:.0f}  gold={case['gold'][-80:]!r}")
            print(f"      pred={case['pred'][-160:]!r}")
    print(
        f"{label:<14} agreement {agree}/{len(cases)} = {agree / len(cases):.1%}   "
        f"false credit {credited}/{len(wrong)} = {credited / max(len(wrong), 1):.1%}"
    )
    return credited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a Math-Verify checkout or a JSONL of gold/pred/expected")
    parser.add_argument("--show", action="store_true", help="print every disagreement")
    args = parser.parse_args()
    cases, skipped = load_cases(args.path)
    print(f"{len(cases)} cases ({sum(c['expected'] == 0 for c in cases)} wrong predictions), {skipped} rows skipped")
    credited = 0
    try:
        import math_verify  # noqa: F401

        credited += score(cases, args.show, "math-verify")
    except ImportError:
        print("math-verify     not installed: pip install -r requirements-dev.txt")
    sys.modules["math_verify"] = None  # from here on `import math_verify` fails: the built-in checker alone
    credited += score(cases, args.show, "built-in")
    sys.exit(1 if credited else 0)


if __name__ == "__main__":
    main()
