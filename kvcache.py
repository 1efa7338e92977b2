"""kvcache.py: the KV cache and the model's steps over it. A cache holds keys and values (L, B, Hkv, slots, hd)
for every attention layer, the recurrent state of every Gated DeltaNet layer (a hybrid model's, deltanet.py: the
convolution's window and the matrix S, a fixed size whatever the length) and each row's state (valid slots, next
RoPE position); prefill runs left-padded prompts into a new cache, extend appends a chunk, decode_step one token per
active row (decode_step_static: the same with static shapes, for torch.compile and CUDA graphs). sampler.py builds
sampling on these; model.py writes into the cache.

A slot a row does not use (left padding, a finished row's step) is a hole: attention masks it out and a DeltaNet
layer passes over it (the `valid` of each forward), so holes never change what a row computes. Unlike a slot of
keys, a state cannot be rewound: a token once fed is in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model import Transformer


class KVCache:
    """Preallocated keys/values (L, B, Hkv, max_len, hd) for every layer, plus per-row state."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        layers: list[int] | None = None,
        state: tuple[list[int], tuple[int, ...], tuple[int, ...]] | None = None,
    ):
        """layers: the model layer of each of the n_layers KV entries (default 0 .. n_layers - 1). state: the
        DeltaNet layers and the shapes of one row's convolution window and S, (layer ids, (D, K-1), (Hv, dk, dv))."""
        self.kv_index = {layer: i for i, layer in enumerate(range(n_layers) if layers is None else layers)}
        ids, conv, S = state if state is not None else ([], (), ())
        self.state_index = {layer: i for i, layer in enumerate(ids)}
        self.conv = torch.zeros(len(ids), batch, *conv, dtype=dtype, device=device) if ids else None
        self.ssm = torch.zeros(len(ids), batch, *S, dtype=torch.float32, device=device) if ids else None  # S
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # zeros: never NaN garbage behind a mask
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # slot holds a real token
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)  # RoPE position of the next token
        self.rows = torch.arange(batch, device=device)  # caller's row id held by each cache row
        self.length = 0  # slots written so far, the same for every row
        self.batch = batch  # forwards run on the active cache rows [:batch]
        self.slot: Tensor | None = None  # static mode: write at this (1,) slot, attend over the first `span` slots
        self.span = 0  # static mode: slots attention covers, a bucket >= length + 1 (graphs.span_bucket)

    @classmethod
    def for_model(cls, model: Transformer, batch: int, max_len: int) -> KVCache:
        c, dev = model.config, model.lm_head.weight.device
        # under autocast the keys/values arrive in the autocast dtype: store them in it (a meta model: its own)
        autocast = dev.type != "meta" and torch.is_autocast_enabled(dev.type)
        dtype = torch.get_autocast_dtype(dev.type) if autocast else model.lm_head.weight.dtype
        attention = [i for i in range(c.num_hidden_layers) if c.mixer(i) == "full_attention"]
        linear = [i for i in range(c.num_hidden_layers) if c.mixer(i) == "linear_attention"]
        state = None
        if linear:
            D = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            dv = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
            state = (linear, (D, c.linear_conv_kernel_dim - 1), dv)
        kv = (len(attention), batch, c.num_key_value_heads, max_len, c.head_dim)
        return cls(*kv, dtype=dtype, device=dev, layers=attention, state=state)

    @property
    def nbytes(self) -> int:
        states = sum(t.numel() * t.element_size() for t in (self.conv, self.ssm) if t is not None)
        return 2 * self.k.numel() * self.k.element_size() + self.key_valid.numel() + states

    def state(self, layer_idx: int, b: int) -> tuple[Tensor, Tensor]:
        """A DeltaNet layer's state of the first b rows: its convolution window (b, D, K-1) and S (b, Hv, dk, dv)."""
        j = self.state_index[layer_idx]
        return self.conv[j, :b], self.ssm[j, :b]

    def set_state(self, layer_idx: int, conv: Tensor, S: Tensor) -> None:
        j = self.state_index[layer_idx]
        self.conv[j, : len(conv)].copy_(conv)  # in place: the buffers a static step reads stay where they are
        self.ssm[j, : len(S)].copy_(S)

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new k, v (b, Hkv, T, hd) of one layer; return all keys/values (b, Hkv, S, hd)."""
        b, T, layer_idx = k.shape[0], k.shape[2], self.kv_index[layer_idx]
        if self.slot is not None:  # static shapes (graphs, compiled decode): in-place write, `span` slots wide
            k_all, v_all = self.k[layer_idx, :b, :, : self.span], self.v[layer_idx, :b, :, : self.span]
            k_all.index_copy_(2, self.slot, k)
            v_all.index_copy_(2, self.slot, v)
            return k_all, v_all
        s = self.length
        k_all, v_all = self.k[layer_idx, :b, :, : s + T], self.v[layer_idx, :b, :, : s + T]
        k_all[:, :, s:] = k  # written through the views returned: fewer view ops in the decode step
        v_all[:, :, s:] = v
        return k_all, v_all

    def reorder(self, perm: Tensor) -> None:
        """Permute the first len(perm) cache rows: new row i = old row perm[i]."""
        b, s = len(perm), self.length
        self.k[:, :b, :, :s] = self.k[:, perm, :, :s]
        self.v[:, :b, :, :s] = self.v[:, perm, :, :s]
        if self.conv is not None:
            self.conv[:, :b], self.ssm[:, :b] = self.conv[:, perm], self.ssm[:, perm]
        for name in ("key_valid", "next_pos", "rows"):
            getattr(self, name)[:b] = getattr(self, name)[perm]

    def compact(self, alive: Tensor) -> Tensor:
        """Move the live active rows first and make only them active; returns the permutation."""
        perm = torch.cat([alive.nonzero()[:, 0], (~alive).nonzero()[:, 0]])
        self.reorder(perm)
        self.batch = int(alive.sum())
        return perm

    def restore_order(self) -> None:
        """Make every row active again, in the caller's row order (undoes compactions)."""
        self.batch = len(self.rows)
        if not torch.equal(self.rows, torch.arange(len(self.rows), device=self.rows.device)):
            self.reorder(torch.argsort(self.rows))

    def fork(self, rows: Tensor, max_len: int) -> KVCache:
        """A new cache of len(rows) rows; row i copies the caller's row rows[i] (prefix sharing)."""
        src, s, (L, _, Hkv, _, hd) = torch.argsort(self.rows)[rows], self.length, self.k.shape
        layers, state = list(self.kv_index), None
        if self.conv is not None:  # a state is copied whole: forking a thought into M answers costs its size
            state = (list(self.state_index), self.conv.shape[2:], self.ssm.shape[2:])
        new = KVCache(
            L, len(rows), Hkv, max_len, hd, dtype=self.k.dtype, device=self.k.device, layers=layers, state=state
        )
        if state is not None:
            new.conv[:], new.ssm[:] = self.conv[:, src], self.ssm[:, src]
        new.k[:, :, :, :s] = self.k[:, src, :, :s]
        new.v[:, :, :, :s] = self.v[:, src, :, :s]
        new.key_valid[:, :s] = self.key_valid[src, :s]
        new.next_pos[:] = self.next_pos[src]
        new.length = s
        return new


def chunk_mask(key_valid: Tensor, T: int) -> Tensor:
    """Attention mask (b, 1, T, S) for the last T of S key slots as queries: bottom-right causal
    over valid keys (never is_causal: earlier slots may hold cached keys); a padding query sees
    only itself, so no row is fully masked."""
    S = key_valid.shape[1]
    q = torch.arange(S - T, S, device=key_valid.device)[:, None]
    kpos = torch.arange(S, device=key_valid.device)[None, :]
    return ((key_valid[:, None, :] | (kpos == q)) & (kpos <= q))[:, None]


def extend(model: Transformer, cache: KVCache, ids: Tensor, valid: Tensor, logits_to_keep: int = 1) -> Tensor:
    """Append a chunk ids (b, T) to the active cache rows; valid (b, T) is False for left padding
    and for finished rows. Returns logits (b, logits_to_keep, V) in the model dtype."""
    b, T = ids.shape
    s = cache.length
    cache.key_valid[:b, s : s + T] = valid
    positions = cache.next_pos[:b, None] + (valid.cumsum(1) - 1).clamp(min=0)  # (b, T); pads: junk
    mask = chunk_mask(cache.key_valid[:b, : s + T], T)
    logits = model(ids, positions=positions, cache=cache, attn_mask=mask, logits_to_keep=logits_to_keep, valid=valid)
    cache.length += T
    cache.next_pos[:b] += valid.sum(1)
    return logits


def prefill(model: Transformer, prompts: list[list[int]]) -> tuple[KVCache, Tensor]:
    """Run the left-padded prompts through the model once (one batch: padding costs compute when
    lengths differ a lot); returns their cache and the logits (P, V) of each prompt's next token."""
    P, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(P, T, dtype=torch.long)
    valid = torch.zeros(P, T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        valid[i, T - len(p) :] = True
    cache = KVCache.for_model(model, P, T)
    dev = cache.k.device
    return cache, extend(model, cache, ids.to(dev), valid.to(dev))[:, -1]


def additive_mask(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """A decode step's attention mask (b, 1, 1, S) in `dtype`: 0 at the valid slots of valid (b, S), -inf at holes.
    Built once per step for every layer: given a boolean mask, SDPA builds this same one in each layer (zeros, then
    -inf where masked), so the outputs are bit for bit those of the boolean mask."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))[:, None, None]


def decode_step(model: Transformer, cache: KVCache, tok: Tensor, alive: Tensor) -> Tensor:
    """Feed one token (b,) per active row; returns the logits (b, V) of each row's next token.
    extend() for T = 1, minus the ops a single query does not need (the hot path)."""
    b, s = len(tok), cache.length
    cache.key_valid[:b, s] = alive  # a finished row's slot is a hole
    mask = additive_mask(cache.key_valid[:b, : s + 1], cache.k.dtype)  # one query needs no causal part
    logits = model(tok[:, None], positions=cache.next_pos[:b, None], cache=cache, attn_mask=mask, valid=alive[:, None])
    cache.length += 1
    cache.next_pos[:b] += alive
    return logits[:, -1]


def decode_step_static(model: Transformer, cache: KVCache, tok: Tensor, alive: Tensor) -> Tensor:
    """decode_step with static shapes (what graphs.py captures as a CUDA graph, or torch.compile traces): the
    first b = len(tok) cache rows, the write slot a tensor, attention over the first cache.span slots (unwritten
    slots are invalid). Only b and span decide the shapes, and graphs.py buckets both."""
    b = len(tok)
    valid = cache.key_valid[:b, : cache.span]  # (b, span)
    valid.index_copy_(1, cache.slot, alive[:, None])
    # A mask rules out the flash backend: under capture SDPA runs mem-efficient or cuDNN (plans built in the warm-up),
    # or math (slow: many kernels, float32 scores; bench/gpu_check.sh's profile shows which). No row is ever fully
    # masked (a padding row attends to slot 0, graphs.py; a prompt has a valid token), so no row's softmax is NaN.
    mask = additive_mask(valid, cache.k.dtype)
    logits = model(tok[:, None], positions=cache.next_pos[:b, None], cache=cache, attn_mask=mask, valid=alive[:, None])
    cache.next_pos[:b] += alive
    return logits[:, -1]


# -----------------------------------------------------------------------------
# Training: shared prompts, run once for the rows that continue them


class PromptKV:
    """KV-cache stand-in for the shared-prompt forward: records each layer's keys/values of the
    prompts (keeping their autograd graph), and a hybrid's DeltaNet layers' states after them; `rows(prompt_of)`
    then serves the completion rows, prepending their prompt's keys/values to their own and starting each
    DeltaNet layer from its prompt's state."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v

    def state(self, layer_idx: int, batch: int) -> None:
        return None  # the prompts start from the empty state

    def set_state(self, layer_idx: int, conv: torch.Tensor, S: torch.Tensor) -> None:
        self.states[layer_idx] = conv, S

    def rows(self, prompt_of: torch.Tensor) -> PromptRows:
        return PromptRows(self, prompt_of)


@dataclass
class PromptRows:
    prompts: PromptKV
    prompt_of: torch.Tensor

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select, not x[prompt_of]: rows repeat prompt indices, and the backward of advanced indexing
        # (index_put with accumulate) sums repeats with racy atomic adds on a multi-threaded CPU, so two
        # runs would differ in the last bits; index_select's backward (index_add_) sums in a fixed order.
        pk = self.prompts.k[layer_idx].index_select(0, self.prompt_of)
        pv = self.prompts.v[layer_idx].index_select(0, self.prompt_of)
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)

    def state(self, layer_idx: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.index_select(0, self.prompt_of) for t in self.prompts.states[layer_idx])

    def set_state(self, layer_idx: int, conv: torch.Tensor, S: torch.Tensor) -> None:
        pass  # nothing continues the rows


class TrunkKV(PromptKV):
    """PromptKV of a hybrid's tree trunks (tree_hidden), which continue their shared prompts (`prompts`, its rows)
    or, without one, nothing."""

    def __init__(self, prompts: PromptRows | None) -> None:
        super().__init__()
        self.prompts = prompts

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (k, v) if self.prompts is None else self.prompts.update(layer_idx, k, v)
        return super().update(layer_idx, k, v)

    def state(self, layer_idx: int, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.prompts is None else self.prompts.state(layer_idx, batch)


@dataclass
class Prompts:
    """Shared prompts after their pass: each layer's keys and values and each DeltaNet layer's state (kv), the last
    position's hidden state (first, (P, C): it predicts each row's first token) and the keys' validity (P, Lp)."""

    kv: PromptKV
    first: torch.Tensor
    valid: torch.Tensor
    leaves: Prompts | None = None  # the same values cut from the pass's graph: what micro-batches before the last read

    def tensors(self) -> list[torch.Tensor]:
        states = [t for pair in self.kv.states.values() for t in pair]
        return [self.first, *self.kv.k.values(), *self.kv.v.values(), *states]

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() of the last micro-batch that reads these prompts, and in the same call their pass's
        backward, given what the earlier micro-batches sent to the leaves and what this one sends."""
        pairs = [(t, leaf.grad) for t, leaf in zip(self.tensors(), self.leaves.tensors()) if leaf.grad is not None]
        torch.autograd.backward([loss, *(t for t, _ in pairs)], [None, *(g for _, g in pairs)])

    def cut(self) -> Prompts:
        """These prompts with leaves: the same values cut from the pass's graph (gradients sum in their .grad)."""
        leaves = iter([t.detach().requires_grad_(t.requires_grad) for t in self.tensors()])
        kv, first = PromptKV(), next(leaves)
        kv.k, kv.v = ({i: next(leaves) for i in d} for d in (self.kv.k, self.kv.v))
        kv.states = {i: (next(leaves), next(leaves)) for i in self.kv.states}
        return Prompts(kv, first, self.valid)


def prompt_pass(model, ids: torch.Tensor, valid: torch.Tensor, leaves: bool = False, vocab_grads=None) -> Prompts:
    """Each shared prompt once (ids, valid (P, Lp), left-padded), recording its keys/values (a hybrid's states too).
    It runs on the unwrapped module (DDP: the wrapper sees one forward per backward). Its last hidden state predicts
    each row's token 0; that use also keeps every layer's output in the backward graph, which FSDP2 needs (it
    re-gathers a layer's weights when its output's gradient arrives). leaves: with `leaves` (Prompts.cut).
    vocab_grads: the trainer's step sum of the embedding's gradient (model.VocabGrads)."""
    kv, mask = PromptKV(), chunk_mask(valid, valid.shape[1])
    kw = dict(cache=kv, attn_mask=mask, logits_to_keep=1, hidden=True, valid=valid, vocab_grads=vocab_grads)
    first = getattr(model, "module", model)(ids, positions=(valid.cumsum(1) - 1).clamp(min=0), **kw)[:, 0]
    prompts = Prompts(kv, first, valid)
    prompts.leaves = prompts.cut() if leaves else None
    return prompts
