"""``prepare_model``: lay out a model's weights the way the sparse kernels read them."""
from __future__ import annotations

import torch

from dejavu_compile.compiler.blocks import MLPBlock


def prepare_model(model, *example_args, **example_kwargs) -> list[str]:
    """Store each matched MLP's down-projection weight and each attention block's output-projection
    weight transposed, in place (values unchanged).

    The sparse kernels read a neuron's down weights (a head's output weights) as contiguous rows of
    ``W^T``; with the parameter stored that way the compiled graph uses a free view instead of holding
    a transposed copy. Dense ``F.linear`` reads the transposed storage just as fast. Best called before
    compiling; graphs compiled before recompile on their next call (Dynamo guards on the strides).
    Returns the names of the parameters re-laid out. Without example inputs, two token ids are used.
    """
    from dejavu_compile.compiler.explain import explain

    if not example_args and not example_kwargs:
        device = next(model.parameters()).device
        example_args = (torch.tensor([[1, 2]], device=device),)
    report = explain(model, *example_args, **example_kwargs)
    params = dict(model.named_parameters())
    changed = []
    for block in report.blocks:
        ref = block.down if isinstance(block, MLPBlock) else block.o
        if ref.layout != "out_in":
            continue
        param = params.get(ref.name)
        if param is None or param.t().is_contiguous():
            continue
        with torch.no_grad():
            param.data = param.data.t().contiguous().t()
        changed.append(ref.name)
    # Graphs compiled before need no reset: Dynamo guards on parameter strides and recompiles.
    return changed

