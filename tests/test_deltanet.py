"""deltanet.py under torch.compile: the chunked delta rule compiled by Inductor (CPU) computes eager's outputs and
gradients, in one graph, for any length with the same number of chunks; the layer's mix traces whole."""

from types import SimpleNamespace

import pytest
import torch

import deltanet

pytestmark = pytest.mark.usefixtures("one_thread")


def rule_inputs(T: int, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, g, beta, S of 2 rows and 2 heads (dk 16, dv 8), every one a leaf that takes a gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k = (deltanet.l2norm(torch.randn(2, 2, T, 16, generator=g)) for _ in range(2))
    v = torch.randn(2, 2, T, 8, generator=g)
    x = [q * 0.25, k, v, -torch.rand(2, 2, T, generator=g), torch.rand(2, 2, T, generator=g)]
    return [t.requires_grad_() for t in (*x, torch.randn(2, 2, 16, 8, generator=g))]


def outputs_and_grads(rule, x: list[torch.Tensor]) -> list[torch.Tensor]:
    out, S = rule(*x)
    return [out, S, *torch.autograd.grad((out * out.detach().sin()).sum() + (S * S.detach().cos()).sum(), x)]


@pytest.mark.slow
def test_compiled_chunked_rule_equals_eager_forward_and_backward():
    """Guards the chunked rule's readiness for torch.compile (Inductor, dynamic shapes): one graph, no break; outputs,
    final state and the gradients of all six inputs equal eager's to float32 rounding, at 100 tokens (a full chunk
    and a ragged one) and, without compiling again, at 90."""
    explained = torch._dynamo.explain(deltanet.chunked_delta_rule)(*rule_inputs(100))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(deltanet.chunked_delta_rule, backend="inductor", dynamic=True)
    for T in (100, 90):
        x = rule_inputs(T, seed=T)
        with torch.compiler.set_stance("fail_on_recompile" if T == 90 else "default"):
            got = outputs_and_grads(compiled, x)
        for a, b in zip(got, outputs_and_grads(deltanet.chunked_delta_rule, x)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_layer_mix_traces_in_one_graph_without_padding():
    """Guards the layer against graph breaks under torch.compile: without `valid` the mix is one graph (given
    `valid`, its one break is the host's check whether any token is padding, which decides on sorting)."""
    config = SimpleNamespace(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        hidden_size=32,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    layer = deltanet.GatedDeltaNet(config, 0)
    x = torch.randn(2, 70, 32)
    explained = torch._dynamo.explain(layer.mix)(x, None, None)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
