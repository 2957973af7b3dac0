"""splitkv's torch.library custom ops on the CPU (torch installed; skipped otherwise): their fake
implementations give outputs of q's shape and dtype, so torch.export and make_fx trace a function
that calls them in one graph, with the op's node in it and nothing run. What the ops compute is the
GPU suite's (the ops call DecodeAttention.run and splitkv.decode)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("splitkv.integrations.torch_ops")


def _inputs(tokens=1):
    q = torch.randn(2, tokens, 8, 128, dtype=torch.bfloat16) if tokens > 1 else torch.randn(2, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 128, dtype=torch.bfloat16)  # [B, Hkv, L, D]
    return q, k, k.clone(), torch.tensor([64, 30], dtype=torch.int32)


class Layer(torch.nn.Module):
    def __init__(self, handle):
        super().__init__()
        self.handle = handle
        self.proj = torch.nn.Linear(128, 128, dtype=torch.bfloat16)

    def forward(self, q, k, v, plan):
        out = torch.ops.splitkv.run(self.proj(q), k, v, plan, self.handle)
        return self.proj(out)


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_run_op_exports_in_one_graph(tokens):
    q, k, v, plan = _inputs(tokens)
    exported = torch.export.export(Layer(7), (q, k, v, plan))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert torch.ops.splitkv.run.default in targets
    (node,) = [n for n in exported.graph.nodes if n.target == torch.ops.splitkv.run.default]
    assert tuple(node.meta["val"].shape) == tuple(q.shape) and node.meta["val"].dtype == torch.bfloat16


def test_the_decode_op_traces_with_its_variants():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, lens = _inputs(2)
    sinks = torch.zeros(8)

    def step(q, k, v, lens, sinks):
        return torch.ops.splitkv.decode(q, k, v, lens, "HND", 100, 30.0, sinks)

    graph = make_fx(step, tracing_mode="fake")(q, k, v, lens, sinks)
    calls = [n for n in graph.graph.nodes if n.target == torch.ops.splitkv.decode.default]
    assert len(calls) == 1 and tuple(calls[0].args[4:7]) == ("HND", 100, 30.0)


def test_handles_name_instances_only():
    with pytest.raises(TypeError, match="DecodeAttention"):
        ops.handle(object())
    with pytest.raises(ValueError, match="names no live DecodeAttention"):
        ops._instance(10**9)
