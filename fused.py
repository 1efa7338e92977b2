"""fused.py: the rollout copy's fused layers. A decode step on a GPU pays per kernel, not per FLOP, so the
sampler's copy of the policy (model.cast_copy, lora.merged_copy: train.py's --rollout-dtype copy, bf16 on CUDA)
runs q, k and v as one matmul, gate and up as another, RoPE over q and k at once (its multiply-add one addcmul),
each residual add inside the matmul that feeds it (addmm), and each RMSNorm as one F.rms_norm call in the
activations' dtype: 7 projections per layer become 4, two RoPEs one, two adds none, and a bf16 norm's four ops
(cast up, normalise, cast down, scale) one. Fused kernels round less often than Hugging Face's op order (a
bf16 norm normalises in float32, casts, then scales): the bf16 copy differs from the bf16 model within bf16
rounding, and in float32 within float32 rounding (tests/test_fused.py).

The trained model keeps Hugging Face's layout (q_proj, k_proj, ... : checkpoints, LoRA/PEFT and FSDP are
untouched). In the copy, each projection's weight is a view into its layer's fused weight, so refreshing the copy
after an update (copy_weights_, lora.copy_merged_: in-place copies into its parameters) refreshes the fused
weights with it, at the same addresses (the CUDA graphs replay them). The policy itself is never fused: the float32
sampler on CPU (the default) computes exactly what it always did.

What plain PyTorch cannot fuse, generated kernels can: with compile=True (the default on CUDA with CUDA graphs,
as nano-vllm does) the copy's three small elementwise functions, rope, silu_mul and rms_norm, run through
torch.compile, each one generated kernel instead of 3, 2 and 1 (or more) of PyTorch's: 14 kernel-launching ops a
layer become 11. They compile once each (dynamic shapes) in the first decode step's warm-up, before its capture.
train.py --compile compiles the whole decode step instead (inductor then also fuses across functions).

A Qwen3.5 hybrid's copy fuses the same way: a DeltaNet layer's four input projections (qkv, z, b, a) run as one
matmul and its out_proj takes the residual add; the gated attention's q_proj (queries and their gates), k and v
run as one matmul, RoPE over the first quarter of q and k together; the zero-centred norms (x (1 + w)) are one
F.rms_norm each. A DeltaNet layer's 8 projections (with the MLP's) become 4, an attention layer's 7 become 4.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from deltanet import GatedDeltaNet
from graphs import compiled
from model import MLP, Attention, Block, RMSNorm, Transformer, attend


def add_linear(residual: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """residual + x @ weight.T (+ bias) as one matmul whose epilogue adds the residual (addmm): x (..., K), weight
    (N, K), residual (..., N). Saves the separate add kernel of a projection that feeds the residual stream (a
    bias, rare there: Qwen3.5's o_proj with attention_bias, is one add more)."""
    residual = residual if bias is None else residual + bias
    return torch.addmm(residual.reshape(-1, weight.shape[0]), x.reshape(-1, weight.shape[1]), weight.t()).view(
        residual.shape
    )


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """model.apply_rope with its multiply-add as one addcmul (one kernel fewer; in bf16 it rounds once less).
    Partial rotary (cos narrower than a head: Qwen3.5): the leading dimensions rotate, the rest pass."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up (..., 2I), its halves gate and up -> (..., I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as one F.rms_norm in x's dtype (float32 inside the kernel): in float32 model.RMSNorm's own path."""
    return F.rms_norm(x, weight.shape, weight, eps)


def zero_centred_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's norm x (1 + w), normalised and scaled in float32 then cast (its order), as one F.rms_norm."""
    return F.rms_norm(x.float(), weight.shape, 1.0 + weight.float(), eps).to(x.dtype)


def kernels(compile: bool) -> dict:
    """The copy's small elementwise functions by name: as written, or compiled (graphs.compiled: one generated
    kernel each)."""
    fns = (rope, silu_mul, rms_norm, zero_centred_rms_norm)
    return {fn.__name__: compiled(fn) if compile else fn for fn in fns}


class FusedAttention(Attention):
    """Attention whose q, k, v projections run as one matmul (qkv_weight (H + 2 Hkv) hd x C, or (2 H + 2 Hkv) hd
    with Qwen3.5's output gates; their weights are views of it), whose RoPE runs over q and k together
    (self.rope: rope, maybe compiled), and which, given the residual stream, returns it with the attention added
    (o_proj and the add in one addmm)."""

    qkv_weight: Tensor
    qkv_bias: Tensor | None
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache, attn_mask: Tensor | None, residual: Tensor | None = None
    ) -> Tensor:
        B, T, _ = x.shape
        H, Hkv = self.H, self.Hkv
        nq = 2 * H if self.gated else H  # q_proj's heads: gated, each query head then its gate ([q_h | gate_h])
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(B, T, nq + 2 * Hkv, self.hd)
        if hasattr(self, "q_norm"):  # Qwen3, Qwen3.5: per-head norms (two weights) before RoPE
            q = qkv[:, :, :nq:2] if self.gated else qkv[:, :, :H]
            qk = torch.cat([self.q_norm(q), self.k_norm(qkv[:, :, nq : nq + Hkv])], 2)
        else:
            qk = qkv[:, :, : H + Hkv]  # (B, T, H + Hkv, hd)
        qk = self.rope(qk, cos.transpose(1, 2), sin.transpose(1, 2))  # cos, sin (B, T, 1, hd): every head
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)  # (B, heads, T, hd)
        v = qkv[:, :, nq + Hkv :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd): all keys so far
        y = attend(q, k, v, attn_mask).transpose(1, 2)  # (B, T, H, hd)
        y = (y * torch.sigmoid(qkv[:, :, 1:nq:2]) if self.gated else y).reshape(B, T, H * self.hd)
        return self.o_proj(y) if residual is None else add_linear(residual, y, self.o_proj.weight, self.o_proj.bias)


class FusedDeltaNet(GatedDeltaNet):
    """GatedDeltaNet whose four input projections run as one matmul (in_weight (D + Hv dv + 2 Hv) x C; their
    weights are views of it) and which, given the residual stream, returns it with the layer's output added
    (out_proj and the add in one addmm)."""

    in_weight: Tensor
    in_split: list[int]  # its rows per projection: qkv, z, b, a

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return F.linear(x, self.in_weight).split(self.in_split, -1)

    def forward(self, x: Tensor, cache=None, valid: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        y = self.mix(x, cache, valid)
        return self.out_proj(y) if residual is None else add_linear(residual, y, self.out_proj.weight)


class FusedMLP(MLP):
    """SwiGLU whose gate and up projections run as one matmul (gate_up_weight 2I x C; their weights are views
    of it), then silu(gate) * up (self.silu_mul: silu_mul, maybe compiled); given the residual stream, it
    returns it with the MLP added (down_proj and the add in one addmm). Inference only: training goes through
    MLP's memory-saving backward on the unfused policy."""

    gate_up_weight: Tensor
    silu_mul: Callable[[Tensor], Tensor]

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        h = self.silu_mul(F.linear(x, self.gate_up_weight))  # (..., I)
        return self.down_proj(h) if residual is None else add_linear(residual, h, self.down_proj.weight)


class FusedBlock(Block):
    """Block whose residual adds happen inside the projections that feed them (FusedAttention or FusedDeltaNet,
    FusedMLP)."""

    def forward(self, x, cos, sin, cache=None, attn_mask: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = self.linear_attn(h, cache, valid, residual=x)
        else:
            x = self.self_attn(h, cos, sin, cache, attn_mask, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class FusedRMSNorm(RMSNorm):
    """RMSNorm as one kernel (self.rms_norm: rms_norm in the input's dtype, or zero_centred_rms_norm; maybe
    compiled)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]

    def forward(self, x: Tensor) -> Tensor:
        return self.rms_norm(x, self.weight, self.eps)


def _fuse(linears: list[nn.Linear], name: str) -> Tensor | None:
    """One tensor holding the linears' weights (or biases) one after another along the output dimension; each
    linear's parameter becomes a view of it (so in-place updates of the parameters update it)."""
    parts = [getattr(lin, name) for lin in linears]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for lin, p in zip(linears, parts):
        setattr(lin, name, nn.Parameter(fused[start : start + len(p)], requires_grad=p.requires_grad))
        start += len(p)
    return fused


@torch.no_grad()
def fuse_for_sampling(model: Transformer, compile: bool = False) -> Transformer:
    """Fuse a frozen copy's projections and norms in place (see the module docstring) and return it; compile:
    its rope, silu_mul and rms_norm run compiled. Its parameters keep their names, shapes, values and order
    (copy_weights_ and state_dict see no difference). Not for a model that trains, nor one moved to another
    device afterwards (.to() would copy the views apart)."""
    fns = kernels(compile)
    for norm in (m for m in model.modules() if type(m) is RMSNorm):
        norm.__class__ = FusedRMSNorm
        norm.rms_norm = fns["zero_centred_rms_norm" if norm.zero_centred else "rms_norm"]
    for block in model.model.layers:
        mlp = block.mlp
        mlp.gate_up_weight = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        mlp.__class__, mlp.silu_mul = FusedMLP, fns["silu_mul"]
        if hasattr(block, "linear_attn"):  # a hybrid's DeltaNet layer
            mixer = block.linear_attn
            parts = [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
            mixer.in_split = [p.out_features for p in parts]
            mixer.in_weight = _fuse(parts, "weight")
            mixer.__class__ = FusedDeltaNet
        else:
            attn = block.self_attn
            attn.qkv_weight = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
            attn.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
            attn.__class__, attn.rope = FusedAttention, fns["rope"]
        block.__class__ = FusedBlock
    return model
