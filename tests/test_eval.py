"""Evaluation: unbiased pass@k, the held-out report, the CLI and the plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import combinations

import pytest

from eval import EvalConfig, main, plot_by_config, plot_runs
from heldout import evaluate, pass_at_k
from helpers import count_compiled_steps, lock_held_elsewhere
from hf import load_model
from tasks import TASK_NAMES, get_task
from tokenizer import decode_completion, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")


@pytest.mark.parametrize("n, c, k", [(4, 1, 1), (4, 2, 2), (10, 3, 4), (16, 0, 16), (16, 16, 1), (7, 5, 3)])
def test_pass_at_k_equals_its_definition(n, c, k):
    """Guards against the biased estimator 1-(1-c/n)^k or an off-by-one in the product form: the
    value must equal the probability that a random k-subset of the n samples holds a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    exact = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), exact, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    """Guards against silently returning a number for c > n or k > n."""
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


def test_decode_completion_stops_at_the_first_stop_token():
    """Guards against rewards seeing text after the end-of-turn token (or the token itself)."""
    tok = load_tokenizer(BUNDLED)
    ids = tok.encode("<think>1+2=3\n</think>3") + [tok.stop_ids[0]] + tok.encode("99")
    assert decode_completion(tok, ids) == "<think>1+2=3\n</think>3"


def test_evaluate_reports_consistent_metrics():
    """Guards against greedy/sampled metrics that disagree with the task's own correctness check,
    or pass@k that is not monotone in k."""
    model, tok, task = load_model(BUNDLED), load_tokenizer(BUNDLED), get_task("synthetic")
    examples = task.test(12, 0)
    res = evaluate(model, tok, task, examples, n=4, ks=(1, 2, 4), max_new_tokens=40, seed=3)
    assert res["examples"] == 12 and 0 <= res["greedy_accuracy"] <= 1
    assert math.isclose(res["pass@1"], res["mean@4"], abs_tol=1e-12)  # pass@1 is the mean accuracy
    assert res["pass@1"] <= res["pass@2"] <= res["pass@4"] <= 1
    assert res == evaluate(model, tok, task, examples, n=4, ks=(1, 2, 4), max_new_tokens=40, seed=3)  # seeded


def test_plot_writes_a_png(tmp_path):
    """Guards against the plot command crashing on runs with missing metrics (e.g. kl = null)."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "reward/mean": s / 10, "entropy": 1.0, "grad_norm": 0.5, "len/completion_mean": 20, "kl": None}
        for s in range(1, 5)
    ] + [{"step": 4, "eval/accuracy": 0.5, "eval/mean@4": 0.4}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    out = plot_runs([str(run)], str(tmp_path / "p.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_groups_seeds_and_maps_steps_to_time_and_tokens(tmp_path):
    """Guards against seed runs not being averaged, or eval points landing at the wrong time/tokens."""
    pytest.importorskip("matplotlib")
    from eval import run_label, x_of_step

    assert run_label("runs/exp/grpo_t4a1-s2/") == "grpo_t4a1" and run_label("runs/my-s0x") == "my-s0x"
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    rows += [{"step": s, "loss": 0.0, "time/step_s": 0.5 * s, "tokens/generated": 100} for s in (1, 2, 3)]
    rows += [{"step": 3, "eval/accuracy": 0.4}]
    assert x_of_step(rows, "time") == {0: 0.0, 1: 0.5, 2: 1.5, 3: 3.0}
    assert x_of_step(rows, "tokens") == {0: 0.0, 1: 100.0, 2: 200.0, 3: 300.0}
    assert x_of_step(rows, "step") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    runs = []
    for seed in (0, 1):
        run = tmp_path / f"cfg-s{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
        runs.append(str(run))
    out = plot_runs(runs, str(tmp_path / "t.png"), x="time", keys=["eval/accuracy"])
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--x must be one of"):
        plot_runs(runs, str(tmp_path / "u.png"), x="wall")


@pytest.mark.slow
def test_cli_prints_a_table_and_writes_json(tmp_path):
    """Guards against the documented `eval.py --model ... --n --k --out` command breaking."""
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, "eval.py", "--model", BUNDLED, "--examples", "8", "--n", "2", "--k", "1,2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "greedy_accuracy" in r.stdout and "pass@2" in r.stdout
    assert json.loads(out.read_text())["results"]["examples"] == 8


# ---------------------------------------------------------------- observed bugs: flags and data checked first


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(n=4, k="1,4,16"),
            "--k 16 is above --n 4: pass@k needs at least k samples per prompt; raise --n to 16 or drop 16 from --k",
        ),
        (dict(k="0"), "--k values must be >= 1 (pass@k draws k samples), got 0"),
        (dict(k="1,x"), "--k must be comma-separated integers such as 1,4,16, got '1,x'"),
        (dict(n=0, k="1"), "--k 1 needs sampled completions but --n 0 is greedy only; raise --n or drop --k"),
        (dict(n=-1), "--n must be >= 0 (samples per prompt; 0 = greedy only), got -1"),
        (dict(examples=0), "--examples must be >= 1 (held-out prompts to evaluate), got 0"),
        (dict(top_p=0.0), "--top-p must be in (0, 1] (1 = off), got 0.0"),
        (dict(temperature=-0.5), "--temperature must be >= 0 (0 = greedy), got -0.5"),
        (dict(max_new_tokens=0), "--max-new-tokens must be >= 1, got 0"),
        (dict(device="gpu"), "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (dict(task="gsm9k"), "--task must be one of " + ", ".join(TASK_NAMES) + ", got 'gsm9k'"),
    ],
)
def test_eval_config_rejects_impossible_flags(flags: dict, message: str) -> None:
    """Guards against pass@k for k > n (undefined; pass@16 was silently dropped for --n 4), --k 0,
    a negative --n, --examples 0, --top-p 0 or a negative temperature reaching the model: each is one
    sentence naming the flag, raised by EvalConfig itself (cli.parse_config makes it an argparse error)."""
    with pytest.raises(ValueError) as e:
        EvalConfig(**flags)
    assert str(e.value) == message


def test_default_k_follows_n() -> None:
    """Guards against the default --k (once "1,4,16") making a plain `--n 4` an error or dropping pass@n."""
    assert EvalConfig().pass_ks() == (1, 4, 16)
    assert EvalConfig(n=4).pass_ks() == (1, 4) and EvalConfig(n=10).pass_ks() == (1, 4, 10)
    assert EvalConfig(n=1).pass_ks() == (1,) and EvalConfig(n=0).pass_ks() == ()
    assert EvalConfig(n=8, k="4,1,4").pass_ks() == (1, 4)


def test_evaluate_rejects_k_above_n_before_generating() -> None:
    """Guards against evaluate() silently leaving out pass@k for k > n (no model is needed to fail)."""
    with pytest.raises(ValueError, match=r"^evaluate: need n >= 0 and every k in 1\.\.n, got n=4, ks=\(1, 16\)\.$"):
        evaluate(None, None, None, [{"prompt": "1+2", "answer": "3"}], n=4, ks=(1, 16))
    with pytest.raises(ValueError, match="evaluate: no examples"):
        evaluate(None, None, None, [], n=4)


@pytest.mark.slow
def test_cli_flag_error_comes_before_the_model_load() -> None:
    """Guards against a bad flag surfacing only after the (slow) model load, or as a traceback: the model
    path does not exist, yet the error is about --k, from argparse (exit status 2)."""
    r = subprocess.run(
        [sys.executable, "eval.py", "--model", "no/such/model", "--n", "4", "--k", "1,4,16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == (
        "error: --k 16 is above --n 4: pass@k needs at least k samples per prompt; "
        "raise --n to 16 or drop 16 from --k (see --help)"
    )


def write_rows(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_data_is_checked_before_the_model_is_loaded(tmp_path) -> None:
    """Guards against a data error found only after the model loaded (here the model path does not even
    exist), and against 8 requested held-out examples silently becoming 1: the error is one sentence."""
    data = write_rows(tmp_path / "ten.jsonl", [{"prompt": f"{i}+1", "answer": i + 1} for i in range(10)])
    missing = str(tmp_path / "no-model")
    with pytest.raises(SystemExit) as e:
        main(EvalConfig(model=missing, task="jsonl", data=data, examples=8))
    assert str(e.value) == (
        f"--examples 8 asks for 8 held-out examples but the held-out split of {data} "
        "(every 10th example) has 1; lower --examples or pass a larger --test-data FILE.jsonl."
    )
    with pytest.raises(SystemExit) as e:
        main(EvalConfig(model=missing, task="gsm8k", data=str(tmp_path)))
    assert str(e.value) == f"{tmp_path}: is a directory, not a data file; pass the path of a .jsonl file."
    with pytest.raises(SystemExit, match="no-model"):  # good data: only then the checkpoint is read
        main(EvalConfig(model=missing, task="jsonl", data=data, examples=1))


@pytest.mark.slow
def test_test_data_flag_evaluates_the_whole_test_file(tmp_path) -> None:
    """Guards against eval.py having no --test-data (a test file given as --data was cut to every 10th
    line) and against a prompt too long for the context failing inside the sampler as "prompt 0"."""
    test = write_rows(tmp_path / "t.jsonl", [{"prompt": f"{i}+2", "answer": i + 2} for i in range(3)])
    res = main(EvalConfig(model=BUNDLED, task="jsonl", test_data=test, examples=3, n=2, max_new_tokens=40))
    assert res["examples"] == 3 and "pass@2" in res
    with pytest.raises(SystemExit) as e:  # the system prompt makes these 201 tokens; the context is 256
        main(EvalConfig(model=BUNDLED, task="jsonl", test_data=test, examples=3, n=2, max_new_tokens=80))
    assert str(e.value) == (
        f"{test} line 1: the prompt is 201 tokens, more than the 176 allowed by the model's "
        "context of 256 tokens minus --max-new-tokens 80; shorten or drop that example."
    )


@pytest.mark.slow
def test_system_prompt_and_thinking_flags_reach_the_prompts(tmp_path) -> None:
    """Guards eval.py --system-prompt and --no-enable-thinking being parsed but not used: the prompt
    that overflows the context with the task's system prompt (201 tokens, see above) fits without it
    ("": 22 tokens), and a 100-character replacement (132) or the pre-filled empty thought (28) has
    the length the limit check then reports."""
    test = write_rows(tmp_path / "t.jsonl", [{"prompt": f"{i}+2", "answer": i + 2} for i in range(3)])
    cfg = dict(model=BUNDLED, task="jsonl", test_data=test, examples=3, n=1, max_new_tokens=80)
    assert main(EvalConfig(**cfg, system_prompt=""))["examples"] == 3
    for extra, length in (({"system_prompt": "9" * 100}, 132), ({"system_prompt": "", "enable_thinking": False}, 28)):
        cfg["max_new_tokens"] = 256 - length + 1  # one token too many for this prompt length
        with pytest.raises(SystemExit, match=f"the prompt is {length} tokens"):
            main(EvalConfig(**cfg, **extra))


@pytest.mark.slow
def test_compile_flag_decodes_through_the_compiled_step(monkeypatch) -> None:
    """Guards eval.py --compile being parsed but not used: the sampler's static decode step is
    compiled once and decoding goes through it (torch.compile is replaced by a counting wrapper here:
    compiling takes minutes on CPU), with the same results as without."""
    calls = count_compiled_steps(monkeypatch)
    cfg = dict(model=BUNDLED, examples=4, n=2, max_new_tokens=20, seed=1)
    res = main(EvalConfig(**cfg, compile=True))
    assert calls[0] == "compile" and calls.count("compile") == 1 and calls.count("step") > 0
    for key, value in main(EvalConfig(**cfg)).items():
        assert res[key] == pytest.approx(value, abs=1e-12), key


@pytest.mark.slow
def test_case13_a_missing_model_directory_is_named_as_train_py_names_it(tmp_path) -> None:
    """Guards against eval.py --model /nonexistent saying `.../tokenizer.json: missing` (the tokenizer is read
    first) where train.py says the directory is not found: both name the directory."""
    with pytest.raises(SystemExit) as e:
        main(EvalConfig(model=str(tmp_path / "nonexistent"), examples=1))
    assert str(e.value) == f"{tmp_path / 'nonexistent'}: model directory not found."


def test_case14_a_runs_colour_is_the_same_in_every_panel(tmp_path, monkeypatch) -> None:
    """Guards against a run that lacks a metric shifting the colours of the other runs in that panel
    (matplotlib's colour cycle restarts per panel): each run keeps one colour everywhere."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    runs = []
    for name, keys in (("a", ["reward/mean"]), ("b", ["reward/mean", "grad_norm"])):
        (tmp_path / name).mkdir()
        rows = [{"step": s, **{k: float(s) for k in keys}} for s in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
        runs.append(str(tmp_path / name))
    plot_runs(runs, str(tmp_path / "p.png"), keys=["reward/mean", "grad_norm"])
    reward, grad = figures[0].axes[:2]
    colour = lambda ax: {line.get_label(): to_rgb(line.get_color()) for line in ax.get_lines()}
    assert colour(reward)["a"] != colour(reward)["b"] and colour(grad) == {"b": colour(reward)["b"]}


@pytest.mark.slow
def test_pass_rates_file_has_one_writer(tmp_path) -> None:
    """Guards against two `eval.py --pass-rates` writing the same --out file, interleaving their rows:
    the second is refused in one sentence naming the process that holds the file."""
    out = tmp_path / "rates.jsonl"
    with lock_held_elsewhere(str(out)) as holder:
        with pytest.raises(SystemExit) as e:
            main(EvalConfig(pass_rates=True, k="2", examples=2, out=str(out), max_new_tokens=8))
        assert str(e.value).startswith(f"--out {out} is in use by process {holder.pid} (")
    res = main(EvalConfig(pass_rates=True, k="2", examples=2, out=str(out), max_new_tokens=8))  # freed by its kill
    assert 0 <= res["pass_rate_mean"] <= 1


def test_eval_help_device_and_plot_errors_as_documented(tmp_path) -> None:
    """Guards against eval.py's --help hiding --plot, listing the tool flags ahead of --model, a --device that
    defaults to cpu on a GPU machine (auto: cuda when available, as train.py), and `--plot` of a directory without
    metrics.jsonl exiting 1 without `error:` (docs/runs.md promises exit 2 and one line)."""
    r = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eval.py --plot RUN [RUN ...]" in " ".join(r.stdout.split())
    sections = [line[:-1] for line in r.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert sections[1:3] == ["run", "sampling and pass@k"], sections  # after argparse's own "options"
    assert EvalConfig().device == "auto" and "auto" in EvalConfig.CHOICES["device"]
    missing = str(tmp_path / "missing")
    r = subprocess.run([sys.executable, "eval.py", "--plot", missing], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: --plot {missing}: no metrics.jsonl in that directory"
    ]


def test_runs_of_different_tasks_or_models_never_share_a_figure(tmp_path) -> None:
    """Guards against `make plot` drawing every run under runs/ on one set of axes, whatever its task or model: runs
    that share a task and a model (config.json) share a figure, each other group gets its own PNG."""
    pytest.importorskip("matplotlib")
    runs = []
    for name, task, model in [("a", "synthetic", "m/tiny"), ("b", "synthetic", "m/tiny/"), ("c", "countdown", "m/q")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"task": task, "model": model}))
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
        runs.append(str(tmp_path / name))
    out = str(tmp_path / "plot.png")
    assert plot_by_config(runs, out) == [
        str(tmp_path / "plot-synthetic-tiny.png"),
        str(tmp_path / "plot-countdown-q.png"),
    ]
    assert plot_by_config(runs[:2], out) == [out]  # one group: the PNG asked for
