"""The policy model: a Llama / Qwen2 / Qwen3 decoder in plain PyTorch, HF checkpoint load/save,
the one log-prob formula (on logits for the sampler, through lm_head chunk by chunk for the
trainer), and the tokenizer with hand-written chat templates.

Parameter names equal the Hugging Face checkpoint keys, so loading is a strict name-by-name copy.
The model holds no KV cache: the sampler owns one and passes it into `forward`, so the same module
serves training (full causal forward) and sampling (prefill/decode against a cache).
"""

import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")  # config.json torch_dtype values we read and write
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} is supported
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' Parameter
    attention_bias: bool = False  # q/k/v bias (Qwen2: always True)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    model_type: str = "qwen2"  # "llama" | "mistral" | "qwen2" | "qwen3"
    max_position_embeddings: int = 4096  # informational: no tensor depends on it
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"  # dtype the checkpoint stores its weights in: save_model's default

    def __post_init__(self) -> None:
        # Validate, never rewrite: a config that transformers would build differently is an error.
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"ModelConfig: model_type {self.model_type!r} is not one of {sorted(ARCHITECTURES)}.")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("ModelConfig: model_type 'qwen2' always has q/k/v bias; set attention_bias=True.")
        if self.model_type == "mistral" and self.attention_bias:
            raise ValueError("ModelConfig: model_type 'mistral' has no q/k/v bias; use 'llama' for a biased model.")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError("ModelConfig: qk_norm must be True exactly when model_type is 'qwen3'.")
        if self.torch_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"ModelConfig: torch_dtype {self.torch_dtype!r} is not one of {CHECKPOINT_DTYPES}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("ModelConfig: num_attention_heads must be a multiple of num_key_value_heads.")
        if self.rope_scaling is not None:
            need = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if self.rope_scaling.get("rope_type") != "llama3" or not need <= self.rope_scaling.keys():
                raise ValueError(
                    f"ModelConfig: rope_scaling {self.rope_scaling} is unsupported; "
                    f"only 'llama3' scaling with keys {sorted(need)} is implemented."
                )

    @classmethod
    def from_hf(cls, d: dict, path: str = "config.json") -> "ModelConfig":
        """Parse an HF config.json: the published layout (top-level rope_theta / rope_scaling, whose
        type key is "rope_type" or the older "type") and the transformers-5 `rope_parameters` layout."""
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise ValueError(f"{path}: model_type {mt!r} is not supported (supported: {sorted(ARCHITECTURES)}).")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {d['hidden_act']!r} is not supported (only 'silu').")
        if (
            d.get("use_sliding_window")
            or "sliding_attention" in (d.get("layer_types") or [])
            or (mt == "mistral" and d.get("sliding_window") is not None)
        ):
            raise ValueError(f"{path}: sliding-window attention is not supported; only full attention.")
        if d.get("mlp_bias"):
            raise ValueError(f"{path}: mlp_bias is not supported.")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ValueError(f"{path}: required field {key!r} is missing.")
        rp = d.get("rope_parameters") or {}
        rs = dict(rp or d.get("rope_scaling") or {})
        rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{path}: partial_rotary_factor is not supported.")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{path}: rope type {rope_type!r} is not supported (only default and 'llama3').")
        scaling = None
        if rope_type == "llama3":
            scaling = {"rope_type": "llama3"} | {
                k: rs[k]
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k in rs
            }
        heads = d["num_attention_heads"]
        dtype = d.get("torch_dtype") or d.get("dtype")  # transformers 5 writes "dtype"
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(rp.get("rope_theta", d.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),  # Qwen2: hard-coded in HF
                qk_norm=mt == "qwen3",
                model_type=mt,
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                **({"torch_dtype": dtype} if dtype else {}),  # absent: load_model reads the tensors' dtype
            )
        except ValueError as e:
            raise ValueError(f"{path}: {str(e).removeprefix('ModelConfig: ')}") from None

    def to_hf(self) -> dict:
        """config.json in the published layout (top-level rope_theta / rope_scaling) that
        transformers 4.x and 5.x both load."""
        d = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type in ("qwen2", "qwen3"):
            d |= {"use_sliding_window": False, "sliding_window": None}
        if self.model_type == "mistral":
            d["sliding_window"] = None
        return d


# ----------------------------------------------------------------------------- the transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight. HF's order: normalise in float32, cast back to the input
        # dtype, THEN scale (matters in bf16). In float32 the fused kernel computes exactly that.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device) -> Tensor:
    """(hd/2,) float32 inverse frequencies, with Llama 3.1's smooth frequency scaling if configured."""
    hd = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
    if config.rope_scaling is None:
        return inv
    # llama3: low frequencies divided by `factor`, high ones kept, a linear blend in between
    # (same ops as HF's _compute_llama3_parameters, so the result is bit-identical).
    s = config.rope_scaling
    f, lo, hi, L0 = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > L0 / lo, inv / f, inv)
    smooth = (L0 / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / f + smooth * inv_l
    medium = ~(wavelen < L0 / hi) * ~(wavelen > L0 / lo)
    return torch.where(medium, smoothed, inv_l)


def rope_cos_sin(positions: Tensor, config: ModelConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (B, 1, T, hd) for split-halves RoPE: angles in float32, then cast to the activation
    dtype (as HF does). The first half of sin is negated (see apply_rope). Recomputed per forward
    (a few tiny ops) so the model carries no buffers."""
    freqs = positions[..., None].float() * rope_inv_freq(config, positions.device)  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd)
    sin = emb.sin().to(dtype)
    sin[..., : freqs.shape[-1]].neg_()
    return emb.cos().to(dtype)[:, None], sin[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Split halves ("rotate_half", GPT-NeoX), NOT interleaved pairs: HF weights are permuted for this.
    # HF: x * cos + cat(-x2, x1) * sin; the minus sign lives in rope_cos_sin's sin (exact: a negation).
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """q (B, H, T, hd), k/v (B, Hkv, S, hd) -> (B, H, T, hd). attn_mask None means Tq == Tk causal."""
    B, H, T, hd = q.shape
    groups = H // k.shape[1]
    if T == 1 and groups > 1:
        # pack-GQA for decode: the `groups` query heads sharing a KV head act as query rows against
        # it (query head h uses KV head h // groups), so K/V are never copied. The (B, 1, 1, S)
        # mask broadcasts over them; one query needs no causal part.
        y = F.scaled_dot_product_attention(q.reshape(B, -1, groups, hd), k, v, attn_mask=attn_mask)
        return y.reshape(B, H, 1, hd)
    if groups > 1:  # expand K/V to H heads: works with every SDPA kernel, masked or not
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.H, self.Hkv, self.hd = (
            layer_idx,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        C, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(C, self.H * self.hd, bias=bias)
        self.k_proj = nn.Linear(C, self.Hkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(C, self.Hkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.H * self.hd, C, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, attn_mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd)  # (B, T, H, hd)
        k = self.k_proj(x).view(B, T, self.Hkv, self.hd)  # (B, T, Hkv, hd)
        v = self.v_proj(x).view(B, T, self.Hkv, self.hd)
        if hasattr(self, "q_norm"):  # Qwen3: per-head norm BEFORE RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd): all keys so far
        y = attend(q, k, v, attn_mask)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        C, I = config.hidden_size, config.intermediate_size  # noqa: E741 (I: intermediate size)
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not torch.is_grad_enabled():  # sampling, scoring: nothing is saved anyway
            return self.down_proj(F.silu(gate) * up)  # SwiGLU
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.down_proj.weight.dtype
        with torch.autocast(dev, enabled=False):  # dtypes are explicit inside
            return _SwiGLUDown.apply(gate, up, self.down_proj.weight, dtype)


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up), saving only gate and up for backward: silu(gate) and the product
    are recomputed there. Autograd would save four (..., intermediate) tensors per layer (gate,
    silu(gate), up, the product), the largest activations of a training step; this saves two, with
    the same values and gradients (the same kernels in the same order: bit for bit in float32, tested)."""

    @staticmethod
    def forward(ctx, gate, up, weight, dtype):
        w = weight.to(dtype)  # (C, I) in the matmul dtype (a no-op in float32), as autocast would cast it
        ctx.save_for_backward(gate, up, w)
        ctx.weight_dtype = weight.dtype
        return F.linear(F.silu(gate) * up, w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out):
        gate, up, w = ctx.saved_tensors
        act = F.silu(gate)
        prod = (act * up).reshape(-1, w.shape[1])  # (N, I): recomputed, alive for this layer's backward only
        g_flat = g_out.reshape(-1, w.shape[0])  # (N, C)
        g_weight = (g_flat.T @ prod).to(ctx.weight_dtype)
        g_prod = (g_flat @ w).view(gate.shape)
        g_gate = torch.ops.aten.silu_backward(g_prod * up, gate)
        return g_gate, g_prod * act, g_weight, None


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache=None, attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False  # True: recompute each layer in backward (training only)
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
                layers=nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers)),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():  # HF-style init (std 0.02) for models built from scratch
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if config.tie_word_embeddings:  # share the Parameter, so training updates both
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache=None,
        attn_mask: Tensor | None = None,
        logits_to_keep: int = 0,
        hidden: bool = False,
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T or logits_to_keep, V) in the model dtype, or with
        hidden=True the final-norm hidden states (B, T or logits_to_keep, C) that lm_head would see:
        training turns those into log-probs with `head_logprobs`, never holding (B, T, V) logits.

        positions (B, T): RoPE position of each token (default arange(T)). cache: an object with
        `update(layer_idx, k, v) -> (k_all, v_all)`. attn_mask (B, 1, T, S) bool, True = attend,
        used as given; without mask and cache the forward is plainly causal."""
        B, T = input_ids.shape
        if cache is not None and attn_mask is None:
            # is_causal is top-left aligned: wrong as soon as the cache already holds keys
            raise ValueError("forward: a cache needs an explicit attn_mask (B, 1, T, S).")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)
        positions = positions.expand(B, T)  # (T,) or (1, T) broadcast; a wrong shape fails here
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(positions, self.config, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, cache, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache, attn_mask)
        x = self.model.norm(x)
        if logits_to_keep > 0:
            # contiguous: on a strided slice, a bf16 lm_head falls back to a batched matmul that copies its
            # (V, C) weight once per row (8.4 of a bf16 sampler's 11.2 s at Qwen2.5-0.5B's shape)
            x = x[:, -logits_to_keep:].contiguous()
        return x if hidden else self.lm_head(x)  # (B, T, C) or (B, T, V)


# ----------------------------------------------------------------------------- log-probs


def _logp_lse(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """THE log-prob formula: x = logits.float() / temperature, logp = x[target] - logsumexp(x).
    logits (n, V), targets (n,) -> logp (n,), logsumexp (n,), float32. Every log-prob in the repo
    (sampler, trainer, eval) is this function applied to some rows of logits."""
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def _entropy(logits: Tensor, temperature: float, lse: Tensor | None = None) -> Tensor:
    """Entropy of softmax(x), x = logits.float() / temperature: H = logsumexp(x) - sum p x. (n, V) -> (n,)."""
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1) if lse is None else lse
    return lse - (torch.softmax(x, dim=-1) * x).sum(-1)


def _chunked(fn, logits: Tensor, *args: Tensor, chunk_rows: int | None) -> Tensor:
    """Apply fn to row chunks of logits (N, V); under autograd each chunk is checkpointed, so only
    one chunk's float32 copy exists at a time, in forward and in backward."""
    step = chunk_rows or max(1, 2**24 // logits.shape[-1])  # default: ~64 MB of float32 per chunk
    grad = torch.is_grad_enabled() and logits.requires_grad
    outs = []
    for i in range(0, logits.shape[0], step):
        chunk = [logits[i : i + step], *(a[i : i + step] for a in args)]
        outs.append(checkpoint(fn, *chunk, use_reentrant=False) if grad else fn(*chunk))
    return torch.cat(outs) if outs else logits.new_empty(0, dtype=torch.float32)


def _check_temperature(name: str, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}.")


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """log_softmax(logits.float() / temperature) at targets: logits (..., V), targets (...) long
    -> float32 (...). For logits that already exist (the sampler's (B, V) rows); training goes
    through `head_logprobs` instead, which never builds them."""
    _check_temperature("token_logprobs", temperature)
    V = logits.shape[-1]
    fn = lambda x, t: _logp_lse(x, t, temperature)[0]  # noqa: E731 (n, V), (n,) -> (n,)
    return _chunked(fn, logits.reshape(-1, V), targets.reshape(-1), chunk_rows=chunk_rows).view(targets.shape)


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """Entropy of softmax(logits.float() / temperature): logits (..., V) -> float32 (...)."""
    _check_temperature("token_entropy", temperature)
    V = logits.shape[-1]
    fn = lambda x: _entropy(x, temperature)  # noqa: E731
    return _chunked(fn, logits.reshape(-1, V), chunk_rows=chunk_rows).view(logits.shape[:-1])


class _HeadLogprobs(torch.autograd.Function):
    """logp = _logp_lse(hidden @ weight.T, targets) over row chunks; backward recomputes each chunk's
    logits and applies d logp / d logits = (onehot(target) - softmax(x)) / temperature by hand.

    A hand-written backward rather than torch.utils.checkpoint per chunk: it saves only the (N,)
    logsumexp, computes entropy once in forward (checkpoint would recompute it), skips the
    recomputed logsumexp and its backward, and sums weight's gradient over the chunks in ONE
    float32 buffer (checkpoint hands autograd one (V, C) gradient per chunk to add up, in bf16
    under autocast)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, dtype, step, want_entropy):
        w = weight.to(dtype)  # (V, C) in the matmul dtype, cast once (as autocast's weight cache does)
        N = hidden.shape[0]
        logp = hidden.new_empty(N, dtype=torch.float32)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else logp.new_empty(0)
        for i in range(0, N, step):
            logits = hidden[i : i + step].to(dtype) @ w.T  # (n, V): the only logits alive
            logp[i : i + step], lse[i : i + step] = _logp_lse(logits, targets[i : i + step], temperature)
            if want_entropy:
                ent[i : i + step] = _entropy(logits, temperature, lse[i : i + step])
        ctx.save_for_backward(hidden, w, targets, lse)
        ctx.temperature, ctx.dtype, ctx.step, ctx.weight_dtype = temperature, dtype, step, weight.dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, _g_ent):
        hidden, w, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for i in range(0, hidden.shape[0], ctx.step):
            h, t, g = hidden[i : i + ctx.step].to(ctx.dtype), targets[i : i + ctx.step], g_logp[i : i + ctx.step]
            x = (h @ w.T).float().div_(ctx.temperature)  # (n, V): the forward's x, recomputed
            d = x.sub_(lse[i : i + ctx.step, None]).exp_().mul_(-g[:, None])  # -g * softmax(x), in place
            d.scatter_add_(1, t[:, None], g[:, None])  # + g at the target: g * (onehot - softmax)
            d = d.div_(ctx.temperature).to(ctx.dtype)  # d logp / d logits, in the matmul dtype
            if need_h:
                g_h[i : i + ctx.step] = d @ w  # (n, C)
            if need_w:
                if d.dtype == g_w.dtype:  # (V, C), summed in float32 across chunks
                    g_w.addmm_(d.T, h)  # in place: no (V, C) temporary per chunk
                else:  # autocast: the chunk's product in the matmul dtype, then added
                    g_w += d.T @ h
        return g_h, None if g_w is None else g_w.to(ctx.weight_dtype), None, None, None, None, None


def head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs(lm_head(hidden), targets, temperature) without ever holding more than one
    chunk of logits, in forward or backward (at a 152k vocabulary the logits would be the largest
    tensor of a training step).

    head: the Transformer (its lm_head is used) or the lm_head Linear. hidden (..., C), e.g. from
    `model(ids, hidden=True)`; targets (...) long. Returns logp (...) float32, differentiable
    w.r.t. hidden and lm_head.weight (a tied embedding included), and, if entropy, the entropy of
    softmax(logits / temperature) (...) float32 without grad, else None. Under autocast the matmul
    runs in the autocast dtype, the log-softmax in float32, as `token_logprobs(model(ids))` would.
    chunk_tokens: rows per chunk, default 2**24 // V (~64 MB of float32 logits)."""
    _check_temperature("head_logprobs", temperature)
    lm_head = getattr(head, "lm_head", head)
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("head_logprobs: lm_head has a bias; only bias-free heads are supported.")
    weight = lm_head.weight  # (V, C)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    step = chunk_tokens or max(1, 2**24 // weight.shape[0])
    C = hidden.shape[-1]
    with torch.autocast(dev, enabled=False):  # dtypes are explicit inside
        logp, ent = _HeadLogprobs.apply(
            hidden.reshape(-1, C), weight, targets.reshape(-1), temperature, dtype, step, entropy
        )
    return logp.view(targets.shape), ent.view(targets.shape) if entropy else None


# ----------------------------------------------------------------------------- checkpoints


def _read_json(file: Path) -> dict:
    """A JSON object from `file`; anything else is a one-line ValueError naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}.")
    return data


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"{index}: names shard {f!r}, which is missing.")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight file found.")
    return files


def load_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Load an HF checkpoint directory strictly: every tensor must be present, expected and of the
    right shape. Built on the meta device and filled in the target dtype/device (4 threads casting),
    so no second full copy of the weights ever exists. model.config.torch_dtype keeps the dtype the
    checkpoint stores (config.json's torch_dtype / dtype, else its embedding tensor's), whatever
    `dtype` the weights are loaded in, so save_model writes it back in that dtype."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'}: missing; a model directory needs config.json.")
    raw = _read_json(path / "config.json")
    config = ModelConfig.from_hf(raw, str(path / "config.json"))
    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.named_parameters())  # tied: lm_head.weight is not listed separately
    loaded: set[str] = set()
    for file in _weight_files(path):
        try:
            tensors = {}  # name -> tensor on the file's memory map (nothing read yet)
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some exports store the tied head too; HF ignores it, so do we
                    if name not in expected:
                        raise ValueError(f"{file}: unexpected tensor {name!r} for a {config.model_type} model.")
                    if name in loaded:
                        raise ValueError(f"{file}: tensor {name!r} appears in more than one file.")
                    t = f.get_tensor(name)
                    if name == "model.embed_tokens.weight":
                        stored = str(t.dtype).removeprefix("torch.")
                    if t.shape != expected[name].shape:
                        raise ValueError(
                            f"{file}: tensor {name!r} has shape {tuple(t.shape)}, "
                            f"config.json implies {tuple(expected[name].shape)}."
                        )
                    tensors[name] = t
                    loaded.add(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: unreadable safetensors file, truncated or corrupt ({e}).") from None
        # read and cast in 4 threads (torch releases the GIL): the page faults of reading the map and
        # of filling the new tensors run in parallel, 2x faster at Qwen2.5-0.5B than one tensor at a time
        with ThreadPoolExecutor(4) as pool:
            cast = pool.map(lambda t: t.to(device=device, dtype=dtype), tensors.values())
            for name, t in zip(tensors, cast):
                module, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module), leaf, nn.Parameter(t))
    missing = sorted(expected.keys() - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}.")
    if config.tie_word_embeddings:  # re-tie: assignment replaced embed_tokens' Parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    if not (raw.get("torch_dtype") or raw.get("dtype")):  # config.json silent: the dtype the file stores
        model.config = replace(config, torch_dtype=stored)
    return model


def cast_copy(model: Transformer, dtype: torch.dtype) -> Transformer:
    """A frozen copy of `model` with its weights cast to `dtype` (ties kept), on the same device: the
    sampler's weights when rollouts run in less precision than training (train.py --rollout-dtype).
    Built on the meta device and allocated directly in `dtype`, so no float32 copy is ever made;
    refresh it after each update with copy_weights_."""
    with torch.device("meta"):
        copy = Transformer(model.config)
    device = next(model.parameters()).device
    copy = copy.to(dtype).to_empty(device=device).requires_grad_(False)
    if model.config.tie_word_embeddings:
        copy.lm_head.weight = copy.model.embed_tokens.weight
    return copy_weights_(copy, model)


@torch.no_grad()
def copy_weights_(dst: Transformer, src: Transformer) -> Transformer:
    """dst's parameters := src's, cast to dst's dtype. src may be sharded by FSDP2: each parameter
    is then all-gathered (DTensor.full_tensor, a collective: every rank must call this)."""
    pairs = list(zip(dst.parameters(), src.parameters(), strict=True))  # same modules, same ties, same order
    for d, s in pairs:
        d.copy_(s.full_tensor() if hasattr(s, "full_tensor") else s)
    return dst


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def save_model(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    state_dict: dict[str, Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an HF directory (config.json, model.safetensors, generation_config.json, tokenizer
    files copied from tokenizer_dir) that transformers loads. Atomic: written to a temporary
    directory next to `path`, then renamed over it. state_dict: full tensors when the model's
    own parameters are sharded (FSDP). dtype: of the written weights, recorded as config.json's
    torch_dtype; None = model.config.torch_dtype, the dtype the checkpoint was loaded from
    (float32 for a model built from scratch), so float32 training of a bf16 model saves bf16."""
    path = Path(path)
    stored = str(dtype).removeprefix("torch.") if dtype is not None else model.config.torch_dtype
    config = replace(model.config, torch_dtype=stored)  # validates the name
    sd = state_dict if state_dict is not None else model.state_dict()
    tensors = {
        k: v.detach().to("cpu", getattr(torch, stored)).contiguous()
        for k, v in sd.items()
        if not (k == "lm_head.weight" and config.tie_word_embeddings)
    }  # HF omits a tied head
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy(Path(tokenizer_dir) / name, tmp / name)
        if not (tmp / "generation_config.json").exists() and config.eos_token_id is not None:
            gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        old = None
        if path.exists():  # move the old copy aside first: a crash leaves the old or the new one
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- tokenizer

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA3_DATE = "26 Jul 2024"  # Llama 3.1's default; pinned so a prompt never changes with the calendar


def _render_chatml(messages: list[dict], add_generation_prompt: bool, enable_thinking: bool, qwen3: bool) -> str:
    """Qwen2.5 (default system turn injected) or Qwen3 (no default system; thinking stripped from
    assistant turns before the last user turn; enable_thinking=False pre-fills an empty think block)."""
    out = []
    if not qwen3 and (not messages or messages[0]["role"] != "system"):
        out.append(f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role in ("system", "user") or (role == "assistant" and not qwen3):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or ""
            if "</think>" in content and not reasoning:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            if "</think>" in content:
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_user and (i == len(messages) - 1 or reasoning):  # the turn being generated keeps its thought
                content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
            out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
        else:
            raise ValueError(f"apply_chat_template: role {role!r} is not supported (system, user, assistant).")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if qwen3 and not enable_thinking else ""))
    return "".join(out)


def _render_llama3(messages: list[dict], add_generation_prompt: bool) -> str:
    """Llama 3.1/3.2 Instruct: BOS, an always-present system header with a fixed date, trimmed contents."""
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    out = [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {LLAMA3_DATE}\n\n{system}<|eot_id|>"
    ]
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"apply_chat_template: role {m['role']!r} is not supported (system, user, assistant).")
        out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


class Tokenizer:
    """A tokenizers.Tokenizer plus the checkpoint's chat template and stop ids."""

    def __init__(self, tok, template: str | None, stop_ids: list[int], pad_id: int):
        self.tok = tok
        self.template = template  # "chatml" | "llama3" | None (no known chat format)
        self.thinking = tok.token_to_id("<think>") is not None  # ChatML in Qwen3 style
        self.stop_ids = stop_ids
        # The token that closes an assistant turn in this chat format (a written-out reference completion
        # ends with it, as a sampled one does); without a known format, the first stop id.
        end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}.get(template or "")
        self.end_id = tok.token_to_id(end) if end else (stop_ids[0] if stop_ids else None)
        self.pad_id = pad_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Never add special tokens: Llama 3's post-processor would put a second BOS in front of
        # rendered chat text, which already starts with one. Special tokens in text stay atomic.
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True
    ) -> str:
        if self.template == "chatml":
            return _render_chatml(messages, add_generation_prompt, enable_thinking, qwen3=self.thinking)
        if self.template == "llama3":
            return _render_llama3(messages, add_generation_prompt)
        raise ValueError(
            "apply_chat_template: this tokenizer has neither <|im_start|> nor <|start_header_id|>, "
            "so no chat format is known."
        )


def _ids(x: int | list[int] | None) -> list[int]:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """tokenizer.json from an HF directory. Chat format from the special tokens; stop ids from
    generation_config.json, else config.json, else the format's end tokens, always including the
    format's end-of-turn token (a base model prompted with ChatML ends its turn with <|im_end|>)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found.")
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; load_tokenizer needs a tokenizers tokenizer.json.")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{file}: not a valid tokenizers file ({e}).") from None
    cfg = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    if tok.token_to_id("<|im_start|>") is not None:
        template, ends = "chatml", ["<|im_end|>", "<|endoftext|>"]
    elif tok.token_to_id("<|start_header_id|>") is not None:
        template, ends = "llama3", ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
    else:
        template, ends = None, []
    end_ids = [i for i in map(tok.token_to_id, ends) if i is not None]
    stop_ids = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id")) or end_ids
    if end_ids and end_ids[0] not in stop_ids:
        stop_ids.append(end_ids[0])
    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    pad = tcfg.get("pad_token")
    pad_id = tok.token_to_id(pad.get("content", "") if isinstance(pad, dict) else pad) if pad else None
    if pad_id is None:
        pad_id = cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else (stop_ids or [0])[0]
    return Tokenizer(tok, template, stop_ids, pad_id)
