"""The policy model: a Llama / Mistral / Qwen2 / Qwen3 decoder in plain PyTorch, and Qwen3.5/3.6's hybrid of it, whose
layers are three Gated DeltaNet (deltanet.py) to one full attention with an output gate, partial rotary and
zero-centred norms. Its log-probs are logprobs.py's.

Parameter names equal the Hugging Face checkpoint keys, so loading is a strict name-by-name copy
(hf.py reads and writes checkpoint directories; tokenizer.py owns the tokenizer and chat templates).
The model holds no KV cache: the sampler owns one and passes it into `forward`, so the same module
serves training (full causal forward) and sampling (prefill/decode against a cache).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from deltanet import GatedDeltaNet

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")  # config.json torch_dtype values we read and write
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",  # the hybrid: Gated DeltaNet (deltanet.py) and gated full attention
}
LAYER_TYPES = ("full_attention", "linear_attention")


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
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3.5)
    model_type: str = "qwen2"  # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_5"
    # Qwen3.5: each layer's mixer, gated attention over the first partial_rotary_factor of each head rotated,
    # zero-centred norms (x * (1 + w)), and the Gated DeltaNet's heads and convolution
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "linear_attention" per layer
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
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
        if self.qk_norm != (self.model_type in ("qwen3", "qwen3_5")):
            raise ValueError("ModelConfig: qk_norm must be True exactly when model_type is 'qwen3' or 'qwen3_5'.")
        hybrid, types = self.model_type == "qwen3_5", self.layer_types
        if hybrid != (types is not None) or (hybrid and len(types) != self.num_hidden_layers):
            raise ValueError("ModelConfig: layer_types must list every layer exactly when model_type is 'qwen3_5'.")
        if hybrid and not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"ModelConfig: layer_types may only hold {LAYER_TYPES}, got {sorted(set(types))}.")
        if hybrid and "linear_attention" in types and self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            raise ValueError("ModelConfig: linear_num_value_heads must be a multiple of linear_num_key_heads.")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"ModelConfig: partial_rotary_factor {self.partial_rotary_factor} must give an even "
                f"rotary dimension in (0, head_dim]."
            )
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

    @property
    def rotary_dim(self) -> int:  # the leading dimensions of each head that RoPE rotates
        return int(self.head_dim * self.partial_rotary_factor)

    def mixer(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else "full_attention"


# ----------------------------------------------------------------------------- the transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred  # Qwen3.5: x * (1 + weight), the weight starting at 0
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.zero_centred:  # scaled in float32, then cast (transformers' Qwen3.5 order)
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(
                x.dtype
            )
        # x * rsqrt(mean(x^2) + eps) * weight. HF's order: normalise in float32, cast back to the input
        # dtype, THEN scale (matters in bf16). In float32 the fused kernel computes exactly that.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device) -> Tensor:
    """(hd/2,) float32 inverse frequencies, with Llama 3.1's smooth frequency scaling if configured."""
    hd = config.rotary_dim
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
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (Qwen3.5): the leading dimensions rotate, the rest pass
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
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
        self.gated = config.model_type == "qwen3_5"  # q_proj also gives each head a sigmoid gate on its output
        self.q_proj = nn.Linear(C, self.H * self.hd * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(C, self.Hkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(C, self.Hkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.H * self.hd, C, bias=bias and self.gated)  # Qwen3.5's attention_bias: o too
        if config.qk_norm:
            self.q_norm = RMSNorm(self.hd, config.rms_norm_eps, zero_centred=self.gated)
            self.k_norm = RMSNorm(self.hd, config.rms_norm_eps, zero_centred=self.gated)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, attn_mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, -1)  # (B, T, H, hd), or per head [q_h | gate_h] when gated
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = self.k_proj(x).view(B, T, self.Hkv, self.hd)  # (B, T, Hkv, hd)
        v = self.v_proj(x).view(B, T, self.Hkv, self.hd)
        if hasattr(self, "q_norm"):  # Qwen3: per-head norm BEFORE RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd): all keys so far
        y = attend(q, k, v, attn_mask).transpose(1, 2)  # (B, T, H, hd)
        y = y * torch.sigmoid(gate) if self.gated else y
        return self.o_proj(y.reshape(B, T, self.H * self.hd))


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
        dev, down = x.device.type, self.down_proj
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else down.weight.dtype
        # A LoRA adapter on down_proj (lora.py): its A (r, I) takes the same product inside the fused function,
        # and the adapter adds its B part (lora.LoRALinear.add_update); otherwise it would be silently skipped.
        lora_A = down.lora_A if getattr(down, "enabled", False) else None
        with torch.autocast(dev, enabled=False):  # dtypes are explicit inside
            out = _SwiGLUDown.apply(gate, up, down.weight, dtype, lora_A)
        return out if lora_A is None else down.add_update(*out)


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up), saving only gate and up for backward: silu(gate) and the product
    are recomputed there. Autograd would save four (..., intermediate) tensors per layer (gate,
    silu(gate), up, the product), the largest activations of a training step; this saves two, with
    the same values and gradients (the same kernels in the same order: bit for bit in float32, tested).
    With a LoRA A (r, I) it also returns the product's projection product @ A.T (..., r). A frozen weight
    (LoRA's base) gets no gradient: its (C, I) matmul is skipped in backward."""

    @staticmethod
    def forward(ctx, gate, up, weight, dtype, lora_A=None):
        w = weight.to(dtype)  # (C, I) in the matmul dtype (a no-op in float32), as autocast would cast it
        a = None if lora_A is None else lora_A.to(dtype)  # (r, I)
        ctx.save_for_backward(gate, up, w, a)
        ctx.weight_dtype, ctx.a_dtype = weight.dtype, None if lora_A is None else lora_A.dtype
        prod = F.silu(gate) * up
        return F.linear(prod, w) if a is None else (F.linear(prod, w), F.linear(prod, a))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out, g_z=None):
        gate, up, w, a = ctx.saved_tensors
        act = F.silu(gate)
        prod = (act * up).reshape(-1, w.shape[1])  # (N, I): recomputed, alive for this layer's backward only
        g_flat = g_out.reshape(-1, w.shape[0])  # (N, C)
        g_weight = (g_flat.T @ prod).to(ctx.weight_dtype) if ctx.needs_input_grad[2] else None
        g_prod, g_a = g_flat @ w, None
        if a is not None:  # the product also fed A: its gradient adds A's part (a sum of two, in either order)
            g_zf = g_z.reshape(-1, a.shape[0])  # (N, r)
            g_prod = g_prod + g_zf @ a
            g_a = (g_zf.T @ prod).to(ctx.a_dtype) if ctx.needs_input_grad[4] else None
        g_prod = g_prod.view(gate.shape)
        g_gate = torch.ops.aten.silu_backward(g_prod * up, gate)
        return g_gate, g_prod * act, g_weight, None, g_a


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        C, eps, zc = config.hidden_size, config.rms_norm_eps, config.model_type == "qwen3_5"
        self.input_layernorm = RMSNorm(C, eps, zero_centred=zc)
        if config.mixer(layer_idx) == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(C, eps, zero_centred=zc)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, attn_mask: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):  # attends to no mask: its state holds the past; `valid` skips tokens
            x = x + self.linear_attn(h, cache, valid)
        else:
            x = x + self.self_attn(h, cos, sin, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabGrads:
    """The vocabulary tables' gradients (lm_head's and embed_tokens' weights: one Parameter when tied) summed over a
    step's micro-batches and handed to autograd by the last one's backward (`last`, read when a backward runs); the
    backwards before it give the tables no gradient (DDP's no_sync and FSDP's deferred sync wait for the last
    anyway). A (V, C) gradient per micro-batch is a fresh allocation each time, 1 GB at a 248k vocabulary, and on CPU,
    which caches no memory, each costs more than a head matmul. lm_head's sum is one float32 buffer (head_logprobs
    adds to it); the lookups' gradients stay rows (n, C) until the hand-over adds them into one (V, C) tensor."""

    def __init__(self, last: bool = False) -> None:
        self.head, self.rows, self.last = None, [], last

    def head_buffer(self, w: Tensor) -> Tensor:
        if self.head is None:
            self.head = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        return self.head

    def take_head(self) -> Tensor | None:
        """lm_head.weight's gradient for this backward: the step's sum at the last micro-batch, else None."""
        out, self.head = (self.head, None) if self.last else (None, self.head)
        return out


class _Embedding(torch.autograd.Function):
    """embed_tokens(ids) whose weight's gradient goes through VocabGrads: its rows, summed in float32 at the last."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, grads: VocabGrads) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.grads, ctx.shape = grads, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g: Tensor):
        grads = ctx.grads
        grads.rows.append((ctx.saved_tensors[0].reshape(-1), g.reshape(-1, g.shape[-1]).float()))
        if not grads.last:
            return None, None, None
        ids, rows = (torch.cat(x) for x in zip(*grads.rows))
        grads.rows = []
        return None, g.new_zeros(ctx.shape, dtype=torch.float32).index_add_(0, ids, rows).to(g.dtype), None


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False  # True: recompute each layer in backward (training only)
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
                layers=nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers)),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=config.model_type == "qwen3_5"),
            )
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():  # HF-style init (std 0.02) for models built from scratch
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, (nn.Linear, nn.Conv1d)) and m.bias is not None:
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
        valid: Tensor | None = None,
        vocab_grads: VocabGrads | None = None,
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T or logits_to_keep, V) in the model dtype, or with
        hidden=True the final-norm hidden states (B, T or logits_to_keep, C) that lm_head would see:
        training turns those into log-probs with `head_logprobs`, never holding (B, T, V) logits.

        positions (B, T): RoPE position of each token (default arange(T)). cache: an object with
        `update(layer_idx, k, v) -> (k_all, v_all)`. attn_mask (B, 1, T, S) bool, True = attend (or SDPA's
        additive form, 0 or -inf: kvcache.additive_mask), used as given; without mask and cache the forward is
        plainly causal. valid (B, T) bool: the real tokens (False: padding), what Gated DeltaNet layers skip
        (deltanet.py); attention layers read attn_mask. vocab_grads: the trainer's sum of the embedding's gradient."""
        B, T = input_ids.shape
        if cache is not None and attn_mask is None:
            # is_causal is top-left aligned: wrong as soon as the cache already holds keys
            raise ValueError("forward: a cache needs an explicit attn_mask (B, 1, T, S).")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)
        positions = positions.expand(B, T)  # (T,) or (1, T) broadcast; a wrong shape fails here
        embed = self.model.embed_tokens
        x = embed(input_ids) if vocab_grads is None else _Embedding.apply(input_ids, embed.weight, vocab_grads)
        cos, sin = rope_cos_sin(positions, self.config, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, cache, attn_mask, valid, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache, attn_mask, valid)
        x = self.model.norm(x)
        if logits_to_keep > 0:
            # contiguous: on a strided slice, a bf16 lm_head falls back to a batched matmul that copies its
            # (V, C) weight once per row (8.4 of a bf16 sampler's 11.2 s at Qwen2.5-0.5B's shape)
            x = x[:, -logits_to_keep:].contiguous()
        return x if hidden else self.lm_head(x)  # (B, T, C) or (B, T, V)


# ----------------------------------------------------------------------------- precision copies


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
