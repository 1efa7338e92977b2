"""logprobs.py: the one log-prob formula, log_softmax(logits.float() / temperature) at the targets, on logits that
exist (the sampler's rows: token_logprobs) and through lm_head a slice of the vocabulary at a time (the trainer:
head_logprobs, which never holds (tokens, V) logits, in forward or backward); the entropy beside it.
"""

import torch
import torch.nn as nn
from torch import Tensor

from model import VocabGrads


def _logp_lse(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """THE log-prob formula: x = logits.float() / temperature, logp = x[target] - logsumexp(x).
    logits (n, V), targets (n,) -> logp (n,), logsumexp (n,), float32. Every log-prob in the repo
    (sampler, trainer, eval) is this function applied to some rows of logits."""
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def _entropy(x: Tensor, lse: Tensor | None = None) -> Tensor:
    """Entropy of softmax(x), x = logits.float() / temperature: H = logsumexp(x) - sum p x. (n, V) -> (n,)"""
    lse = torch.logsumexp(x, dim=-1) if lse is None else lse
    p = torch.softmax(x, dim=-1)
    return lse - (p * x if torch.is_grad_enabled() and x.requires_grad else p.mul_(x)).sum(-1)  # no copy without grad


def _check_temperature(name: str, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}.")


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """log_softmax(logits.float() / temperature) at targets: logits (..., V), targets (...) long -> float32 (...), in
    row chunks (one chunk's float32 copy at a time, ~64 MB by default). For logits that already exist (the sampler's
    (B, V) rows); training goes through `head_logprobs` instead, which never builds them."""
    _check_temperature("token_logprobs", temperature)
    fn = lambda x, t: _logp_lse(x, t, temperature)[0]  # noqa: E731 (n, V), (n,) -> (n,)
    return _chunked(fn, logits, targets, chunk_rows).view(targets.shape)


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """Entropy of softmax(logits.float() / temperature): logits (..., V) -> float32 (...), in row chunks."""
    _check_temperature("token_entropy", temperature)
    return _chunked(lambda x, _: _entropy(x.float() / temperature), logits, None, chunk_rows).view(logits.shape[:-1])


def _chunked(fn, logits: Tensor, targets: Tensor | None, chunk_rows: int | None) -> Tensor:
    """fn(rows of logits (n, V), their targets) over row chunks of the flattened logits, concatenated (N,)."""
    x = logits.reshape(-1, logits.shape[-1])
    t = x if targets is None else targets.reshape(-1)  # no targets (the entropy): fn gets the rows twice
    step = chunk_rows or max(1, 2**24 // x.shape[-1])
    return torch.cat([fn(x[i : i + step], t[i : i + step]) for i in range(0, len(x), step)] or [x.new_empty(0)]).float()


def _slice_targets(targets: Tensor, start: int, cols: int) -> tuple[Tensor, Tensor]:
    """Where the targets (n,) fall in the vocabulary slice [start, start + cols): their column there (clamped into
    it: a target outside reads or writes a column it then ignores) and whether they do."""
    col = targets - start
    return col.clamp(0, cols - 1), (col >= 0) & (col < cols)


def _logit_grad(x: Tensor, lse: Tensor, col: Tensor, g_t: Tensor, g: Tensor, temperature: float, dtype, entropy=None):
    """g * d logp / d logits = g (onehot(target) - softmax(x)) / temperature on one slice, x = its logits.float() /
    temperature (n, cols), overwritten: the (n, cols) result, in the matmul dtype. lse, g (n,): the whole row's
    logsumexp and gradient; g_t (n,): g where the target is in the slice (at its column col), else 0. entropy: (its
    incoming gradient, H) (n,) each: adds the entropy's, dH/dx = -p (log p + H), times that gradient."""
    log_p = x.sub_(lse[:, None])
    if entropy is None:
        d = log_p.exp_().mul_(-g[:, None])  # -g * softmax(x), in place
    else:
        g_ent, H = entropy
        p = log_p.exp()
        d = p * -g[:, None] - g_ent[:, None] * p * (log_p + H[:, None])
    d.scatter_add_(1, col[:, None], g_t[:, None])  # + g at the target: g * (onehot - softmax)
    return d.div_(temperature).to(dtype)


class _HeadLogprobs(torch.autograd.Function):
    """logp = _logp_lse(hidden @ weight.T, targets), the vocabulary a slice at a time: every token's logits for `cols`
    words (~64 MB), each slice's logsumexp (and entropy) kept (n, slices), combined at the end, as flash attention
    combines its key blocks. The backward recomputes each slice's logits and applies d logp / d logits = (onehot(target)
    - softmax(x)) / temperature by hand: it saves only the (N,) logsumexp and adds weight's gradient, slice by slice,
    into ONE float32 buffer (a model.VocabGrads: one per step).

    Slices of the vocabulary, not chunks of tokens: with a 152k-248k vocabulary, 64 MB of logits hold 33-110 tokens,
    and each such chunk reads the (V, C) weight twice and reads and writes its (V, C) gradient: thin products, bound by
    memory. A slice's products are (N, C) x (C, cols), their transposes, and its gradient's rows are written once. The
    cost is a product more: the forward's logits are computed again in the backward (4 to a token chunk's 3 when its
    backward ran in its forward). With one slice (cols >= V) every value is the one the unsliced formulas give, bit
    for bit: the combination of one slice is exact."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, dtype, cols, want_entropy, entropy_grad, acc):
        w, h = weight.to(dtype), hidden.to(dtype)  # (V, C) in the matmul dtype, cast once (as autocast's cache does)
        picked, lses, ents = torch.zeros_like(targets, dtype=torch.float32), [], []
        for j in range(0, w.shape[0], cols):
            # (N, cols): the only logits alive, divided in place (under autocast a float32 copy, the bf16 ones freed)
            x = (h @ w[j : j + cols].T).float().div_(temperature)
            col, inside = _slice_targets(targets, j, x.shape[1])
            picked = torch.where(inside, x.gather(1, col[:, None])[:, 0], picked)  # each target's x, in its slice
            lses.append(torch.logsumexp(x, dim=-1))
            if want_entropy:
                ents.append(_entropy(x, lses[-1]))
        part = torch.stack(lses, 1)  # (N, slices): log of each slice's sum of exp(x)
        lse = torch.logsumexp(part, dim=-1)
        logp, ent = picked - lse, picked.new_empty(0)
        if want_entropy:  # H = sum_j q_j (H_j - log q_j), q_j = each slice's share of the probability
            log_q = part - lse[:, None]
            ent = (log_q.exp() * (torch.stack(ents, 1) - log_q)).sum(-1)
        ctx.save_for_backward(hidden, w, targets, lse, ent if entropy_grad else lse.new_empty(0))
        ctx.temperature, ctx.dtype, ctx.cols, ctx.weight_dtype = temperature, dtype, cols, weight.dtype
        ctx.entropy_grad, ctx.acc = entropy_grad, acc or VocabGrads(last=True)  # no step's buffer: its own
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, w, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        h, T = hidden.to(ctx.dtype), ctx.temperature
        g_h, g_w = None, ctx.acc.head_buffer(w) if need_w else None  # g_h: float32, summed over the slices
        for j in range(0, w.shape[0], ctx.cols):
            w_j = w[j : j + ctx.cols]
            x = (h @ w_j.T).float().div_(T)  # (N, cols): the forward's x, recomputed
            col, inside = _slice_targets(targets, j, x.shape[1])
            g_t = torch.where(inside, g_logp, 0.0)
            d = _logit_grad(x, lse, col, g_t, g_logp, T, ctx.dtype, (g_ent, ent) if ctx.entropy_grad else None)
            if need_h:
                g_h = (d @ w_j).float() if g_h is None else g_h.add_(d @ w_j)
            if g_w is not None:  # this slice's rows of the weight's gradient, float32
                g_w[j : j + ctx.cols].addmm_(d.T, h) if d.dtype == g_w.dtype else g_w[j : j + ctx.cols].add_(d.T @ h)
        g_w = ctx.acc.take_head() if need_w else None
        g_h = None if g_h is None else g_h.to(hidden.dtype)
        return g_h, None if g_w is None else g_w.to(ctx.weight_dtype), None, None, None, None, None, None, None


def head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk_vocab: int | None = None,
    vocab_grads: VocabGrads | None = None,
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs(lm_head(hidden), targets, temperature) without ever holding more than one
    slice of logits, in forward or backward (at a 152k vocabulary the logits would be the largest
    tensor of a training step).

    head: the Transformer (its lm_head is used) or the lm_head Linear. hidden (..., C), e.g. from
    `model(ids, hidden=True)`; targets (...) long. Returns logp (...) float32, differentiable
    w.r.t. hidden and lm_head.weight (a tied embedding included), and, if entropy, the entropy of
    softmax(logits / temperature) (...) float32, else None; without grad unless entropy_grad (an entropy bonus:
    the backward then adds the entropy's gradient, -p (log p + H) / temperature per logit, slice by slice). Under
    autocast the matmul runs in the autocast dtype, the log-softmax in float32, as `token_logprobs(model(ids))`
    would.
    chunk_vocab: words per slice, default 2**24 // tokens (~64 MB of float32 logits; all of them for few tokens).
    vocab_grads: the step's model.VocabGrads: the weight's gradient sums there, returned by the last micro-batch."""
    _check_temperature("head_logprobs", temperature)
    lm_head = getattr(head, "lm_head", head)
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("head_logprobs: lm_head has a bias; only bias-free heads are supported.")
    weight = lm_head.weight  # (V, C)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    C = hidden.shape[-1]
    h, t = hidden.reshape(-1, C), targets.reshape(-1)
    cols = chunk_vocab or max(1, 2**24 // max(1, len(t)))
    with torch.autocast(dev, enabled=False):  # dtypes are explicit inside
        logp, ent = _HeadLogprobs.apply(h, weight, t, temperature, dtype, cols, entropy, entropy_grad, vocab_grads)
    return logp.view(targets.shape), ent.view(targets.shape) if entropy else None
