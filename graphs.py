"""graphs.py: decoding at GPU speed. On a GPU a decode step of a small model is launch-bound: hundreds of tiny
kernels, each waited for, and the GPU busy a fraction of the wall time. So, as vLLM and nano-vllm do, the step is
captured once as a CUDA graph and replayed: one launch per step. A graph replays fixed shapes at fixed addresses,
so:

* the KV cache lives in static buffers owned here (StaticDecode.adopt copies a cache in once per decode call and
  the cache's tensors become views of them); they grow to the largest cache seen, in powers of two;
* the batch comes in buckets: the step runs on the first `batch_bucket(rows)` cache rows (powers of two). Rows
  past the live ones are dead or padding: they compute, write holes, and are never read. Finished rows move the
  batch to a smaller bucket (sampler.compact_finished), never to an arbitrary size;
* attention spans `span_bucket(length)` slots (powers of two from MIN_SPAN), unwritten slots masked out.

So a run sees at most log2(rows) x log2(slots) shapes, each captured the first time it is needed (a warm-up
call, then the capture); after warm-up no shape is new. The same static code runs eagerly on CPU (capture=False),
where the tests check it samples exactly what the eager path does. Small functions run compiled where
can_compile (the rollout copy's RoPE, SiLU-and-mul and RMSNorm, fused.py, and the token draw): `compiled`.
Left out: capturing the sampler's own ops (the draw, compiled, and the stop checks run after each replay), and
capturing every bucket up front.

Nothing here may strand a run: if building the buffers, compiling, capturing or the first replay of a bucket
raises, one line says what failed, and the run goes on with the eager step for the rest of the run, same seeds,
same tokens (`StaticDecode.give_up`); a compiled small function or the compiled draw that raises falls back to its
plain version on its own (`Guarded`). `describe` says which decode path ran (train.py's end summary).
"""

import copy
import functools
import os
import shutil
import sys
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from kvcache import KVCache, decode_step_static
from model import Transformer

MIN_SPAN = 64  # the smallest attention span bucket, in cache slots
TORCH_FLOOR = "2.6"  # the oldest torch supported (requirements.txt): every API in TORCH_APIS exists in it
TORCH_APIS = {  # what the CUDA path and FSDP call, under torch., with the release each became available in
    **dict.fromkeys(("cuda.CUDAGraph", "cuda.graph", "cuda.graph_pool_handle", "cuda.Stream", "cuda.stream"), "1.10"),
    **dict(compile="2.0", **{"compiler.is_compiling": "2.3", "utils._triton.has_triton": "2.1"}),
    **dict.fromkeys(("get_autocast_dtype", "is_autocast_enabled", "nn.functional.rms_norm"), "2.4"),
    **dict.fromkeys(("distributed.fsdp.fully_shard", "compiler.set_stance"), "2.6"),
}
FELL_BACK: dict[str, str] = {}  # what fell back to eager in this process -> why (one line each, said once)


def release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu128' -> (2, 11)."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def check_torch(version: str = torch.__version__) -> None:
    """Refuse, in one sentence at the start, a torch older than TORCH_FLOOR: not an AttributeError mid-run."""
    if release(version) < release(TORCH_FLOOR):
        raise ValueError(
            f"torch {version} is older than {TORCH_FLOOR}, the oldest this project supports (its CUDA path and FSDP "
            f"use APIs up to {TORCH_FLOOR}): install torch >= {TORCH_FLOOR}"
        )


def fall_back(what: str, error: BaseException) -> None:
    """Say once, in one line, that `what` failed and the run continues eager."""
    why = (str(error).strip().splitlines() or [""])[0][:200] or type(error).__name__
    if what not in FELL_BACK:
        FELL_BACK[what] = f"{type(error).__name__}: {why}"
        print(f"{what} failed ({FELL_BACK[what]}); continuing eager (--no-cuda-graphs silences this)", file=sys.stderr)


def batch_bucket(rows: int) -> int:
    """The smallest power of two >= rows: the batch size a static step runs at."""
    return 1 << max(rows - 1, 0).bit_length()


def span_bucket(length: int, slots: int) -> int:
    """Slots attention covers when `length` slots are written and the step writes one more: the smallest power
    of two >= length + 1 (at least MIN_SPAN), at most the buffers' `slots`."""
    return min(max(batch_bucket(length + 1), MIN_SPAN), slots)


class StaticDecode:
    """Decode steps over static buffers, in batch and span buckets; with capture=True (CUDA) each (batch, span)
    bucket is captured once as a CUDA graph and replayed. step: decode_step_static, or a compiled version of it
    (train.py --compile: inductor fuses the small ops inside the graph). The graphs hold the weights' addresses:
    refresh a model's weights in place (model.copy_weights_), never by replacing its tensors."""

    def __init__(self, step: Callable = decode_step_static, capture: bool = False, compiled_draw: bool = False):
        self.step, self.capture = step, capture
        self.compiled_draw = compiled_draw  # sampler.decode draws tokens through compiled(sample_next)
        self.k = self.v = self.key_valid = self.next_pos = self.slot = None  # (L, rows, Hkv, slots, hd), ...
        self.conv = self.ssm = None  # a hybrid model's DeltaNet states (kvcache.py), (L', rows, ...), else None
        self.tok = self.alive = None  # (rows,) inputs of every graph
        # (rows, V) outputs, one per (dtype, inference mode) a graph was captured in: a bucket captured in another
        # dtype (autocast, a float32 head) writes its own, never one cast to the first capture's dtype; and under
        # inference_mode an inference tensor, like the prefill's logits, so the compiled draw sees one kind of input
        self.logits: dict[tuple, Tensor] = {}
        # (batch, span, autocast dtype, inference mode) -> (replay of self.model's graph, the logits it writes)
        self.graphs: dict[tuple, tuple[Callable[[], None], Tensor]] = {}
        self.model: weakref.ref | None = None
        self.owner: weakref.ref | None = None  # the cache living in the buffers
        self.pool = None  # the graphs' shared memory pool: one graph replays at a time
        self.failed = False  # a build, compile, capture or replay raised: eager from then on (give_up)
        self.tried = False  # the step has run once (a compiled step that ran once has compiled)

    def give_up(self, what: str, error: BaseException) -> None:
        """The static path failed: say so once, drop its graphs and buffers, and run eager from now on."""
        fall_back(what, error)
        self.failed, self.capture, self.step = True, False, decode_step_static
        self.graphs, self.logits, self.pool, self.model = {}, {}, None, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a failed capture's stream work is finished before the eager step runs

    def adopt(self, cache: KVCache) -> bool:
        """Move `cache` into the static buffers (growing them if it does not fit): its k, v, key_valid and
        next_pos become views of them, padded to a power-of-two rows and slots; its slot tensor is the
        graphs'. A cache adopted before and still alive is first copied out (it keeps its contents). False where
        the buffers cannot be made (out of memory, say): the caller decodes on the eager path."""
        if self.failed and self.k is None:
            return False
        try:
            self._adopt(cache)
            return True
        except Exception as e:  # noqa: BLE001 -- a run never ends on the fast path: the eager one remains
            self.give_up("decode: building the static buffers", e)
            self.k = self.v = self.key_valid = self.next_pos = self.slot = self.tok = self.alive = None
            self.conv = self.ssm = None
            return False

    def _adopt(self, cache: KVCache) -> None:
        # already here (decode, extend, decode): this very cache object, still a view of the buffers. An address
        # alone is not enough: another cache can alias the buffers' start, or get their address once they are freed
        owner = self.owner() if self.owner else None
        if self.k is not None and owner is cache and cache.k.data_ptr() == self.k.data_ptr():
            cache.slot = self.slot.fill_(cache.length)
            return
        L, B, Hkv, S, hd = cache.k.shape
        rows, slots = batch_bucket(B), max(batch_bucket(S), MIN_SPAN)
        self._make_room(L, rows, Hkv, slots, hd, cache.k.dtype, cache.k.device)
        self._state_room(cache)
        self._release_owner()
        self.k[:, :B, :, :S], self.v[:, :B, :, :S] = cache.k, cache.v
        if self.conv is not None:  # the states of rows past B: zeros, and never written (those rows are dead)
            self.conv.zero_(), self.ssm.zero_()
            self.conv[:, :B], self.ssm[:, :B] = cache.conv, cache.ssm
            cache.conv, cache.ssm = self.conv[:, :rows], self.ssm[:, :rows]
        self.key_valid.fill_(False)
        self.key_valid[:B, :S] = cache.key_valid
        self.key_valid[B:, 0] = True  # padding rows attend to one (finite) slot: no fully masked row, no NaN
        self.next_pos.zero_()
        self.next_pos[:B] = cache.next_pos
        cache.k, cache.v = self.k[:, :rows], self.v[:, :rows]
        cache.key_valid, cache.next_pos = self.key_valid[:rows], self.next_pos[:rows]
        cache.slot = self.slot.fill_(cache.length)
        self.owner = weakref.ref(cache)

    def _make_room(self, L: int, rows: int, Hkv: int, slots: int, hd: int, dtype, device) -> None:
        """Buffers of at least rows x slots (new buffers invalidate every graph)."""
        if self.k is not None:
            old_L, old_rows, old_Hkv, old_slots, old_hd = self.k.shape
            same = (old_L, old_Hkv, old_hd, self.k.dtype, self.k.device) == (L, Hkv, hd, dtype, device)
            if same and rows <= old_rows and slots <= old_slots:
                return
            if same:
                rows, slots = max(rows, old_rows), max(slots, old_slots)
        self._release_owner()
        self.graphs, self.logits, self.k, self.v = {}, {}, None, None  # freed before the new ones are made
        # normal tensors even when first made under inference_mode (generate), so that a caller decoding under
        # no_grad (multiturn) may write into them too
        with torch.inference_mode(False):
            self.k = torch.zeros(L, rows, Hkv, slots, hd, dtype=dtype, device=device)  # zeros: masked slots finite
            self.v = torch.zeros_like(self.k)
            self.key_valid = torch.zeros(rows, slots, dtype=torch.bool, device=device)
            self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)
            self.slot = torch.zeros(1, dtype=torch.long, device=device)
            self.tok = torch.zeros(rows, dtype=torch.long, device=device)
            self.alive = torch.zeros(rows, dtype=torch.bool, device=device)
        if self.capture:
            # one pool for all graphs of these buffers: safe, as they replay one at a time, hold no live output (their
            # logits are tensors made outside capture) and read only static inputs; its memory (the largest
            # bucket's intermediates: memory.graph_pool_bytes) returns to the allocator when the buffers are replaced
            self.pool = torch.cuda.graph_pool_handle()

    def _state_room(self, cache: KVCache) -> None:
        """Static buffers for a hybrid model's DeltaNet states, as many rows as the others (new buffers, new graphs)."""
        kind = [(t.shape[0], *t.shape[2:], t.dtype, t.device) for t in (cache.conv, cache.ssm) if t is not None]
        have = [(t.shape[0], *t.shape[2:], t.dtype, t.device) for t in (self.conv, self.ssm) if t is not None]
        if kind == have and (self.conv is None or self.conv.shape[1] == len(self.tok)):
            return
        self._release_owner()
        self.graphs, self.conv, self.ssm = {}, None, None
        if kind:
            with torch.inference_mode(False):  # normal tensors (see _make_room)
                self.conv = cache.conv.new_zeros(kind[0][0], len(self.tok), *kind[0][1:-2])
                self.ssm = cache.ssm.new_zeros(kind[1][0], len(self.tok), *kind[1][1:-2])

    def _release_owner(self) -> None:
        """The cache adopted last, if still alive, gets copies of its tensors: the buffers are about to change. (A
        one-off copy at the buffers' padded size; memory.py's sample phase counts that cache at its own size.)"""
        prev = self.owner() if self.owner else None
        if prev is not None:
            with torch.inference_mode(False):  # normal tensors, whatever mode the caller is in (see _make_room)
                prev.k, prev.v, prev.key_valid, prev.next_pos = (
                    t.clone() for t in (prev.k, prev.v, prev.key_valid, prev.next_pos)
                )
                if prev.conv is not None:
                    prev.conv, prev.ssm = prev.conv.clone(), prev.ssm.clone()
        self.owner = None

    def __call__(self, model: Transformer, cache: KVCache, tok: Tensor, alive: Tensor) -> Tensor:
        """Feed tok (n,) for the n = cache.batch active rows of an adopted cache; returns their logits (n, V).
        Runs batch_bucket(n) rows over span_bucket(cache.length) slots."""
        n = cache.batch
        b = batch_bucket(n)
        cache.span = span_bucket(cache.length, self.k.shape[3])
        self.tok[:n], self.alive[:n] = tok, alive
        self.alive[n:b] = False  # rows past the active ones: dead (finished) or padding
        if not self.capture and (self.tried or self.step is decode_step_static):
            return self.step(model, cache, self.tok[:b], self.alive[:b])[:n]
        # graphs hold a model's weights: a new model, new graphs. Train and eval sample through one rollout copy (one
        # runner, train.py), so this happens once; a caller alternating models would recapture every bucket each time
        if self.model is None or self.model() is not model:
            self.graphs, self.logits, self.model = {}, {}, weakref.ref(model)
        dev = cache.k.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        key = (b, cache.span, cast, torch.is_inference_mode_enabled())
        if key in self.graphs:
            replay, out = self.graphs[key]
            replay()
            return out[:n]
        pos, stage = self.next_pos.clone(), "compiling the decode step"
        try:  # a new bucket: its warm-up (a compile), its capture and its first replay may each fail
            if not self.capture:  # --compile without graphs: its first call compiles
                logits = self.step(model, cache, self.tok[:b], self.alive[:b])[:n]
                self.tried = True
                return logits
            stage = "capturing the decode step as a CUDA graph"
            replay, out = self._capture(model, cache, b)
            stage = "replaying the captured decode step"
            replay()
            self.graphs[key], self.tried = (replay, out), True
            return out[:n]
        except Exception as e:  # noqa: BLE001 -- the eager step computes the same tokens
            self.give_up(f"decode: {stage} (batch {b}, span {cache.span})", e)
            self.next_pos.copy_(pos)  # what the failed attempt advanced is put back
            return self.step(model, cache, self.tok[:b], self.alive[:b])[:n]

    def _capture(self, model: Transformer, cache: KVCache, b: int) -> tuple[Callable[[], None], Tensor]:
        """Record the step at batch b and cache.span as a CUDA graph writing its logits into the self.logits of its
        own dtype; returns its replay and those logits. A warm-up call comes first (lazy inits, cuBLAS workspaces,
        torch.compile's compile)."""
        tok, alive = self.tok[:b], self.alive[:b]
        # the graph's own view of the buffers at this span: nothing of the caller's cache object is recorded
        view = copy.copy(cache)
        view.__dict__.update(k=self.k, v=self.v, key_valid=self.key_valid, next_pos=self.next_pos, slot=self.slot)
        view.__dict__.update(conv=self.conv, ssm=self.ssm)

        def step() -> Tensor:
            return self.step(model, view, tok, alive)

        # The warm-up feeds no row (alive all False): its key writes at the slot are the replay's own, and no
        # position or DeltaNet state moves (a skipped token leaves a state exactly as it was: deltanet.py).
        live = alive.clone()
        alive.fill_(False)
        try:
            logits = warm_up(step)
        finally:
            alive.copy_(live)
        kind = (logits.dtype, torch.is_inference_mode_enabled())
        if kind not in self.logits:  # (rows, V), shared by every graph of this kind, made in the caller's mode
            self.logits[kind] = logits.new_empty(len(self.tok), logits.shape[-1])
        out = self.logits[kind]
        # the warm-up compiled whatever the step compiles, with these very inputs: a compile inside stream capture
        # (a guard that missed: it would run Inductor's autotuning and syncs under capture) is refused, an error the
        # caller falls back on, never a half-captured stream
        with torch.compiler.set_stance("fail_on_recompile"):
            return record(lambda: out[:b].copy_(step()), self.pool), out


def warm_up(fn: Callable[[], Tensor]) -> Tensor:
    """Run fn once on a side stream, as CUDA graph capture wants its first call made (PyTorch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


def record(fn: Callable[[], object], pool) -> Callable[[], None]:
    """Capture fn's kernels as a CUDA graph (nothing runs now) in the memory pool `pool`; returns its replay,
    which runs them again on whatever the captured buffers then hold."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


def can_compile(device: torch.device, graphs: bool = True) -> bool:
    """Whether decoding runs its small functions compiled (the rollout copy's, fused.py, and the token draw,
    sampler.sample_next): on CUDA with CUDA graphs (--no-cuda-graphs keeps the whole eager path, the reference),
    where Triton can generate the kernels: it imports and sees a GPU of sm >= 7.0 (has_triton), and a C compiler
    builds its launchers. What cannot be checked without compiling (libcuda not found, a broken ptxas) fails at
    the first warm-up, and Guarded falls back to the plain functions. --compile (decode_runner) compiles on any
    device: without a working Inductor its first step fails and StaticDecode.give_up runs eager."""
    from torch.utils._triton import has_triton

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return device.type == "cuda" and graphs and has_triton() and bool(compiler)


class Guarded:
    """A compiled function that, the first time its compiled version raises (a compile, Triton or capture error),
    says so once for its kind (`what`) and runs the plain function from then on: the same values, eagerly."""

    def __init__(self, fn: Callable, what: str):
        self.fn, self.what, self.run = fn, what, torch.compile(fn, dynamic=True)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kw):
        if self.run is not self.fn and not torch.compiler.is_compiling():  # inside a compiled step: traced as fn
            try:
                return self.run(*args, **kw)
            except Exception as e:  # noqa: BLE001 -- the plain function computes the same values
                fall_back(self.what, e)
                self.run = self.fn
        return self.fn(*args, **kw)


@functools.cache
def compiled(fn: Callable, what: str = "the compiled small functions") -> Guarded:
    """fn through torch.compile with dynamic shapes (compiled on its first call, once for every batch size, as
    nano-vllm compiles its norms, RoPE, SiLU-and-mul and sampler): the few ops of a small function become one
    generated kernel, or a few. One compiled version per function, falling back to fn where it fails (Guarded)."""
    return Guarded(fn, what)


def decode_path(runner: StaticDecode | None) -> str:
    """Which decode path ran, and what fell back to eager and why: what train.py's end summary says."""
    path = "eager" if runner is None or runner.failed else "CUDA graphs" if runner.capture else "static shapes"
    path += " (decode step compiled)" if runner is not None and runner.step is not decode_step_static else ""
    return "; ".join([path] + [f"{what} failed, ran eager ({why})" for what, why in FELL_BACK.items()])


def decode_runner(device: torch.device, *, graphs: bool = True, compile: bool = False) -> StaticDecode | None:
    """The decode path a run samples through (sampler.decode's static_step): on CUDA, CUDA graphs unless
    graphs=False (--no-cuda-graphs: the eager path, the reference), with the token draw compiled where
    can_compile; compile=True (--compile) first compiles the static step with torch.compile (dynamic shapes:
    one compile for all buckets), on any device. None: eager."""
    capture = device.type == "cuda" and graphs
    if not (capture or compile):
        return None
    step = torch.compile(decode_step_static, dynamic=True, fullgraph=True) if compile else decode_step_static
    return StaticDecode(step, capture=capture, compiled_draw=can_compile(device, graphs))
