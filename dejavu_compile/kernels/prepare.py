"""One-time weight layouts for the sparse ops (call when the graph is compiled, never per step).

Each helper returns a dict holding one copy of every weight, in the layout the sparse op reads, and
the dense layouts as *views* of it (key ``"dense"``), so the caller can drop the original parameters
and the prefill path keeps working from the same storage: memory overhead 0% once the originals are
released (the copies exist side by side only while one layer is being prepared).

Layouts:
- gated MLP: gate and up stacked as one (F, 2, d) tensor: a neuron's gate row and up row are
  adjacent, so one gather fetches both. ``w_gate``/``w_up`` are its [:, 0] / [:, 1] views, which
  ``F.linear`` accepts as strided weights. The down weight is stored transposed, (F, d) contiguous;
  the dense (d, F) weight is ``w_down_t.t()``.
- plain MLP: w_up (F, d) as in nn.Linear, down transposed as above.
- attention: q rows are already head-major in nn.Linear (head h owns rows h*D:(h+1)*D); the output
  weight is stored transposed (H*D, hidden) so a head's slice is a contiguous block of rows.

``layout="in_out"`` takes GPT-2 ``Conv1D`` weights (in, out).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _out_in(w: Tensor, layout: str) -> Tensor:
    if layout == "out_in":
        return w
    if layout == "in_out":
        return w.t()
    raise ValueError(f"layout must be 'out_in' or 'in_out', got {layout!r}")


def _detach(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def prepare_gated_mlp_weights(w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                              b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
                              b_down: Optional[Tensor] = None, *, layout: str = "out_in") -> dict:
    """Layouts for ``sparse_gated_mlp``: keys w_gate, w_up, w_down_t, b_gate, b_up, b_down (op
    arguments), w_gate_up (the (F, 2, d) storage) and dense = {w_gate, w_up, w_down} views."""
    wg, wu, wd = (_out_in(w.detach(), layout) for w in (w_gate, w_up, w_down))
    if wg.shape != wu.shape or wd.shape != (wg.shape[1], wg.shape[0]):
        raise ValueError(f"expected w_gate, w_up (F, d) and w_down (d, F), got {tuple(wg.shape)}, "
                         f"{tuple(wu.shape)}, {tuple(wd.shape)}")
    w_gate_up = torch.stack([wg, wu], dim=1).contiguous()
    w_down_t = wd.t().contiguous()
    return {
        "w_gate": w_gate_up[:, 0], "w_up": w_gate_up[:, 1], "w_down_t": w_down_t,
        "b_gate": _detach(b_gate), "b_up": _detach(b_up), "b_down": _detach(b_down),
        "w_gate_up": w_gate_up,
        "dense": {"w_gate": w_gate_up[:, 0], "w_up": w_gate_up[:, 1], "w_down": w_down_t.t()},
    }


def prepare_mlp_weights(w_up: Tensor, w_down: Tensor, b_up: Optional[Tensor] = None,
                        b_down: Optional[Tensor] = None, *, layout: str = "out_in") -> dict:
    """Layouts for ``sparse_mlp``: keys w_up, b_up, w_down_t, b_down, dense = {w_up, w_down}."""
    wu, wd = (_out_in(w.detach(), layout) for w in (w_up, w_down))
    if wd.shape != (wu.shape[1], wu.shape[0]):
        raise ValueError(f"expected w_up (F, d) and w_down (d, F), got {tuple(wu.shape)}, {tuple(wd.shape)}")
    wu = wu.contiguous()
    w_down_t = wd.t().contiguous()  # a no-op for Conv1D, whose c_proj weight is already (F, d)
    return {"w_up": wu, "b_up": _detach(b_up), "w_down_t": w_down_t, "b_down": _detach(b_down),
            "dense": {"w_up": wu, "w_down": w_down_t.t()}}


def prepared_overhead(prepared: dict, originals: list[Tensor]) -> float:
    """Extra weight bytes the prepared dict holds, as a fraction of ``originals``' bytes
    (0.0 when the prepared layouts replace the originals one for one)."""
    seen, held = set(), 0
    for v in prepared.values():
        if isinstance(v, Tensor):
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                held += st.nbytes()
    dense = sum(t.numel() * t.element_size() for t in originals)
    return held / dense - 1.0
