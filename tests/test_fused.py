"""Tests of fused.py, the rollout copy's fused projections and norms, and of the decode step's size: the fused
copy computes what the HF-layout model does, keeps its parameters and follows in-place refreshes (copy_weights_,
lora.copy_merged_); and a count of the aten ops one decode step dispatches, per layer, guards the kernels per
step on a GPU from growing back. Tiny random models, CPU."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora
from fused import FusedAttention, FusedDeltaNet, FusedMLP, FusedRMSNorm, fuse_for_sampling
from graphs import StaticDecode
from helpers import tiny_transformer
from kvcache import decode_step, prefill
from model import RMSNorm, Transformer, cast_copy, copy_weights_
from sampler import generate

# Aten ops one decode step dispatches per layer (qwen2 shape, bf16, the fused rollout copy), eager and static (the
# step graphs.py captures), counted by test_decode_step_op_budget; and the same without the view ops (slice,
# transpose, ...: no kernel). Before fusion: 50 and 44 (30 compute ops each): 7 matmuls, 4 ops per bf16 norm (now
# 1), RoPE twice, two residual adds (now inside addmm). Lower them when you cut ops.
OPS_PER_LAYER = {"eager": 46, "static": 40}
COMPUTE_OPS_PER_LAYER = 14
HYBRID_COMPUTE_OPS_PER_BLOCK = 288  # per [L, L, L, F]; unfused 363, most of the rest the DeltaNet's recurrent step
VIEWS = {"slice", "select", "transpose", "view", "reshape", "chunk", "split", "expand", "unsqueeze", "t", "alias"}


def tiny(family: str = "qwen2", layers: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    """A tiny random model: 2 layers, or the hybrid's [L, L, L, F] (layers: another count)."""
    layers = layers or (4 if family == "qwen3_5" else 2)
    model = tiny_transformer(family, layers, seed, tie=family == "qwen3")
    with torch.no_grad():
        for name, p in model.named_parameters():  # every parameter random: zero biases and unit norms hide bugs
            p.copy_(torch.randn_like(p) * 0.1 + name.endswith("norm.weight"))
    return model.to(dtype)


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def step_ops(model: Transformer, static: bool) -> Counter:
    """The aten ops of one decode step (two rows) of `model`: the eager step, or the static one graphs capture."""
    cache, logits = prefill(model, [[1, 2, 3], [4, 5]])
    cache = cache.fork(torch.arange(2), 8)
    tok, alive = torch.tensor([1, 2]), torch.ones(2, dtype=torch.bool)
    runner = StaticDecode() if static else None
    if runner:
        runner.adopt(cache)
    with CountOps() as count:
        runner(model, cache, tok, alive) if runner else decode_step(model, cache, tok, alive)
    return count.ops


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_fused_copy_computes_what_the_model_does(family):
    """Guards the fused rollout copy computing something else than the HF-layout model (a q/k/v or gate/up
    order mixed up, a bias lost, RoPE or Qwen3's q/k norms applied to the wrong heads; on the hybrid, the gates
    taken for queries, the partial rotation, a DeltaNet projection out of order, a zero-centred norm's 1 + w):
    logits of a forward and of cached decoding match the unfused model's in float32 (within 1e-5: fused kernels
    round differently) and the sampled tokens are the same; the parameters keep their names, shapes and values;
    in bf16 the fused copy is as close to float32 as the plain bf16 copy."""
    model = tiny(family)
    fused = fuse_for_sampling(cast_copy(model, torch.float32))
    attn = next(b.self_attn for b in fused.model.layers if hasattr(b, "self_attn"))
    assert isinstance(attn, FusedAttention) and isinstance(fused.model.layers[1].mlp, FusedMLP)
    if family == "qwen3_5":
        assert isinstance(fused.model.layers[0].linear_attn, FusedDeltaNet)
        assert all(isinstance(m, FusedRMSNorm) for m in fused.modules() if isinstance(m, RMSNorm))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (n, a), b in zip(fused.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n
    ids = torch.tensor([[3, 9, 27, 81, 5, 6], [1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), atol=1e-5, rtol=1e-5)
    bf16 = [cast_copy(model, torch.bfloat16), fuse_for_sampling(cast_copy(model, torch.bfloat16))]
    with torch.no_grad():  # in bf16 the one-kernel norm rounds once less: as far from float32 as the plain copy
        exact = model(ids)
        plain_err, fused_err = ((m(ids).float() - exact).abs().max() for m in bf16)
    assert fused_err <= 2 * plain_err and isinstance(bf16[1].model.norm, FusedRMSNorm)
    args = dict(max_new_tokens=12, n=2, temperature=1.0, seed=[1, 2])
    ref, out = generate(model, ids.tolist(), **args), generate(fused, ids.tolist(), **args)
    assert out.tokens == ref.tokens
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_fused_copy_follows_in_place_refreshes(family):
    """Guards a fused copy that stays at the starting weights: the projections' parameters are views of the
    fused weights, so copy_weights_ (after an update) and lora.copy_merged_ (merged adapters, on the hybrid's
    DeltaNet projections too) refresh them, and the copy then computes what a fresh copy of the new weights does."""
    model = tiny(family)
    fused = fuse_for_sampling(cast_copy(model, torch.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    copy_weights_(fused, model)
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), atol=1e-5, rtol=1e-5)
    attn = fused.model.layers[-1].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    targets = "q,k,v,o,gate,up,down" + (",qkv,z,b,a,out" if family == "qwen3_5" else "")
    lora.add_lora(model, 4, 8.0, lora.parse_targets(targets), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    merged = fuse_for_sampling(lora.merged_copy(model))
    with torch.no_grad():  # against the unfused merged copy: merging itself rounds (1.6e-5 on the hybrid)
        lora.copy_merged_(merged, model)
        torch.testing.assert_close(merged(ids), lora.merged_copy(model)(ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_decode_step_op_budget(static):
    """Guards the kernels per decode step from growing back (on a GPU each op is a launch, or a node of the
    captured graph, that the step waits for): the aten ops one step dispatches per layer (the difference between
    a 4-layer and a 2-layer model, halved) for the bf16 fused rollout copy, eager and static, stay within the
    budget; projections are 4 matmuls per layer, not 7."""
    per_layer = []
    for layers in (2, 4):
        model = fuse_for_sampling(cast_copy(tiny("qwen2", layers), torch.bfloat16))
        per_layer.append(step_ops(model, static))
    ops = per_layer[1] - per_layer[0]
    ops = Counter({k: v // 2 for k, v in ops.items()})
    compute = sum(v for k, v in ops.items() if k not in VIEWS)
    assert ops["linear"] + ops["addmm"] == 4, ops
    assert sum(ops.values()) <= OPS_PER_LAYER["static" if static else "eager"], ops
    assert compute <= COMPUTE_OPS_PER_LAYER, ops
    unfused = [step_ops(cast_copy(tiny("qwen2", n), torch.bfloat16), static) for n in (2, 4)]
    assert sum((unfused[1] - unfused[0]).values()) // 2 > sum(ops.values())


@pytest.mark.parametrize("static", [False, True])
def test_hybrid_decode_step_op_budget(static):
    """Guards the hybrid's fused copy (bf16): per [L, L, L, F] block (an 8-layer model less a 4-layer one), a
    decode step runs 16 matmuls, not 31 (a DeltaNet layer's qkv, z, b, a as one, each out_proj and down_proj with
    its residual add; the gated attention's q, k, v as one), and its compute ops stay within the budget."""
    per_block = []
    for fuse in (False, True):
        steps = []
        for layers in (4, 8):
            model = cast_copy(tiny("qwen3_5", layers), torch.bfloat16)
            steps.append(step_ops(fuse_for_sampling(model) if fuse else model, static))
        per_block.append(steps[1] - steps[0])
    plain, ops = per_block
    assert plain["linear"] == 31 and ops["linear"] + ops["addmm"] == 16 and ops["addmm"] == 8, ops
    assert sum(v for k, v in ops.items() if k not in VIEWS) <= HYBRID_COMPUTE_OPS_PER_BLOCK, ops
    assert sum(ops.values()) < sum(plain.values())
