"""logprobs.py: the one log-prob formula, log_softmax(logits.float() / temperature) at the targets, on logits that
exist (the sampler's rows: token_logprobs) and through lm_head chunk by chunk (the trainer: head_logprobs, which
never holds (tokens, V) logits, in forward or backward); the entropy beside it.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

from model import VocabGrads


def _logp_lse(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """THE log-prob formula: x = logits.float() / temperature, logp = x[target] - logsumexp(x).
    logits (n, V), targets (n,) -> logp (n,), logsumexp (n,), float32. Every log-prob in the repo
    (sampler, trainer, eval) is this function applied to some rows of logits."""
    return _logp_of_x(logits.float() / temperature, targets)


def _logp_of_x(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """_logp_lse on x = logits.float() / temperature, already scaled (the head's forward divides its own logits in
    place: no (n, V) copy)."""
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


def _logit_grad(x: Tensor, lse: Tensor, targets: Tensor, g: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """g * d logp / d logits = g (onehot(target) - softmax(x)) / temperature, x = logits.float() / temperature (n, V),
    overwritten: the (n, V) result, in the matmul dtype. lse, targets, g (n,)."""
    d = x.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g * softmax(x), in place
    d.scatter_add_(1, targets[:, None], g[:, None])  # + g at the target: g * (onehot - softmax)
    return d.div_(temperature).to(dtype)


def _add_grads(d: Tensor, h: Tensor, w: Tensor, g_h: Tensor | None, g_w: Tensor | None) -> None:
    """One chunk's share of the gradients: g_h (n, C) = d @ w, and d.T @ h added to g_w (V, C), float32 over chunks."""
    if g_h is not None:
        g_h.copy_(d @ w)
    if g_w is not None:
        if d.dtype == g_w.dtype:
            g_w.addmm_(d.T, h)  # in place: no (V, C) temporary per chunk
        else:  # autocast: the chunk's product in the matmul dtype, then added
            g_w += d.T @ h


def _chunk_grad(loss: Callable[[Tensor], Tensor], logp: Tensor, start: int, N: int) -> Tensor:
    """d loss / d logp[start : start + n] at these log-probs (n,), the other N - n log-probs replaced by zeros: their
    value is not known yet, and for a loss that is a sum of per-token terms of their own log-probs it does not matter.
    The loss runs on an (N,) vector of the real one's shape, so each token's gradient goes through the same kernels
    at the same position as in the real backward: bitwise the same value when the loss is token-separable."""
    with torch.enable_grad():
        x = logp.detach().requires_grad_()
        full = torch.cat([x.new_zeros(start), x, x.new_zeros(N - start - len(x))])
        return torch.autograd.grad(loss(full), x)[0]


class _HeadLogprobs(torch.autograd.Function):
    """logp = _logp_lse(hidden @ weight.T, targets) over row chunks; backward recomputes each chunk's logits and applies
    d logp / d logits = (onehot(target) - softmax(x)) / temperature by hand: it saves only the (N,) logsumexp, computes
    entropy once, and sums weight's gradient over the chunks in ONE float32 buffer (torch.utils.checkpoint per chunk
    would recompute the entropy and hand autograd one (V, C) gradient per chunk, in bf16 under autocast).

    With `loss` (the caller's loss as a function of the (N,) log-probs) the backward is done in the forward, a
    speculation (Liger-Kernel's fused linear losses do it by declaration): each chunk's logits give logp, then
    g = d loss / d logp for its tokens (_chunk_grad), d = g (onehot - softmax) / temperature and the chunk's gradients
    at once: 3 head matmuls per chunk instead of 4. The backward compares the gradient it receives with the g assumed
    (torch.equal): equal, it returns the gradients computed, bitwise those a recomputation gives; different (a loss
    whose per-token gradient depends on other tokens: a sequence ratio, a geometric mean), it frees them and
    recomputes. Exact for every loss, faster for a token-separable one. The gradient buffers the backward would
    allocate are allocated in the forward, its last op before the backward: the peak does not rise."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, dtype, step, want_entropy, entropy_grad, loss, acc):
        w = weight.to(dtype)  # (V, C) in the matmul dtype, cast once (as autocast's weight cache does)
        N = hidden.shape[0]
        logp = hidden.new_empty(N, dtype=torch.float32)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else logp.new_empty(0)
        ctx.spec, ctx.acc, ctx.own = None, acc or VocabGrads(last=True), acc is None  # no step's buffer: its own
        need_h, need_w = ctx.needs_input_grad[:2]
        if loss is not None and not entropy_grad and (need_h or need_w):  # g assumed (N,), the gradients it gives
            g_h = torch.empty_like(hidden) if need_h else None
            ctx.spec = (torch.empty_like(logp), g_h, ctx.acc.head_buffer(w) if need_w else None)
        for i in range(0, N, step):
            h, t = hidden[i : i + step].to(dtype), targets[i : i + step]
            # (n, V): the only logits alive, divided in place (under autocast a float32 copy, the bf16 ones freed)
            x = (h @ w.T).float().div_(temperature)
            logp[i : i + step], lse[i : i + step] = _logp_of_x(x, t)  # _logp_lse's values, without its copy
            if want_entropy:
                ent[i : i + step] = _entropy(x, lse[i : i + step])
            if ctx.spec is not None:
                g, g_h, g_w = ctx.spec
                g[i : i + step] = _chunk_grad(loss, logp[i : i + step], i, N)
                d = _logit_grad(x, lse[i : i + step], t, g[i : i + step], temperature, dtype)
                _add_grads(d, h, w, None if g_h is None else g_h[i : i + step], g_w)
        ctx.save_for_backward(hidden, w, targets, lse, ent if entropy_grad else lse.new_empty(0))
        ctx.temperature, ctx.dtype, ctx.step, ctx.weight_dtype = temperature, dtype, step, weight.dtype
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        spec, ctx.spec = ctx.spec, None
        need_h, need_w = ctx.needs_input_grad[:2]
        if spec is not None and torch.equal(g_logp, spec[0]):  # the speculation holds: the gradients are computed
            g_h = spec[1]
        else:
            if ctx.own:  # a miss frees this call's own buffers before the backward allocates its own: no higher peak
                ctx.acc.head = None
            elif spec is not None and spec[2] is not None:  # a miss with the step's buffer: the guess's share leaves it
                _head_backward(ctx, -spec[0], None, spec[2], False)
            del spec
            g_w = ctx.acc.head_buffer(ctx.saved_tensors[1]) if need_w else None
            g_h = _head_backward(ctx, g_logp, g_ent, g_w, need_h)
        g_w = ctx.acc.take_head() if need_w else None
        return g_h, None if g_w is None else g_w.to(ctx.weight_dtype), None, None, None, None, None, None, None, None


def _head_backward(ctx, g_logp: Tensor, g_ent: Tensor | None, g_w: Tensor | None, need_h: bool) -> Tensor | None:
    """_HeadLogprobs' backward, recomputing each chunk's logits: hidden's gradient (None if not need_h), and the
    weight's added into g_w (float32 (V, C); None: not needed)."""
    hidden, w, targets, lse, ent = ctx.saved_tensors
    g_h = torch.empty_like(hidden) if need_h else None
    for i in range(0, hidden.shape[0], ctx.step):
        h, t, g = hidden[i : i + ctx.step].to(ctx.dtype), targets[i : i + ctx.step], g_logp[i : i + ctx.step]
        x = (h @ w.T).float().div_(ctx.temperature)  # (n, V): the forward's x, recomputed
        if ctx.entropy_grad:  # dH/dx = -p (log p + H), times the entropy's incoming gradient
            log_p = x.sub_(lse[i : i + ctx.step, None])
            p = log_p.exp()
            e = g_ent[i : i + ctx.step, None]
            d = p * -g[:, None] - e * p * (log_p + ent[i : i + ctx.step, None])
            d.scatter_add_(1, t[:, None], g[:, None])  # + g at the target
            d = d.div_(ctx.temperature).to(ctx.dtype)
        else:
            d = _logit_grad(x, lse[i : i + ctx.step], t, g, ctx.temperature, ctx.dtype)
        _add_grads(d, h, w, None if g_h is None else g_h[i : i + ctx.step], g_w)
    return g_h


def head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    loss: Callable[[Tensor], Tensor] | None = None,
    vocab_grads: VocabGrads | None = None,
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs(lm_head(hidden), targets, temperature) without ever holding more than one
    chunk of logits, in forward or backward (at a 152k vocabulary the logits would be the largest
    tensor of a training step).

    head: the Transformer (its lm_head is used) or the lm_head Linear. hidden (..., C), e.g. from
    `model(ids, hidden=True)`; targets (...) long. Returns logp (...) float32, differentiable
    w.r.t. hidden and lm_head.weight (a tied embedding included), and, if entropy, the entropy of
    softmax(logits / temperature) (...) float32, else None; without grad unless entropy_grad (an entropy bonus:
    the backward then adds the entropy's gradient, -p (log p + H) / temperature per logit, chunk by chunk). Under
    autocast the matmul runs in the autocast dtype, the log-softmax in float32, as `token_logprobs(model(ids))`
    would.
    chunk_tokens: rows per chunk, default 2**24 // V (~64 MB of float32 logits), with loss half that.
    loss: the scalar the caller will back-propagate, as a function of the returned logp (a tensor of its shape),
    when it is a sum of per-token terms of their own log-probs (GRPO's clipped surrogate, a KL): the backward is then
    done in the forward, 3 head matmuls per chunk instead of 4, and checked in the backward (_HeadLogprobs: exact for
    any loss, a loss that is not token-separable only costs the work). Ignored with entropy_grad.
    vocab_grads: the step's model.VocabGrads: the weight's gradient sums there, returned by the last micro-batch."""
    _check_temperature("head_logprobs", temperature)
    lm_head = getattr(head, "lm_head", head)
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("head_logprobs: lm_head has a bias; only bias-free heads are supported.")
    weight = lm_head.weight  # (V, C)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    # fused, half: beside the (V, C) gradient buffer its forward holds x and logsumexp's (or softmax's) temporary,
    # twice the one (n, V) tensor the plain backward holds beside it; half the rows keep the peak where it was
    step = chunk_tokens or max(1, (2**23 if loss else 2**24) // weight.shape[0])
    C = hidden.shape[-1]
    flat = loss and (lambda x: loss(x.view(targets.shape)))  # of the (N,) log-probs
    h, t, sums = hidden.reshape(-1, C), targets.reshape(-1), vocab_grads
    with torch.autocast(dev, enabled=False):  # dtypes are explicit inside
        logp, ent = _HeadLogprobs.apply(h, weight, t, temperature, dtype, step, entropy, entropy_grad, flat, sums)
    return logp.view(targets.shape), ent.view(targets.shape) if entropy else None
