"""Tool-integrated reasoning (ToRL, arXiv 2503.23383): the policy calls a tool mid-completion, and the loss trains
only what it wrote. --tools python: a ```python block ended by ```output (or Qwen's <tool_call>, --tool-format
qwen: JSON, or Qwen3.5's XML) runs in the sandbox and its output is appended; --tools countdown: each proposed
<answer> gets feedback.
- sample: multi-turn rollouts (multiturn.sample_turns) with one environment (envs.py) per completion, its calls in
  --tool-workers threads; the appended tokens are each completion's context mask (pack.Answer.context);
- the loss: pack.py puts context tokens in neither the thought nor an answer, so every mask, weight, ratio, KL,
  entropy and the sampler/trainer log-prob gap is over the policy's own tokens only;
- a call: the environment reads the policy's current turn only (the text since the last observation), and anything
  it raises becomes an error observation, counted in tool/errors: no completion can end the run (`tool_rollouts`);
- metrics: tool/calls, calls_per_completion, errors, error_rate, time_s, wait_s, turns, env_reward per step
  (docs/runs.md defines each); the same rollouts evaluate (heldout.py).
Budget: a completion (sampled and appended tokens) has --max-thought-tokens + --max-answer-tokens tokens. Refused:
GRPO-MA's answers (--answers > 1) fork after a thought, which a tool call would have to cross.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, fields

from cli import FlagError, UserError, flag, out_of_range
from distributed import all_sum
from envs import ENV_FAILED, ENVS, PythonTool, run_code
from multiturn import sample_turns
from sampler import Generation, Tree
from sandbox import CODE_FILE_MB
from stop_text import stop_text_for
from tasks import render_prompt


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- rollouts
    tools: str = "off"  # environment a completion talks to mid-way: off | python (a sandboxed tool) | countdown
    tool_format: str = "torl"  # python tool's call form: torl (```python ... ``` then ```output) | qwen (<tool_call>)
    max_tool_calls: int = 4  # calls per completion; a call past it ends the completion
    tool_timeout_s: float = 5.0  # CPU time limit of one call (s); its wall clock gets a margin (envs.wall_limit)
    tool_memory_mb: int = 512  # address-space limit of one call's processes (MiB)
    tool_output_chars: int = 256  # a call's output past this keeps its head and tail, a marker between
    tool_workers: int = 4  # calls run in parallel (each is a sandboxed subprocess)


CHOICES = dict(tools=("off", *ENVS), tool_format=("torl", "qwen"))

# Values a call can run under: a CPU limit the sandbox can enforce (it reads the run's CPU every 0.05 s) and the
# rlimits can hold, an address space an interpreter starts in, an output the sandbox's file (CODE_FILE_MB) holds.
RANGES = dict(max_tool_calls=">= 1", tool_workers=">= 1", tool_timeout_s="[0.25, 3600]")
RANGES |= dict(tool_memory_mb=f"[64, {1 << 20}]", tool_output_chars=f"[16, {CODE_FILE_MB << 20}]")


def check_flags(cfg) -> Iterator[FlagError]:
    """The tool flags' own checks, which train.py and eval.py both run: each a choice or in its range, and the
    environment one that serves --task."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            yield FlagError((name,), f"must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    yield from out_of_range(cfg, RANGES)
    tasks = getattr(ENVS.get(cfg.tools), "tasks", None)
    if tasks is not None and cfg.task not in tasks:
        why = f"gives feedback on {' and '.join(tasks)} only: it needs --task {tasks[0]}, got --task {cfg.task}"
        yield FlagError(("tools",), why, ("task",), f"--tools {cfg.tools}")


def check(cfg) -> Iterator[FlagError]:
    yield from check_flags(cfg)
    if cfg.tools != "off" and cfg.answers > 1:
        why = "pauses completions for a tool, and GRPO-MA's answers fork from a finished thought: it needs --answers 1"
        yield FlagError(("tools",), why, ("answers",), f"--tools {cfg.tools}")


def enabled(cfg) -> bool:
    return cfg.tools != "off"


def start(run) -> None:
    ready(run.cfg, run.tokenizer)


def ready(cfg, tokenizer) -> None:
    """Before the first call (train.py and eval.py): the tokenizer can write the call's end marker, or the tool is
    never called; --tools python: print(1) runs in the sandbox under the tool's flags, so a machine that cannot build
    it (no namespaces, no seccomp library) or limits that fail every call are one sentence now, not a failed run."""
    if cfg.tools == "off":
        return
    stop = make_env(cfg, tokenizer).stop
    if tokenizer.decode(tokenizer.encode(stop)) != stop:
        how = f"--tool-format {cfg.tool_format}" if cfg.tools == "python" else f"--tools {cfg.tools}"
        raise UserError(f"{how} ends a call at {stop!r}, which this model's tokenizer cannot write: pick another")
    if cfg.tools == "python":
        try:
            out, failed = run_code("print(1)", cfg.tool_timeout_s, cfg.tool_memory_mb, 64)
        except RuntimeError as e:
            raise UserError(f"--tools python runs code in the sandbox, which this machine refuses: {e}") from None
        if failed or out != "1":
            limits = f"--tool-timeout-s {cfg.tool_timeout_s} --tool-memory-mb {cfg.tool_memory_mb}"
            raise UserError(f"--tools python: print(1) fails in the sandbox under {limits} ({out}): raise them")


def eval_flags(cfg) -> str:
    """The end summary's eval.py command evaluates with the tool and its limits, as the run trained (without the
    tool a model trained with it still writes its calls, and scores nothing)."""
    changed = {f.name: getattr(cfg, f.name) for f in fields(Flags) if getattr(cfg, f.name) != f.default}
    return "".join(f"{flag(name)} {value} " for name, value in changed.items())


def make_env(cfg, tokenizer):
    """A fresh environment of --tools for one completion. --tool-format qwen follows the tokenizer's chat template:
    its observation opens the next assistant turn as the template does (Tokenizer.turn_opening), and its error
    message shows the call in the template's syntax (XML for Qwen3.5/3.6, JSON for the others)."""
    if cfg.tools == "python":
        limits = (cfg.tool_timeout_s, cfg.tool_memory_mb, cfg.tool_output_chars, cfg.tool_workers)
        return PythonTool(cfg.tool_format, *limits, tokenizer.turn_opening(), tokenizer.style == "qwen3.5")
    return ENVS[cfg.tools]()


@dataclass
class ToolTree(Tree):
    """sampler.Tree of plain group sampling (empty thoughts) plus each answer's context mask."""

    answer_context: list[list[bool]] | None = None


@dataclass
class ToolGeneration(Generation):
    """sampler.Generation plus each completion's context mask: what heldout.evaluate reads of a tool rollout."""

    context: list[list[bool]] | None = None


def tool_rollouts(model, tokenizer, task, examples: list[dict], cfg, *, n: int, max_new_tokens: int, **sampling):
    """n multi-turn completions per example, each with its own environment: (prompts, sample_turns' Turns, the
    stats of the calls). sampling: temperature, top_p, seed, static_step (and top_k)."""
    envs = [make_env(cfg, tokenizer) for _ in range(len(examples) * n)]
    opening = [env.reset(examples[i // n]) for i, env in enumerate(envs)]  # an example's first row's is its prompt
    prompts = [
        render_prompt(tokenizer, {**ex, "prompt": o}, task.system_prompt) for ex, o in zip(examples, opening[::n])
    ]
    env_reward, calls, errors, turn = [0.0] * len(envs), [0] * len(envs), [0] * len(envs), [0] * len(envs)

    def respond(row: int, ids: list[int]) -> list[int] | None:
        """One call: the policy's current turn (ids[turn[row]:]) in, the observation's ids out; whatever the
        environment raises is an error observation. Counted: every call, and each that failed once."""
        env, before, failed = envs[row], envs[row].errors, False
        calls[row] += 1
        try:
            obs, env_reward[row], done = env.step(tokenizer.decode(ids[turn[row] :]))
            obs_ids = None if done or obs is None else tokenizer.encode(obs)
        except Exception as e:  # noqa: BLE001 -- the guarantee: nothing a completion holds raises out of a rollout
            obs_ids, failed = tokenizer.encode(ENV_FAILED.format(type(e).__name__)), True
        errors[row] += failed or env.errors != before
        if obs_ids is not None:
            turn[row] = len(ids) + len(obs_ids)  # the policy's next turn starts after this observation
        return obs_ids

    kw = dict(max_calls=cfg.max_tool_calls, workers=cfg.tool_workers, stop_ids=tokenizer.stop_ids, respond=respond)
    end = stop_text_for(tokenizer, envs[0].stop)  # one marker for every row: the environments are of one kind
    turns = sample_turns(model, prompts, n=n, max_tokens=max_new_tokens, call_end=end, **kw, **sampling)
    stats = dict(calls=sum(calls), errors=sum(errors), time_s=sum(e.seconds for e in envs))
    stats |= dict(completions=len(envs), env_reward=sum(env_reward), turns=len(turns.wait_s), wait_s=sum(turns.wait_s))
    return prompts, turns, stats


def sample(run, examples: list[dict], seeds: list[int]):
    """1. sample with the tool: K completions per prompt as a ToolTree (the sampler's plain group layout)."""
    cfg = run.cfg
    kw = dict(n=cfg.thoughts, max_new_tokens=cfg.completion_limit, temperature=cfg.temperature, top_k=cfg.top_k)
    kw |= dict(top_p=cfg.top_p, seed=seeds, static_step=run.static_step)
    prompts, turns, stats = tool_rollouts(run.sampler, run.tokenizer, run.task, examples, cfg, **kw)
    run.state.setdefault("tool_step", Counter()).update(stats)  # the step's, redraws included
    empty = [[] for _ in turns.tokens]
    return prompts, ToolTree(
        empty, empty, [False] * len(empty), turns.tokens, turns.logprobs, turns.finish, turns.context
    )


def metrics(run, sums: dict, counts: dict) -> dict:
    """The step's tool/... entries (global over ranks), from what sample() counted this step; tool/wait_s is the
    rows' wait for the calls at the turns' sync points."""
    t = dict.fromkeys(("calls", "completions", "errors", "time_s", "wait_s", "turns", "env_reward"), 0.0)
    t |= {k: all_sum(float(v), run.world).item() for k, v in run.state.pop("tool_step", {}).items()}
    calls, errors, n = t["calls"], t["errors"], max(t["completions"], 1.0)
    row = {"tool/calls": calls, "tool/calls_per_completion": calls / n, "tool/errors": errors}
    row |= {"tool/error_rate": errors / max(calls, 1.0), "tool/time_s": t["time_s"], "tool/wait_s": t["wait_s"]}
    return row | {"tool/turns": t["turns"] / run.world, "tool/env_reward": t["env_reward"] / n}


def evaluator(cfg, tokenizer, task):
    """heldout.evaluate's rollout with the tool (the same multi-turn sampling as training), or None when off."""
    if cfg.tools == "off":
        return None

    def rollout(model, examples: list[dict], *, n: int, max_new_tokens: int, stop_ids=(), **sampling) -> Generation:
        turns = tool_rollouts(model, tokenizer, task, examples, cfg, n=n, max_new_tokens=max_new_tokens, **sampling)[1]
        return ToolGeneration(turns.tokens, turns.logprobs, turns.finish, turns.context)

    return rollout
