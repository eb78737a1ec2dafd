"""The ops under torch.library.opcheck and inside torch.compile(fullgraph=True) with Inductor."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest_kernels import attention_problem, attn_args, mlp_problem  # noqa: F401 (sets the inductor cache dir)
from dejavu_compile.kernels import prepare_gated_mlp_weights, sparse_gated_mlp, sparse_head_attention, sparse_mlp

torch.set_num_threads(1)


def _gated_samples():
    out = []
    for per_row, biases in ((False, False), (True, True)):
        p = mlp_problem(seed=1, batch=3, d=20, n=33, k=9, dtype=torch.float32, gated=True,
                        per_row=per_row, biases=biases)
        out.append(((p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu"),
                    dict(b_gate=p["b_gate"], b_up=p["b_up"], b_down=p["b_down"])))
    # the prepared layout: gate/up are strided views of one (F, 2, d) tensor
    prep = prepare_gated_mlp_weights(p["w_gate"], p["w_up"], p["w_down_t"].t())
    out.append(((p["x"], prep["w_gate"], prep["w_up"], prep["w_down_t"], p["idx"], "gelu"), {}))
    return out


def _plain_samples():
    out = []
    for per_row, biases in ((False, True), (True, False)):
        p = mlp_problem(seed=2, batch=2, d=17, n=40, k=12, dtype=torch.float32, gated=False,
                        per_row=per_row, biases=biases)
        out.append(((p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"], "relu"), {}))
    return out


def _attn_samples():
    out = []
    for per_row, cache, rotary in ((False, "dynamic", 8), (True, "static", 4), (False, "bool_mask", 0)):
        p = attention_problem(3, 2, 24, 2, 2, 8, 6, rotary, 3, torch.float32, per_row, per_row, cache)
        out.append((tuple(attn_args(p)), {}))
    return out


OPS = {"gated": (sparse_gated_mlp, _gated_samples), "plain": (sparse_mlp, _plain_samples),
       "attention": (sparse_head_attention, _attn_samples)}


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    op, samples = OPS[name]
    for args, kwargs in samples():
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("name", OPS)
def test_compiled_fullgraph_matches_eager(name):
    op, samples = OPS[name]

    def block(args, kwargs):  # some dense work around the op, as in a decoder layer
        x = F.layer_norm(args[0], args[0].shape[-1:])
        return op(x, *args[1:], **kwargs) * 2 + 1

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="inductor")
    for args, kwargs in samples():
        torch.testing.assert_close(compiled(args, kwargs), block(args, kwargs), rtol=1e-5, atol=1e-5)
