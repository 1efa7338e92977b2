"""Sampling from the policy over a KV cache (kvcache.py: the cache and the prefill/extend/decode steps):
temperature / top-k / top-p / greedy sampling with per-prompt seeds, prefix-shared tree sampling (K thoughts x M
answers) and the per-token log-probs of every returned token. Knows nothing about tasks or rewards.

One mechanism handles padding, finished rows and forks :
* every row writes its next token into the same cache slot ("lockstep"); RoPE positions are
  explicit per row and `key_valid` (B, S) says which slots hold real tokens. Prompts of different
  lengths are left-padded (pad slots invalid), and a finished row's slots are invalid from then
  on. Attention only sees valid keys and RoPE only relative positions, so holes are harmless.
* each distinct prompt is prefilled once; its cache rows are then copied n ways (`fork`).
* finished rows stop costing compute: once half of the active rows are done, the rows are
  reordered live-first and the forward runs on that prefix only (`KVCache.compact`). Finished
  rows keep their cache after the active ones, which tree sampling needs for the answers.

Decisions (deliberate simplifications):
* Seeds: prompt p's random draws come only from a CPU torch.Generator seeded with seed[p]: one
  uniform per row and step, drawn up front, turned into a token by inverse-CDF sampling (on GPU in two
  levels, block then token, instead of a scan of the whole vocabulary: draw_in_blocks). So a
  prompt's samples do not depend on which prompts share its batch (up to float rounding of
  batch-shape-dependent kernels). A single int seed draws the per-prompt seeds from Generator(seed).
* Thought stop rule: only the end-of-thought marker and max_thought_tokens end a thought; stop ids
  are not checked in the thought phase. The marker is either token ids (the thought ends once its
  tokens end with them: exact, for a vocabulary where `</think>` is one added token) or a
  `StopText`: the thought ends at the token where its decoded text first contains the marker text,
  however the tokens spell it (Qwen2.5 writes "</think>\n" as [522, 26865, 397]), the way inference
  engines match stop strings; text after the marker inside that last token stays in the thought.
  A thought cut off at the limit gets the whole marker's ids appended (even if it ended in part of
  it); the forced tokens' log-probs are the model's, under temperature but without top-k/top-p
  truncation, so every token has a finite log-prob.
* Text matching costs nothing per step for most rows: only tokens whose own text holds the
  marker's last character (a bool over the vocabulary, built once) can complete it, and only for
  those is the tail of the row decoded. It runs where the loop already looks at the host (every
  step on CPU, every SYNC_EVERY steps on GPU); a row found there to have finished a few steps
  earlier is cut back: its later tokens are dropped and their cache slots become holes.
* No marker (end_of_thought=()) or max_thought_tokens=0 is plain group sampling: empty thoughts,
  each answer a whole completion of at most max_answer_tokens.
* Greedy (temperature 0) reports temperature-1 log-probs (the point mass it samples from has 0).
* The static path is the caller's choice: decode takes `static_step`, a graphs.StaticDecode (train.py and
  eval.py pass one by default on CUDA: CUDA graphs per batch and span bucket over static buffers, and the token
  draw compiled; --compile compiles its step first). Finished rows then move the batch to a smaller power of
  two, never to any size.
  The same code runs eagerly on CPU, where tests check it samples what the eager path does;
  bench/gpu_check.sh measures the CUDA graphs on a GPU.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from graphs import StaticDecode, batch_bucket, compiled
from kvcache import KVCache, chunk_mask, decode_step, decode_step_static, extend, prefill  # noqa: F401  (still sampler.X)
from logprobs import token_logprobs
from model import Transformer
from stop_text import StopText, TextWatch, text_hits, watch_text

COMPACT_WHEN_DONE = 0.5  # compact the batch once this fraction of the active rows has finished
SYNC_EVERY = 8  # on GPU, look at the done flags (a host sync) only every this many steps
DRAW_BLOCK = 1024  # on GPU, a token is drawn from its block of this many (draw_in_blocks), not a scan of all V


@dataclass
class Generation:
    tokens: list[list[int]]  # prompt-major: prompt i's samples at i*n .. i*n+n-1; stop token included when hit
    logprobs: list[list[float]]  # per sampled token, under the distribution sampled from
    finish: list[str]  # "stop" | "length"


@dataclass
class Tree:
    thoughts: list[list[int]]  # P*K, prompt p's thought i at p*K+i; ends with the marker ids
    thought_logprobs: list[list[float]]  # forced (appended) marker tokens: the model's log-prob of them
    thought_truncated: list[bool]  # True when the marker was appended by the sampler
    answers: list[list[int]]  # P*K*M, (p, i, j) at (p*K+i)*M+j; stop id included when hit
    answer_logprobs: list[list[float]]
    answer_finish: list[str]  # "stop" | "length"


# ----------------------------------------------------------------------------- sampling


def truncate(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """float logits (b, V) with -inf outside the top-k set, then outside the top-p nucleus of
    softmax(logits / temperature): the smallest set of most likely tokens with mass >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits / temperature, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens; the first is always kept
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(before >= top_p, float("-inf")))
    return logits


def sample_next(
    logits: Tensor, u: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """logits (b, V), u (b,) uniforms in [0, 1) -> tokens (b,) and their float32 log-probs under the
    distribution sampled from (temperature -> top-k -> top-p), by inverse-CDF sampling. Compiled (graphs.compiled,
    dynamic shapes) it compiles once per branch taken here (greedy, truncation or not), not per value: a float
    argument is a symbol to dynamo (specialize_float=False, the default of the torch pinned here), so each
    temperature, top-k and top-p reuses the same code, and every batch size but 1 (decode draws one row eagerly)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, token_logprobs(logits, tok)
    x = logits.float()
    if top_k > 0 or top_p < 1.0:
        x = truncate(x, temperature, top_k, top_p)
    x = x / temperature  # also at 1 (x / 1 is x): a branch on it would be a second compile of the compiled draw
    # one exp pass serves the sample and its log-prob: p = e / sum(e) with e = exp(x - max x)
    mx = x.amax(-1, keepdim=True)
    e = (x - mx).exp_()
    tok = draw_in_blocks(e, u) if e.is_cuda else draw(e, u)
    logp = x.gather(-1, tok[:, None])[:, 0] - mx[:, 0] - e.sum(-1).log()  # = log_softmax(x)[tok]
    return tok, logp


def draw(e: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: e (b, V) unnormalised probabilities, u (b,) in [0, 1) -> the first token (b,) whose
    cumulative mass exceeds u * total. A scan over the whole vocabulary: the CPU's (the reference's) draw."""
    cdf = e.cumsum(-1)  # unnormalised
    total = cdf[:, -1:]
    # pick < total strictly, so zero-probability tokens never win
    pick = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # a row of non-finite logits has a NaN cdf, where searchsorted answers V: clamped, its log-prob is NaN,
    # which decode refuses (check_finite)
    return torch.searchsorted(cdf, pick, right=True)[:, 0].clamp_(max=e.shape[-1] - 1)


def draw_in_blocks(e: Tensor, u: Tensor, block: int = DRAW_BLOCK) -> Tensor:
    """draw() in two levels, the GPU's: the block of `block` tokens where u * total falls (a scan over the block
    sums), then the token within that block (a scan over one block). The same uniform decides it (samples
    depend only on the prompt's seed); only float rounding at a boundary can pick a neighbour of draw()'s token.
    Never a zero-probability token: the pick is kept inside the chosen block's positive mass."""
    b, V = e.shape
    n = V // block
    sums = e[:, : n * block].view(b, n, block).sum(-1)  # (b, n) full blocks, then the remainder
    sums = torch.cat([sums, e[:, n * block :].sum(-1, keepdim=True)], 1) if V % block else sums
    cdf = sums.cumsum(-1)
    total = cdf[:, -1:]
    pick = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    blk = torch.searchsorted(cdf, pick, right=True).clamp_(max=len(sums[0]) - 1)  # (b, 1)
    idx = blk * block + torch.arange(block, device=e.device)  # (b, block) the block's token ids
    inner = (e.gather(1, idx.clamp(max=V - 1)) * (idx < V)).cumsum(-1)  # the block's own cdf
    last = inner[:, -1:]
    rest = (pick - (cdf.gather(1, blk) - sums.gather(1, blk))).clamp(min=0)  # u * total minus earlier blocks
    rest = torch.minimum(rest, torch.nextafter(last, torch.zeros_like(last)))
    return idx.gather(1, torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1))[:, 0]


def host_sync_every(device: torch.device) -> int:
    """Decode steps between looks at the host (done flags, text markers): every step on CPU, where a
    host sync costs nothing; SYNC_EVERY on GPU."""
    return 1 if device.type == "cpu" else SYNC_EVERY


@dataclass
class Samples:
    """What decode has sampled so far, in the caller's row order."""

    tokens: Tensor  # (B, max_steps) long
    logp: Tensor  # (B, max_steps) float32, under the distribution sampled from
    n_tokens: Tensor  # (B,) tokens that count: max_steps until the row ends
    stopped: Tensor  # (B,) bool: ended by a stop id or the marker

    @classmethod
    def empty(cls, B: int, max_steps: int, device: torch.device) -> "Samples":
        return cls(
            torch.zeros(B, max_steps, dtype=torch.long, device=device),
            torch.zeros(B, max_steps, device=device),
            torch.full((B,), max_steps, device=device),
            torch.zeros(B, dtype=torch.bool, device=device),
        )


def end_on_ids(out: Samples, t: int, rows: Tensor, tok: Tensor, alive: Tensor, stop: Tensor, mark: Tensor) -> Tensor:
    """Active rows whose token t is a stop id, or whose tokens now end with the marker, end after
    t + 1 tokens; returns the new alive (per active cache row)."""
    hit = torch.isin(tok, stop)
    if len(mark) and t + 1 >= len(mark):
        hit |= (out.tokens[rows, t + 1 - len(mark) : t + 1] == mark).all(-1)
    ended = alive & hit
    out.n_tokens[rows] = torch.where(ended, t + 1, out.n_tokens[rows])
    out.stopped[rows] = out.stopped[rows] | ended
    return alive & ~hit


def end_on_text(watch: TextWatch, out: Samples, cache: KVCache, alive: Tensor, steps: int) -> None:
    """End the rows whose text first contains the marker within the steps since the last check.
    On GPU the marker may be found a few steps late, after the row's later tokens were fed to the
    cache: their slots become holes and the row's position is rewound (a no-op on CPU)."""
    rows_hit, steps_hit = text_hits(watch.stop, watch.can_end, out.tokens, out.n_tokens, watch.checked, steps)
    watch.checked = steps
    if not rows_hit:
        return
    dev = out.tokens.device
    r, s = torch.tensor(rows_hit, device=dev), torch.tensor(steps_hit, device=dev)
    out.n_tokens[r] = torch.minimum(out.n_tokens[r], s + 1)
    out.stopped[r] = True
    c = torch.argsort(cache.rows)[r]  # cache row of each caller row
    fed = torch.arange(watch.start_slot, cache.length, device=dev)
    cache.key_valid[c, watch.start_slot : cache.length] &= fed[None] < (watch.start_slot + s)[:, None]
    cache.next_pos[c] = watch.start_pos[r] + s
    alive[c[c < cache.batch]] = False


def compact_finished(cache: KVCache, tok: Tensor, alive: Tensor, buckets: bool = False) -> tuple[Tensor, Tensor]:
    """Once enough active rows have finished, move the live ones first and run only those: once
    COMPACT_WHEN_DONE of them are done, or with buckets (the static path) once the live rows fit a smaller
    power of two (the graphs' batch buckets: no new shape)."""
    live = int(alive.sum())
    keep = batch_bucket(live) >= batch_bucket(cache.batch) if buckets else live > (1 - COMPACT_WHEN_DONE) * cache.batch
    if keep:
        return tok, alive
    perm = cache.compact(alive)[:live]
    return tok[perm], alive[perm]


def next_logits(
    model: Transformer, cache: KVCache, tok: Tensor, alive: Tensor, static_step: StaticDecode | None
) -> Tensor:
    """Feed tok to the cache: through decode_step, or through static_step (static shapes, replayed as
    CUDA graphs on a GPU) and then advance the tensor slot it writes at."""
    if static_step is None:
        return decode_step(model, cache, tok, alive)
    logits = static_step(model, cache, tok, alive)
    cache.slot += 1
    cache.length += 1
    return logits


def decode(
    model: Transformer,
    cache: KVCache,
    logits: Tensor,
    uniforms: Tensor,
    max_steps: int,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_ids: Sequence[int] = (),
    marker: Sequence[int] = (),
    stop_text: StopText | None = None,
    static_step: StaticDecode | Callable | None = None,
) -> Samples:
    """Sample up to max_steps tokens for every cache row, starting from `logits` (B, V) of each row's
    next token; a row ends on a stop id, once its tokens end with `marker`, or once their text
    contains stop_text.text. The last sampled token is not fed to the cache.

    static_step: None feeds each token through decode_step (rows compacted as they finish); else a
    graphs.StaticDecode (static buffers, batch buckets, CUDA graphs when it captures), which adopts the
    cache: from then on its tensors are views of the static buffers (power-of-two rows and slots), and
    extend and a later decode work on it as before. A bare function like decode_step_static is run by an
    eager StaticDecode."""
    dev = logits.device
    out = Samples.empty(cache.batch, max_steps, dev)
    alive = torch.ones(cache.batch, dtype=torch.bool, device=dev)  # per active cache row
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
    mark = torch.tensor(list(marker), dtype=torch.long, device=dev)
    watch = watch_text(stop_text, logits.shape[-1], cache) if stop_text is not None else None
    sync_every = host_sync_every(dev)
    if watch is not None and cache.conv is not None:  # a DeltaNet state cannot be cut back: find the marker at once
        sync_every = 1
    draw_next = sample_next
    if static_step is not None:
        static_step = static_step if isinstance(static_step, StaticDecode) else StaticDecode(static_step)
        if not static_step.adopt(cache):  # its buffers could not be made: the eager path (graphs.py said why)
            static_step = None
    if static_step is not None:
        draw_next = compiled(sample_next, "the compiled draw") if static_step.compiled_draw else sample_next
    # Outside the captured step, each step runs ~20-30 small launches (copies in, the draw, the stop checks) and
    # the compiled draw's guards: host-bound work of ~0.1-0.3 ms, left out of the graph (graphs.py's docstring);
    # the host waits on the GPU only every sync_every steps.
    for t in range(max_steps):
        rows = cache.rows[: cache.batch]  # caller's row ids of the active rows
        # one row draws eagerly: dynamo specializes size 1, a compile of its own for a draw that costs nothing
        draw = draw_next if len(rows) > 1 else sample_next
        tok, lp = draw(logits, uniforms[rows, t], temperature, top_k, top_p)
        out.tokens[rows, t], out.logp[rows, t] = tok, lp
        alive = end_on_ids(out, t, rows, tok, alive, stop, mark)
        last, sync = t + 1 == max_steps, (t + 1) % sync_every == 0
        if watch is not None and (sync or last):
            end_on_text(watch, out, cache, alive, t + 1)
        if last or (sync and not alive.any()):
            break
        if sync:
            tok, alive = compact_finished(cache, tok, alive, buckets=static_step is not None)
        logits = next_logits(model, cache, tok, alive, static_step)
    cache.slot = None
    check_finite(out.logp, out.n_tokens, logits.dtype)
    return out


def check_finite(logp: Tensor, n_tokens: Tensor, dtype: torch.dtype) -> None:
    """Refuse samples drawn from non-finite logits (NaN or inf: their log-probs are NaN), in one sentence
    instead of garbage tokens. logp (B, steps), n_tokens (B,); one host sync per decode call."""
    bad = ~torch.isfinite(logp) & (torch.arange(logp.shape[1], device=logp.device) < n_tokens[:, None])
    if bad.any():
        rows = int(bad.any(1).sum())
        raise ValueError(
            f"sampling: the model's next-token logits are not finite (NaN or inf) in {rows} of {len(logp)} rows: "
            f"its weights hold NaN or inf, or are so large that the forward overflows in {str(dtype)[6:]}"
        )


# ----------------------------------------------------------------------------- public API


def _check(
    model: Transformer,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | Sequence[int] | None,
    fn: str,
) -> list[int]:
    """Validate the arguments a user controls; returns one seed per prompt."""
    if not prompts:
        raise ValueError(f"{fn}: prompts is empty; pass at least one prompt (a list of token ids).")
    ctx, V = model.config.max_position_embeddings, model.config.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"{fn}: prompt {i} has no tokens; every prompt needs at least one token.")
        if len(p) + new_tokens > ctx:
            raise ValueError(
                f"{fn}: prompt {i} ({len(p)} tokens) plus {new_tokens} new tokens exceeds the "
                f"model's context of {ctx} (config max_position_embeddings)."
            )
        if min(p) < 0 or max(p) >= V:
            raise ValueError(f"{fn}: prompt {i} has a token id outside the vocabulary [0, {V}).")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"{fn}: need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}."
        )
    if seed is None:  # fresh randomness from torch's global generator (so torch.manual_seed applies)
        return torch.randint(2**62, (len(prompts),)).tolist()
    if isinstance(seed, int):
        return torch.randint(2**62, (len(prompts),), generator=torch.Generator().manual_seed(seed)).tolist()
    if len(seed) != len(prompts):
        raise ValueError(f"{fn}: got {len(seed)} seeds for {len(prompts)} prompts; pass one int or one per prompt.")
    return [int(s) for s in seed]


def _finish(out: Samples) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Per row: its tokens, their log-probs and "stop" | "length", as Python lists."""
    tokens, logp, n_tokens = out.tokens.tolist(), out.logp.tolist(), out.n_tokens.tolist()
    finish = ["stop" if s else "length" for s in out.stopped.tolist()]
    return [t[:n] for t, n in zip(tokens, n_tokens)], [lp[:n] for lp, n in zip(logp, n_tokens)], finish


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    n: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    seed: int | Sequence[int] | None = None,
    static_step: StaticDecode | Callable | None = None,
) -> Generation:
    """n samples of at most max_new_tokens for each prompt (token ids), prompt-major. static_step:
    see decode (e.g. graphs.decode_runner(device): CUDA graphs on a GPU)."""
    if max_new_tokens < 1 or n < 1:
        raise ValueError(f"generate: max_new_tokens and n must be >= 1, got {max_new_tokens} and {n}.")
    seeds = _check(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, "generate")
    cache, logits = prefill(model, prompts)
    rows = torch.arange(len(prompts), device=logits.device).repeat_interleave(n)
    cache, logits = cache.fork(rows, cache.length + max_new_tokens), logits[rows]
    u = torch.cat([torch.rand(n, max_new_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds])
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, static_step=static_step)
    out = decode(model, cache, logits, u.to(logits.device), max_new_tokens, stop_ids=stop_ids, **sampling)
    return Generation(*_finish(out))


@torch.inference_mode()
def sample_tree(
    model: Transformer,
    prompts: list[list[int]],
    *,
    k: int,
    m: int,
    max_thought_tokens: int,
    max_answer_tokens: int,
    end_of_thought: Sequence[int] | StopText = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    seed: int | Sequence[int] | None = None,
    static_step: StaticDecode | Callable | None = None,
) -> Tree:
    """K thoughts per prompt, each ended by the end_of_thought marker (appended if cut off), then M
    answers from each thought; the prompt and each thought are computed once and shared. The
    marker is token ids (matched exactly) or a StopText (matched on the decoded text)."""
    P, K, M = len(prompts), k, m
    if K < 1 or M < 1 or max_answer_tokens < 1 or max_thought_tokens < 0:
        raise ValueError(
            f"sample_tree: need k, m, max_answer_tokens >= 1 and max_thought_tokens >= 0, "
            f"got {k}, {m}, {max_answer_tokens}, {max_thought_tokens}."
        )
    text = end_of_thought if isinstance(end_of_thought, StopText) else None
    marker = list(text.ids if text else end_of_thought)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, static_step=static_step)
    if not marker or max_thought_tokens == 0:  # no thought phase: plain group sampling, G = K*M
        g = generate(
            model, prompts, max_new_tokens=max_answer_tokens, n=K * M, stop_ids=stop_ids, seed=seed, **sampling
        )
        return Tree(
            [[] for _ in range(P * K)], [[] for _ in range(P * K)], [False] * (P * K), g.tokens, g.logprobs, g.finish
        )
    Lm, Tt, Ta = len(marker), max_thought_tokens, max_answer_tokens
    seeds = _check(model, prompts, Tt + Lm + Ta, temperature, top_k, top_p, seed, "sample_tree")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    u_thought = torch.cat([torch.rand(K, Tt, generator=g) for g in gens])  # per prompt: thoughts first,
    u_answer = torch.cat([torch.rand(K * M, Ta, generator=g) for g in gens])  # then answers

    # 1. prefill each prompt once, fork it K ways, decode the thoughts (marker or length ends them)
    cache, logits = prefill(model, prompts)
    rows = torch.arange(P, device=logits.device).repeat_interleave(K)
    cache, logits = cache.fork(rows, cache.length + Tt + Lm), logits[rows]
    ends = dict(stop_text=text) if text else dict(marker=marker)
    th = decode(model, cache, logits, u_thought.to(logits.device), Tt, **ends, **sampling)
    ended = th.stopped

    # 2. one chunk per thought: its last token, preceded by the forced marker if it was cut off
    # (left-padded to Lm + 1 where the thought ended on its own); logits give the marker log-probs
    cache.restore_order()
    last = th.tokens.gather(1, (th.n_tokens - 1)[:, None])  # (PK, 1)
    mark = torch.tensor(marker, device=last.device).expand(P * K, Lm)
    chunk = torch.where(ended[:, None], torch.cat([mark, last], 1), torch.cat([last, mark], 1))
    valid = torch.ones_like(chunk, dtype=torch.bool)
    valid[:, :Lm] = ~ended[:, None]
    logits = extend(model, cache, chunk, valid, logits_to_keep=Lm + 1)  # (PK, Lm + 1, V)
    forced_lp = token_logprobs(logits[:, :Lm], mark, temperature or 1.0)  # (PK, Lm)

    # 3. fork each thought M ways and decode the answers
    rows = torch.arange(P * K, device=last.device).repeat_interleave(M)
    cache, logits = cache.fork(rows, cache.length + Ta), logits[rows, -1]
    ans = decode(model, cache, logits, u_answer.to(logits.device), Ta, stop_ids=stop_ids, **sampling)

    thoughts, thought_lp, _ = _finish(th)
    for i, cut in enumerate((~ended).tolist()):
        if cut:
            thoughts[i] += marker
            thought_lp[i] += forced_lp[i].tolist()
    return Tree(thoughts, thought_lp, (~ended).tolist(), *_finish(ans))
