"""memory.py: a training step's peak memory, estimated before the first step, against the device's.

A run whose step cannot fit would otherwise grow until the kernel kills it (exit 137, no message),
minutes in. Before the data pool is built and the model loaded, train.py asks `check_memory` for an
estimate of each phase's peak and refuses, in one sentence naming the flags to lower, a run whose
largest phase exceeds the memory available: on CPU the smaller of /proc/meminfo's MemAvailable and
the cgroup's limit (a container's), on CUDA torch.cuda.mem_get_info's free memory.

The estimate adds up what the code allocates (bytes; N parameters, vocabulary V, hidden size C,
intermediate size I, L layers, H query and Hkv key/value heads of hd):
  resident  float32 weights 4N (train.py loads the masters in float32), a --rollout-dtype copy (2N in
            bf16), a --beta reference copy 4N, AdamW's two moments 8N (not on the GPU with
            --optimizer-offload; on the CPU, plus its 4N float32 copies), on CUDA the CUDA graphs' static
            KV buffers (graphs.py: rows and slots rounded up to powers of two) and their memory pool (the
            largest bucket's captured intermediates, an estimate: graph_pool_bytes), and on CPU the process
            itself (measured: interpreter, torch, tokenizer, data) and the data pool about to be built;
  sample    the KV caches of sampler.sample_tree (2 L Hkv hd bytes per token slot and row, in the
            rollout dtype; a fork holds the old and the new cache at once) and the decode step's (B, V)
            logits with their float32 copies (sample_next: x, its exp and cumsum);
  eval      the same for eval.evaluate's chunk of 64 prompts x --eval-samples;
  update    float32 gradients 4N, what autograd saves for backward over one micro-batch (per layer:
            layer_saved_bytes, and a hybrid's deltanet_saved_bytes, counted exactly; with
            --gradient-checkpointing only each layer's input, plus one layer recomputed), the head's saved
            hidden states, and the larger of
            backward's transients: one layer's gradients (SwiGLU's four (tokens, I) tensors), or a
            slice of float32 logits (logprobs.head_logprobs) with a float32 (V, C) gradient made before
            it is added into the existing one (docs/memory.md, bench_knobs.py);
  score     (config.score_pass_needs: mu > 1, GTPO's entropy, the token selections, --beta) one micro-batch's
            forward, nothing saved.
--micro-batch-rows auto (the default) picks the most rows per micro-batch (CPU: at most CPU_AUTO_ROWS) whose estimate
fits AUTO_MARGIN of the available memory (else with gradient checkpointing); above that share, one warning line.
Deliberately simple: one micro-batch of the largest shape (rows x the longest row, as pack.py pads
them), every thought and answer at its length limit, the longest prompt of a sample of the data;
the allocator's own slack (heap fragmentation, CUDA's block rounding) is not modelled.
"""

from __future__ import annotations

import json
import math
import os
import tracemalloc
from dataclasses import dataclass, replace

import torch

import methods
from cli import UserError
from config import score_pass_needs
from distributed import rollout_dtype
from graphs import MIN_SPAN, batch_bucket
from hf import config_from_hf
from lora import adapter_size, parse_targets
from model import ModelConfig, Transformer
from tasks import Task, render_prompt
from tokenizer import load_tokenizer

GIB = 2**30
EVAL_BATCH_PROMPTS = 64  # eval.evaluate's default batch_prompts, which train.py's evaluation uses
DATA_SAMPLE = 256  # examples rendered to find the longest prompt and to measure an example's size
AUTO_MARGIN = 0.85  # auto plans for this share of the available memory (allocator slack, the OS); above it, a warning
CPU_AUTO_ROWS = 64  # --micro-batch-rows auto on CPU: at most the plain default (the machine is shared with the OS)


@dataclass(frozen=True)
class Shape:
    """What a step's memory depends on, besides the model: per rank, in tokens and rows."""

    prompts: int  # P, this rank's prompts per step
    thoughts: int  # K
    answers: int  # M
    prompt_tokens: int  # the longest rendered prompt
    thought_tokens: int  # a thought with its end-of-thought marker (0 when M = 1: plain completions)
    answer_tokens: int  # an answer (M = 1: the whole completion)
    micro_batch_rows: int
    micro_batch_tokens: int  # 0 = no token budget
    share_prompt: bool
    gradient_checkpointing: bool
    eval_prompts: int  # prompts per evaluation batch
    eval_samples: int
    rollout_bytes: int  # bytes per element of the sampler's weights and KV cache
    act_bytes: int  # bytes per element of the matmul outputs in training (2 under bf16 autocast)
    score_pass: bool  # config.score_pass_needs: the policy or the reference runs a no-grad pass
    trainable: int = 0  # parameters the update trains (0: all of them; LoRA: its adapters)


def n_params(config: ModelConfig) -> int:
    """Parameters of the model `config` describes (a tied head counted once), built on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(config).parameters())


def attention_layers(c: ModelConfig) -> int:
    """How many of the layers attend (all of them, but for a hybrid's DeltaNet layers)."""
    return sum(c.mixer(i) == "full_attention" for i in range(c.num_hidden_layers))


def kv_bytes(c: ModelConfig, rows: int, slots: int, nbytes: int) -> int:
    """kvcache.KVCache: keys and values (L, rows, Hkv, slots, hd) of the attention layers, and a hybrid's DeltaNet
    states, the same size whatever the slots: the convolution's window (rows, D, K-1) and S (rows, Hv, dk, dv) in
    float32."""
    attention = attention_layers(c)
    linear = c.num_hidden_layers - attention
    D = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    S = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    states = linear * rows * (D * (c.linear_conv_kernel_dim - 1) * nbytes + S * 4)
    return 2 * attention * rows * c.num_key_value_heads * slots * c.head_dim * nbytes + states


def sampling_bytes(c: ModelConfig, shape: Shape, prompts: int, group: int, thoughts: int, answer: int) -> int:
    """Peak of sampler.sample_tree / generate beyond the weights: `prompts` prompts prefilled once, then
    forked to prompts x group rows for `answer` new tokens (after a thought phase of `thoughts` rows of
    shape.thought_tokens, when given): the caches of the largest fork, old and new at once, and the
    decode step's (rows, V) logits with sample_next's float32 copies."""
    Lp, Tt, nb = shape.prompt_tokens, shape.thought_tokens, shape.rollout_bytes
    if thoughts:  # prompts -> K thoughts -> M answers each: the answer fork copies the thought cache
        old, new = kv_bytes(c, thoughts, Lp + Tt, nb), kv_bytes(c, group, Lp + Tt + answer, nb)
    else:
        old, new = kv_bytes(c, prompts, Lp, nb), kv_bytes(c, group, Lp + answer, nb)
    decode = group * c.vocab_size * (nb + 3 * 4)  # logits, then x (float32), exp(x - max), its cumsum
    prefill = prompts * Lp * (4 * c.hidden_size + 3 * c.intermediate_size) * nb  # one layer's transients
    return old + new + max(decode, prefill)


def decode_buffer_bytes(c: ModelConfig, shape: Shape, rows: int) -> int:
    """graphs.StaticDecode's static buffers, kept between steps: keys and values for the rollouts' rows and
    slots, each rounded up to a power of two, and the graphs' (rows, V) logits."""
    rows, slots = batch_bucket(rows), decode_slots(shape)
    return kv_bytes(c, rows, slots, shape.rollout_bytes) + rows * c.vocab_size * shape.rollout_bytes


def decode_slots(shape: Shape) -> int:
    """The static buffers' slots: the longest row (prompt, thought and answer), rounded up to a power of two."""
    return max(batch_bucket(shape.prompt_tokens + shape.thought_tokens + 1 + shape.answer_tokens), MIN_SPAN)


def graph_pool_bytes(c: ModelConfig, shape: Shape, rows: int) -> int:
    """The CUDA graphs' private memory pool, an estimate: what the largest bucket's captured step allocates, kept
    for as long as the graphs live. Every bucket of one set of buffers shares one pool (graphs.py: they replay one
    at a time), so the largest bucket's, not the sum: its lm_head output (rows, V) before the copy into the
    logits, one layer's activations (q, k and v; the attention's float32 scores over the span, as SDPA's math
    backend holds them; gate and up and their product; the residual stream and its norms), the additive mask and
    RoPE's tables. cuBLAS's and the compiled functions' workspaces are left out. The draw's float32 temporaries
    run outside the graphs: the sample phase counts them (sampling_bytes)."""
    rows, span, nb = batch_bucket(rows), decode_slots(shape), shape.rollout_bytes
    C, H, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_row = c.vocab_size + 4 * C + 3 * c.intermediate_size + (H + 2 * Hkv) * hd + span + 4 * hd  # elements
    return rows * (per_row * nb + H * span * 4)


def micro_batch(shape: Shape) -> tuple[int, int, int, int]:
    """(rows, row tokens, shared prompts, their tokens) of the largest micro-batch pack.split_rows cuts:
    rows of one thought and its M answers, every segment at its limit."""
    shared = shape.prompt_tokens if shape.share_prompt else 0
    row = shape.thought_tokens + shape.answers * shape.answer_tokens + shape.prompt_tokens - shared
    rows = min(shape.micro_batch_rows, shape.prompts * shape.thoughts)
    if shape.micro_batch_tokens:  # rows x row tokens (+ their prompts) within the budget; a longer row runs alone
        rows = max(1, min(rows, shape.micro_batch_tokens // (row + shared)))
    # rows are sorted by length, not by prompt: a micro-batch of fewer than all rows may hold one prompt per row
    prompts = shape.prompts if rows == shape.prompts * shape.thoughts else min(rows, shape.prompts)
    micro_batches = -(-shape.prompts * shape.thoughts // rows)
    if micro_batches * prompts > shape.prompts and shape.prompts * shared <= rows * row + prompts * shared:
        prompts = shape.prompts  # pack.step_prompts: every prompt in one pass, its activations kept through the epoch
    return rows, row, prompts if shared else 0, shape.prompt_tokens


def layer_saved_bytes(c: ModelConfig, tokens: int, keys: int, mask_cells: int, nb: int = 4) -> int:
    """Bytes autograd keeps for the backward of one model.Block over `tokens` query tokens attending to
    `keys` key slots (rows x keys per row), with a boolean mask of `mask_cells` (rows x T x S; 0 when the
    forward is plainly causal), which SDPA keeps as a float32 copy. Per token: each RMSNorm's input,
    its normalised value and its output (3C, and 1 for its rstd), q and the attention output copied into
    o_proj (2 H hd), the attention's logsumexp (H), gate and up (2I, model._SwiGLUDown), Qwen3's q/k
    norms (2 (H + Hkv) hd + H + Hkv); per key slot the keys and values expanded to H heads. Exact in
    float32 (tests/test_memory.py counts them with saved-tensor hooks); nb: bytes of the matmul outputs
    under bf16 autocast, where the norms stay float32 (an approximation)."""
    C, H, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    norms = 2 * (3 * C + 1) * 4
    qk = (2 * (H + Hkv) * hd + H + Hkv) * 4 if c.qk_norm else 0
    per_token = norms + qk + 2 * H * hd * nb + H * 4 + 2 * c.intermediate_size * nb
    return tokens * per_token + keys * 2 * H * hd * nb + mask_cells * 4


def deltanet_saved_bytes(c: ModelConfig, forwards: list[tuple[int, int]], nb: int = 4) -> int:
    """Bytes autograd keeps for the backward of one Block of a hybrid's DeltaNet layer (deltanet.py's chunked form)
    over forwards of (rows, tokens per row). Per token: each norm's input, normalised value, output and rstd
    (3C + 1, twice), the convolution's input and output (2D), q and k L2-normalised (2 Hv (dk + 1); with as many
    key heads as value heads they are views, and the convolution's output is kept whole: + Hv dv), the gates
    (3 Hv), the gated norm and out_proj's input (6 Hv dv + Hv), gate and up (2I). Per row: the convolution's
    window (D (K-1)), and per value head and chunk of 64 (N a row's chunks) the chunk's decays, triangular system,
    its inverse and reads (9 x 64^2), keys (3 or, N > 1, 5 x 64 dk: what reads the state a chunk starts from),
    values (2 x 64 dv), gates (4 x 64) and the scan's state (dk dv + 1). Per forward: the norms' 1 + w and the
    decay's two (Hv) factors. Exact in float32
    (tests/test_memory.py); nb: bytes of the projections' outputs (the rule itself runs in float32)."""
    C, I, K = c.hidden_size, c.intermediate_size, c.linear_conv_kernel_dim  # noqa: E741 (I: intermediate size)
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    D, chunk = 2 * Hk * dk + Hv * dv, 64
    qk = 2 * Hv * (dk + 1) + (Hv * dv if Hv == Hk else 0)
    per_token = (2 * (3 * C + 1) + qk + 3 * Hv + 6 * Hv * dv + Hv) * 4 + (2 * D + 2 * I) * nb
    total = 0
    for rows, T in forwards:
        N = -(-T // chunk)
        per_chunk = 9 * chunk * chunk + (3 + 2 * (N > 1)) * chunk * dk + 2 * chunk * dv + 4 * chunk + dk * dv + 1
        total += rows * T * per_token + rows * (D * (K - 1) * nb + N * Hv * per_chunk * 4) + (2 * C + 2 * Hv) * 4
    return total


def update_bytes(c: ModelConfig, shape: Shape) -> dict[str, int]:
    """The update's peak beyond the weights and optimizer state, by term: gradients, saved activations
    of the largest micro-batch, backward's transients. A hybrid (Qwen3.5) runs a tree row as two forwards
    (pack.tree_hidden: the trunks, then the answers as rows of their own) and its attention keeps its output gate
    and norms' 1 + w too (3 H hd per token, 2C + 2hd per forward)."""
    rows, row, prompts, Lp = micro_batch(shape)
    nb, L, C, V, M = shape.act_bytes, c.num_hidden_layers, c.hidden_size, c.vocab_size, shape.answers
    tokens = rows * row + prompts * Lp  # the rows, and their shared prompts' pass
    keys = rows * (row + Lp * (prompts > 0)) + prompts * Lp
    masked = M > 1 or prompts > 0  # tree attention or shared prompts: an explicit mask
    cells = (rows * row * (row + Lp * (prompts > 0)) + prompts * Lp * Lp) * masked
    forwards = [(prompts, Lp)] if prompts else []
    hybrid = c.model_type == "qwen3_5"
    if hybrid and M > 1:  # trunks of Lt tokens reading Sk keys, then rows * M answers reading them and their own
        Lt, La = row - M * shape.answer_tokens, shape.answer_tokens
        Sk = Lt + Lp * (prompts > 0)
        keys = rows * Sk + rows * M * (Sk + La) + prompts * Lp
        cells = rows * Lt * Sk + rows * M * La * (Sk + La) + prompts * Lp * Lp
        forwards += [(rows, Lt), (rows * M, La)]
    else:
        forwards += [(rows, row)]
    layer, linear = layer_saved_bytes(c, tokens, keys, cells, nb), 0
    if hybrid:
        layer += tokens * 3 * c.num_attention_heads * c.head_dim * nb + len(forwards) * (2 * C + 2 * c.head_dim) * 4
        linear = deltanet_saved_bytes(c, forwards, nb)
    attention = attention_layers(c)
    if shape.gradient_checkpointing:
        saved = L * tokens * C * 4 + max(layer, linear)
    else:
        saved = attention * layer + (L - attention) * linear
    completion = rows * row - rows * Lp * (not shape.share_prompt)  # the tokens the head scores
    head = tokens * (3 * C + 1) * 4 + completion * C * 4 * (2 if prompts else 1)  # final norm; hidden states
    # backward runs the head, then the layers one at a time: its peak is the larger of their transients
    layer_grads = tokens * (4 * c.intermediate_size + 4 * C) * 4 + keys * 2 * c.num_attention_heads * c.head_dim * 4
    logits = min(2**24, completion * V) * 4 * 2  # a head slice (2**24 logits at most): recomputed, their gradient
    return dict(activations=saved + head, backward=max(layer_grads, logits + V * C * 4))


def scoring_bytes(c: ModelConfig, shape: Shape) -> int:
    """A no-grad forward of the largest micro-batch: one layer's transients and a slice of head logits."""
    rows, row, prompts, Lp = micro_batch(shape)
    tokens = rows * row + prompts * Lp
    per_token = (4 * c.hidden_size + 3 * c.intermediate_size + 3 * c.num_attention_heads * c.head_dim) * 4
    return tokens * per_token + min(2**24, rows * row * c.vocab_size) * 4 * 3


def estimate(c: ModelConfig, shape: Shape, *, fixed: dict[str, int], world: int, fsdp: bool) -> dict[str, dict]:
    """Each phase's peak, by term (bytes). fixed: what every phase holds (weights, optimizer state, on
    CPU the process and the data pool), already divided over the ranks where FSDP shards it."""
    N, K = shape.trainable or n_params(c), shape.thoughts  # the gradients' parameters
    grads = 4 * N // (world if fsdp else 1) + (4 * N if world > 1 and not fsdp else 0)  # DDP: + its buckets
    M, P, E = shape.answers, shape.prompts, shape.eval_prompts
    thought_rows = P * K if shape.thought_tokens else 0
    evals = sampling_bytes(c, shape, E, E * max(1, shape.eval_samples), 0, shape.thought_tokens + shape.answer_tokens)
    phases = {
        "sample": dict(kv_cache_and_logits=sampling_bytes(c, shape, P, P * K * M, thought_rows, shape.answer_tokens)),
        "eval": dict(kv_cache_and_logits=evals),
        "update": dict(gradients=grads, **update_bytes(c, shape)),
    }
    if shape.score_pass:
        phases["score_pass"] = dict(forward=scoring_bytes(c, shape))
    return {name: {**fixed, **terms} for name, terms in phases.items()}


# -----------------------------------------------------------------------------
# What is available, and the check train.py runs


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can get: CUDA's free memory, or on CPU the smaller of MemAvailable and
    what the cgroup (a container's limit) has left."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = [_meminfo("MemAvailable")]
    for limit, used in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            with open(f"/sys/fs/cgroup/{limit}") as f, open(f"/sys/fs/cgroup/{used}") as g:
                free.append(int(f.read()) - int(g.read()))
        except (OSError, ValueError):  # no such cgroup file, or "max" (no limit)
            pass
    return min(free)


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):  # not Linux
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def example_bytes(task: Task, seed: int) -> tuple[int, list[dict]]:
    """Bytes one training example of the data pool takes (measured with tracemalloc over DATA_SAMPLE
    of them), and that sample."""
    tracemalloc.start()
    try:
        sample = task.train(DATA_SAMPLE, seed)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return math.ceil(used / max(1, len(sample))), sample


# Flags that shrink each term, for the refusal.
ADVICE = {
    "data_pool": "--max-steps x --prompts-per-step (the training examples are drawn up front)",
    "kv_cache_and_logits": "--prompts-per-step, --thoughts, --answers or --max-thought-tokens/--max-answer-tokens",
    "decode_buffers": "--prompts-per-step, --thoughts, --answers or the token limits (or pass --no-cuda-graphs)",
    "cuda_graph_pool": "--prompts-per-step, --thoughts, --answers or the token limits (or pass --no-cuda-graphs)",
    "activations": "--micro-batch-rows or --micro-batch-tokens, or pass --gradient-checkpointing",
    "backward": "--micro-batch-rows or --micro-batch-tokens",
    "forward": "--micro-batch-rows or --micro-batch-tokens",
    "gradients": "the model size (or shard it: torchrun ... --fsdp)",
    "weights": "the model size (or shard it: torchrun ... --fsdp)",
    "optimizer": "the model size (--optimizer-offload moves it off a GPU; --fsdp shards it)",
    "process": "other work in this process",
    "run_state": "--staleness (the queue holds K steps of rollouts)",
}


@dataclass(frozen=True)
class Plan:
    """What check_memory settled: the micro-batch the update runs, and the start line's phrase."""

    micro_batch_rows: int
    gradient_checkpointing: bool
    phrase: str  # "estimated peak memory ..." ("" when the model directory cannot be read)
    warning: str = ""  # a line for an estimate above AUTO_MARGIN of the available memory, naming the knobs


def auto_micro_batch(shape: Shape, need, have: int, most: int) -> tuple[int, bool]:
    """--micro-batch-rows auto: the most rows per micro-batch (`most`: on CUDA all of a step's rows, on CPU
    CPU_AUTO_ROWS; or a power of two below) whose estimated peak, need(shape), fits AUTO_MARGIN of the available
    memory `have`; if none does even with one row, the same with gradient checkpointing (kept on if the user asked
    for it). If nothing fits, one row with checkpointing, which the check then refuses or warns about."""
    rows = [most] + [r for r in (2**i for i in range(most.bit_length() - 1, -1, -1)) if r < most]
    for checkpointing in dict.fromkeys((shape.gradient_checkpointing, True)):
        for r in rows:
            if need(replace(shape, micro_batch_rows=r, gradient_checkpointing=checkpointing)) <= AUTO_MARGIN * have:
                return r, checkpointing
    return 1, True


def check_memory(cfg, task: Task, device: torch.device, world: int) -> Plan:
    """Estimate a training step's peak memory for train.py's config `cfg` and refuse, as a UserError
    naming the flags to lower, a run whose largest phase cannot fit in what is available. With
    --micro-batch-rows auto, first choose the micro-batch (auto_micro_batch).
    Returns the Plan: the rows and checkpointing the update runs and the start line's phrase."""
    auto = cfg.micro_batch_rows == "auto"
    rows = CPU_AUTO_ROWS if auto else cfg.micro_batch_rows
    try:
        with open(os.path.join(cfg.model, "config.json")) as f:
            c = config_from_hf(json.load(f))
        tokenizer = load_tokenizer(cfg.model)
    except (OSError, ValueError):
        return Plan(rows, cfg.gradient_checkpointing, "")
    per_example, sample = example_bytes(task, cfg.seed)
    examples = sample + task.test(min(cfg.eval_examples, DATA_SAMPLE), cfg.seed)
    Lp = max(len(render_prompt(tokenizer, ex, task.system_prompt)) for ex in examples)
    cuda, fsdp, N = device.type == "cuda", world > 1 and cfg.fsdp, n_params(c)
    rollout = rollout_dtype(cfg, cuda)
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda)
    M = cfg.answers
    shape = Shape(
        prompts=cfg.prompts_per_step // world,
        thoughts=cfg.thoughts,
        answers=M,
        prompt_tokens=Lp,
        thought_tokens=cfg.max_thought_tokens + len(tokenizer.encode(cfg.end_of_thought)) if M > 1 else 0,
        answer_tokens=cfg.max_answer_tokens + (0 if M > 1 else cfg.max_thought_tokens),
        micro_batch_rows=rows,
        micro_batch_tokens=cfg.micro_batch_tokens,
        share_prompt=cfg.share_prompt,
        gradient_checkpointing=cfg.gradient_checkpointing,
        eval_prompts=min(EVAL_BATCH_PROMPTS, cfg.eval_examples),
        eval_samples=cfg.eval_samples,
        rollout_bytes=2 if rollout == "bfloat16" else 4,
        act_bytes=2 if bf16 else 4,
        score_pass=any(score_pass_needs(cfg)),
        trainable=adapter_size(c, cfg.lora_rank, parse_targets(cfg.lora_targets)) if cfg.lora_rank else N,
    )
    T = shape.trainable  # AdamW's state and the gradients: every parameter, or LoRA's adapters
    shard = world if fsdp else 1
    weights = 4 * N // shard + (4 * N if fsdp else 0)  # FSDP: its shard, and the whole weights while sampling
    weights += shape.rollout_bytes * N if rollout != "float32" else 0  # the sampler's copy
    weights += 4 * N if cfg.beta and not cfg.lora_rank else 0  # the --beta reference
    weights += methods.weight_bytes(cfg, shape.rollout_bytes)  # a teacher's (methods/teacher.py)
    offloaded = cfg.optimizer_offload and cuda
    fixed = dict(weights=weights, optimizer=0 if offloaded else 8 * T // shard + 4 * T * cfg.optimizer_offload)
    n_pool = cfg.max_steps * cfg.prompts_per_step + methods.stream_size(cfg)  # the pool and the methods' streams
    per_step = shape.prompts * cfg.thoughts * (shape.thought_tokens + M * shape.answer_tokens)  # completion tokens
    if methods.held_bytes(cfg, per_step):  # run state: the --staleness queue
        fixed["run_state"] = methods.held_bytes(cfg, per_step)
    if cuda and cfg.cuda_graphs:  # graphs.StaticDecode's buffers and its graphs' pool stay allocated through the update
        # train.py's evaluation samples through the same buffers: they grow to the larger of its rows and a step's
        decode_rows = max(cfg.thoughts * cfg.answers * shape.prompts, shape.eval_prompts * max(1, shape.eval_samples))
        fixed["decode_buffers"] = decode_buffer_bytes(c, shape, decode_rows)
        fixed["cuda_graph_pool"] = graph_pool_bytes(c, shape, decode_rows)
    if not cuda:  # the process and its data share the CPU's memory with the step
        fixed = dict(process=process_bytes(), data_pool=n_pool * per_example, **fixed)
    have = available_bytes(device) + (fixed.get("process", 0))
    peak = lambda shape: max(  # noqa: E731 (the largest phase, its terms)
        estimate(c, shape, fixed=fixed, world=world, fsdp=fsdp).items(), key=lambda kv: sum(kv[1].values())
    )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if not cuda else 1  # CPU ranks share one machine
    if auto:
        most = shape.prompts * shape.thoughts if cuda else CPU_AUTO_ROWS
        rows, checkpointing = auto_micro_batch(shape, lambda s: sum(peak(s)[1].values()) * local, have, most)
        shape = replace(shape, micro_batch_rows=rows, gradient_checkpointing=checkpointing)
    phase, terms = peak(shape)
    need = sum(terms.values())
    if need * local > have:
        top = max(terms, key=terms.get)
        shown = sorted(((k, v) for k, v in terms.items() if v >= 0.005 * GIB), key=lambda kv: -kv[1])
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in shown)
        raise UserError(
            f"a training step needs about {need * local / GIB:.1f} GiB at its peak ({phase}: {parts} GiB) but "
            f"{have / GIB:.1f} GiB are available on {device}: lower {ADVICE[top]}"
        )
    phrase = f"estimated peak memory {need / GIB:.2f} GiB ({phase}) of {have / GIB:.1f} GiB available"
    if auto:  # the start line says what auto chose
        on = ", gradient checkpointing on" if shape.gradient_checkpointing and not cfg.gradient_checkpointing else ""
        phrase += f"; micro-batch rows auto: {shape.micro_batch_rows}{on}"
    knobs = ["--gradient-checkpointing"] * (not shape.gradient_checkpointing) + ["--lora-rank N"] * (not cfg.lora_rank)
    knobs += ["--optimizer-offload"] * (cuda and not cfg.optimizer_offload)
    knobs += ["--rollout-dtype float32"] * (rollout != "float32")
    warning = f"warning: the estimated peak is {need * local / have:.0%} of the available memory, above the "
    warning += f"{AUTO_MARGIN:.0%} that leaves room for the allocator and the OS: lower --micro-batch-rows or "
    warning += "--micro-batch-tokens" + (f", or pass {' or '.join(knobs)}" if knobs else "")
    warning *= need * local > AUTO_MARGIN * have
    return Plan(shape.micro_batch_rows, shape.gradient_checkpointing, phrase, warning)
