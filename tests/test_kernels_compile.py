"""The ops under torch.library.opcheck and inside torch.compile(fullgraph=True) with Inductor."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_reference import OPS

torch.set_num_threads(1)


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
