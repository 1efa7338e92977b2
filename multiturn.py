"""Multi-turn sampling: a completion that pauses for an observation (a tool's output, an environment's feedback) and
goes on. Built on the sampler's primitives (kvcache.py's prefill, fork and extend; sampler.decode with a StopText),
knowing nothing of tools or tasks: a callback maps a row's completion so far to the observation's token ids.

One turn, for every row still sampling, all rows at one sync point:
  1. decode until the row ends (a stop id, its token budget) or its text contains the call's end marker
     (`call_end`, e.g. "```output" or "</tool_call>": a StopText);
  2. the rows that stopped on the marker call `respond(row, completion_ids)` in a thread pool (each call is a
     sandboxed subprocess: they run in parallel); it returns the observation's ids, or None to end the row;
  3. the rows that go on are forked into a cache of their own (the others' rows are dropped), and their
     last sampled token (decode does not feed it) and the observation's ids are appended with one `extend`:
     an append to the row's keys and values, never a prefill of the whole row again.
Token in, token out: a completion's ids are exactly the ids sampled and appended, in order; nothing is decoded and
re-encoded (verl issue 6719: a separator dropped at every assistant-to-tool boundary when the conversation is
re-tokenized). `context[i][t]` is True for the appended tokens: the trainer gives them no loss (pack.py).

Decisions (deliberate simplifications):
* All rows wait at one sync point per turn (simple; the decode of a turn runs to its longest row). The other
  choice, decoding the rows that are not waiting while calls run, needs a decode loop that admits rows mid-way.
* Budget: `max_tokens` counts every token of a completion, sampled and appended. An observation that would leave
  no room for one more sampled token ends the row ("length"), as does a call past `max_calls`.
* Seeds: row r draws its uniforms from its prompt's seed, one per token position of the completion (appended
  tokens skip theirs), so a row's samples do not depend on its batch, its turns or other rows' calls. With no
  call in a row, its tokens are those of sampler.generate with the same seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvcache import extend, prefill
from model import Transformer
from sampler import _check, decode
from stop_text import StopText


@dataclass
class Turns:
    """Every completion of a multi-turn sampling, prompt-major (prompt i's samples at i*n .. i*n+n-1)."""

    tokens: list[list[int]]  # sampled and appended ids, in order; the stop id included when hit
    logprobs: list[list[float]]  # per token: the sampler's log-prob of a sampled token, 0.0 for an appended one
    context: list[list[bool]]  # per token: True = appended (an observation), not written by the policy
    finish: list[str]  # "stop" | "length"
    calls: list[int]  # observations appended to each row
    decode_s: list[float]  # each turn's decode (s)
    wait_s: list[float]  # each turn's calls, the wall time every row waits at the sync point (s)


Respond = Callable[[int, list[int]], "list[int] | None"]  # (row, its completion ids so far) -> observation ids


@torch.inference_mode()
def sample_turns(
    model: Transformer,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    call_end: StopText,
    respond: Respond,
    max_calls: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    seed: int | Sequence[int] | None = None,
    workers: int = 4,
    static_step: Callable | None = None,
) -> Turns:
    """n completions of at most max_tokens tokens (sampled and appended) per prompt, each pausing where its text
    reaches call_end.text for `respond`'s observation, at most max_calls times."""
    seeds = _check(model, prompts, max_tokens, temperature, top_k, top_p, seed, "sample_turns")
    B = len(prompts) * n
    u = torch.cat([torch.rand(n, max_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds])
    cache, logits = prefill(model, prompts)
    dev = logits.device
    rows = torch.arange(len(prompts), device=dev).repeat_interleave(n)
    cache, logits = cache.fork(rows, cache.length + max_tokens), logits[rows]
    tokens, logprobs, context = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    finish, calls, decode_s, wait_s = ["length"] * B, [0] * B, [], []
    live = list(range(B))  # caller row of each cache row
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids, static_step=static_step)
    stops = set(stop_ids)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        while live:
            t0 = time.perf_counter()
            # 1. decode every live row to its stop, its budget or the call's end marker
            used = [len(tokens[r]) for r in live]
            steps = max(max_tokens - k for k in used)
            uniforms = torch.zeros(len(live), steps)
            for i, (r, k) in enumerate(zip(live, used)):
                uniforms[i, : max_tokens - k] = u[r, k:]
            out = decode(model, cache, logits, uniforms.to(dev), steps, stop_text=call_end, **sampling)
            cache.restore_order()
            t1 = time.perf_counter()
            decode_s.append(t1 - t0)
            waiting = []  # (cache row, caller row) of the rows whose call runs now
            for i, (r, k, ids, lps, n_tok, stopped) in enumerate(
                zip(live, used, out.tokens.tolist(), out.logp.tolist(), out.n_tokens.tolist(), out.stopped.tolist())
            ):
                m = min(n_tok, max_tokens - k)  # a row with less budget than the turn's longest is cut to its own
                tokens[r] += ids[:m]
                logprobs[r] += lps[:m]
                context[r] += [False] * m
                if stopped and m == n_tok and ids[m - 1] in stops:
                    finish[r] = "stop"
                elif stopped and m == n_tok and calls[r] < max_calls and len(tokens[r]) < max_tokens:
                    waiting.append((i, r))
            # 2. the calls, in parallel: each maps the row's completion so far to an observation's ids
            observations = list(pool.map(lambda w: respond(w[1], list(tokens[w[1]])), waiting))
            wait_s.append(time.perf_counter() - t1)
            go = [(i, r, obs) for (i, r), obs in zip(waiting, observations) if obs is not None]
            for (_, r), obs in zip(waiting, observations):
                if obs is None:
                    finish[r] = "stop"  # the environment ended the episode
            go = [(i, r, obs) for i, r, obs in go if len(tokens[r]) + len(obs) < max_tokens]  # else: "length"
            if not go:
                break
            # 3. a cache of the rows that go on; append each one's last sampled token and its observation
            W = 1 + max(len(obs) for _, _, obs in go)
            left = max(max_tokens - len(tokens[r]) - len(obs) for _, r, obs in go)
            cache = cache.fork(torch.tensor([i for i, _, _ in go], device=dev), cache.length + W + left)
            chunk = torch.zeros(len(go), W, dtype=torch.long)
            valid = torch.zeros(len(go), W, dtype=torch.bool)
            for j, (_, r, obs) in enumerate(go):  # left-padded: every row's last slot is its observation's end
                chunk[j, W - 1 - len(obs) :] = torch.tensor([tokens[r][-1], *obs])
                valid[j, W - 1 - len(obs) :] = True
                tokens[r] += obs
                logprobs[r] += [0.0] * len(obs)
                context[r] += [True] * len(obs)
                calls[r] += 1
            logits = extend(model, cache, chunk.to(dev), valid.to(dev))[:, -1]
            live = [r for _, r, _ in go]
    return Turns(tokens, logprobs, context, finish, calls, decode_s, wait_s)
