"""deltanet.py: the Gated DeltaNet layer of Qwen3.5/3.6's hybrid models (Yang et al., "Gated Delta Networks",
arXiv 2412.06464): linear attention whose memory is a fixed-size matrix per head instead of a KV cache.

Per token t and value head, with state S (dk, dv), L2-normalised key k_t and query q_t (scaled by dk^-1/2):

    S_t = exp(g_t) S_{t-1}                        the decay gate, g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T    the delta rule: write what S does not yet predict, at rate beta_t
    o_t = S_t^T q_t

q, k and v come from one projection through a causal depthwise convolution (kernel 4) and SiLU; the output is
RMS-normalised per head, gated by SiLU(z) and projected back. Two forms compute the same thing:
`recurrent_delta_rule`, one token at a time (decoding), and `chunked_delta_rule`, 64 tokens at a time with the
within-chunk part as matmuls (prefill and training: the WY/UT form, one triangular solve per chunk).

A layer's state is (conv, S): the last kernel-1 inputs of the convolution (B, D, K-1) in the model dtype and the
matrices (B, Hv, dk, dv) in float32. A token whose `valid` is False (left padding, a finished row, padding between
a row's turns) is skipped: the state and the convolution's window pass over it unchanged. In the chunked form each
row's valid tokens are first moved to the front, in order (`compact`): the layer then sees each row's own tokens
contiguously, whatever the padding, and a prefill equals one without padding.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and the reference kernels')


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """q, k (B, H, T, dk), v (B, H, T, dv), g, beta (B, H, T), S (B, H, dk, dv), all float32 -> outputs
    (B, H, T, dv) and the final state: the rule above, token by token."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]  # (B, H, dv)
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return out, S


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """recurrent_delta_rule over chunks of CHUNK tokens. Within a chunk, the writes of the delta rule solve a unit
    lower-triangular system T (T[i, j] = beta_i k_i.k_j decayed from j to i, for j < i): u = T^-1 (beta v) are the
    values to write and w = T^-1 (beta k, decayed from the chunk's start) what the chunk's start state predicts of
    them. Each chunk then costs matmuls, and one step of a scan over chunks carries S. The tail is padded with
    g = beta = 0 tokens, which leave S unchanged."""
    T, C = q.shape[2], CHUNK
    pad = -T % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.unflatten(2, (-1, C)) for x in (q, k, v))  # (B, H, N, C, d)
    g, beta = (x.unflatten(2, (-1, C)) for x in (g, beta))  # (B, H, N, C)
    gc = g.cumsum(-1)  # log decay from the chunk's start to each token
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (.., C, C): i <- j
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]  # its strict lower part; the diagonal is 1
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(system)
    # T^-1 once (64 right-hand sides), then the two right-hand sides are matmuls: cheaper than solving for them,
    # in backward too; beta, and the decay from the chunk's start, scale T^-1's columns instead of v's and k's rows
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    inverse = inverse * beta[..., None, :]  # T^-1 diag(beta)
    u = inverse @ v
    w = (inverse * gc[..., None, :].exp()) @ k
    within = (q @ k.transpose(-1, -2)) * decay  # (.., C, C): token i reads what token j <= i wrote
    q_from_start = q * gc[..., None].exp()
    k_to_end = (k * (gc[..., -1:] - gc)[..., None].exp()).transpose(-1, -2)  # (.., dk, C)
    chunk_decay = gc[..., -1, None, None].exp()  # (B, H, N, 1, 1)
    out = []  # unbind and stack: autograd then gathers each chunk's gradient once, not a zero-filled copy per chunk
    for q_n, w_n, u_n, within_n, k_n, decay_n in zip(
        *(x.unbind(2) for x in (q_from_start, w, u, within, k_to_end, chunk_decay))
    ):
        new = u_n - w_n @ S  # what the chunk writes, less what S already predicts
        out.append(q_n @ S + within_n @ new)
        S = S * decay_n + k_n @ new
    return torch.stack(out, 2).flatten(2, 3)[:, :, :T], S


def compact(valid: Tensor) -> Tensor:
    """(B, T) bool -> (B, T) the permutation of each row that puts its valid positions first, in order."""
    return torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight * x, the plain form), then times SiLU(z), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a "linear_attention" layer. Parameter names are the checkpoint's (linear_attn.*)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.Hk, self.Hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        C, kd, vd = config.hidden_size, self.Hk * self.dk, self.Hv * self.dv
        self.split = (kd, kd, vd)
        D, K = 2 * kd + vd, config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(C, D, bias=False)
        self.in_proj_z = nn.Linear(C, vd, bias=False)
        self.in_proj_b = nn.Linear(C, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(C, self.Hv, bias=False)
        self.conv1d = nn.Conv1d(D, D, K, groups=D, bias=False)  # weight (D, 1, K): depthwise, causal by padding
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.empty(self.Hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(vd, C, bias=False)

    def new_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """The state before any token: zeros (conv (B, D, K-1) in `dtype`, S (B, Hv, dk, dv) in float32)."""
        D, K = self.conv1d.weight.shape[0], self.conv1d.weight.shape[2]
        conv = torch.zeros(batch, D, K - 1, dtype=dtype, device=device)
        return conv, torch.zeros(batch, self.Hv, self.dk, self.dv, dtype=torch.float32, device=device)

    def forward(self, x: Tensor, cache=None, valid: Tensor | None = None) -> Tensor:
        """x (B, T, C) -> (B, T, C). cache: an object with `state(layer_idx, B)` -> (conv, S), or None for the
        state before any token, and `set_state(layer_idx, conv, S)`, given the state after these tokens (no cache:
        start from zeros, keep nothing). valid (B, T) bool: tokens to skip are False (None: every token counts)."""
        return self.out_proj(self.mix(x, cache, valid))

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The four input projections of x (B, T, C): qkv (B, T, D) for the convolution, z (B, T, Hv dv) for the
        output's gate, b and a (B, T, Hv) for the write rate and the decay (fused.py runs them as one matmul)."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def mix(self, x: Tensor, cache=None, valid: Tensor | None = None) -> Tensor:
        """forward before out_proj: the gated, normed output of the delta rule (B, T, Hv dv)."""
        B, T, _ = x.shape
        state = cache.state(self.layer_idx, B) if cache is not None else None
        conv, S = state if state is not None else self.new_state(B, x.dtype, x.device)
        if valid is not None and T > 1 and valid.all():  # nothing to skip: as without `valid`, and no sorting
            valid = None
        order = None
        if valid is not None and T > 1:  # each row's valid tokens first: the rule runs over them contiguously
            order = compact(valid)
            x, valid = x.gather(1, order[..., None].expand_as(x)), valid.gather(1, order)
        xt, z, b, a = self.project(x)
        xt = xt.transpose(1, 2)  # (B, D, T)
        window = torch.cat([conv.to(xt.dtype), xt], 2)  # (B, D, K-1 + T): the last K-1 inputs, then these
        qkv = F.silu(F.conv1d(window, self.conv1d.weight.to(xt.dtype), groups=xt.shape[1])).transpose(1, 2)
        q, k, v = qkv.split(self.split, -1)
        q, k = (t.unflatten(-1, (self.Hk, self.dk)) for t in (q, k))
        if self.Hv > self.Hk:  # each key head serves Hv / Hk consecutive value heads
            q, k = q.repeat_interleave(self.Hv // self.Hk, 2), k.repeat_interleave(self.Hv // self.Hk, 2)
        q, k = l2norm(q.float()) * self.dk**-0.5, l2norm(k.float())
        v = v.unflatten(-1, (self.Hv, self.dv)).float()
        beta = b.sigmoid().float()  # (B, T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        K1 = window.shape[2] - T
        if valid is None:
            conv = window[:, :, T:]
        else:  # a skipped token writes nothing and decays nothing; the window keeps its last K-1 valid inputs
            beta, g = beta * valid[..., None], g * valid[..., None]
            n = valid.sum(1)  # valid tokens are each row's first n (compacted) or the one token (T == 1)
            idx = (n[:, None] + torch.arange(K1, device=x.device)).expand(B, -1)[:, None].expand(-1, xt.shape[1], -1)
            conv = window.gather(2, idx)
        rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
        q, k, v, g, beta = (t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta))  # (B, H, T, ...)
        y, S = rule(q, k, v, g, beta, S)
        if cache is not None:
            cache.set_state(self.layer_idx, conv, S)
        y = y.transpose(1, 2).to(x.dtype)  # (B, T, Hv, dv)
        y = self.norm(y.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(B, T, -1)  # per head
        if order is not None:  # back to the caller's positions
            y = y.gather(1, torch.argsort(order, dim=1)[..., None].expand_as(y))
        return y
