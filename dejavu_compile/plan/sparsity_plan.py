"""SparsityPlan: per-layer predictors and k, bound to one model by a fingerprint.

On disk (a directory):
    plan.json          format version, fingerprint, calibration settings, one record per entry
    predictors.safetensors   "{layer}.{kind}.A", ".B", optional ".a", ".b"
`SparsityPlan.load` validates everything it reads and raises ValueError naming the problem;
`plan.check(model)` raises ValueError listing what differs between the plan's model and `model`.

Predictor kinds (entry.nonlinearity):
    "none" / "relu":  scores = act(x A + a) B + b          (Deja Vu, A: (d, r), B: (r, total))
    "glu":            h = x A + a, A: (d, 2r), B: (2r, total); scores = |act(h[:r] B[:r]) * (h[r:] B[r:])|
                      a low-rank copy of the gated MLP itself (`activation` names act).
    "glu_int8":       A: (2 total, d) int8, the block's own gate rows then up rows, quantized per row
                      with scales a: (2 total,); scores = |act(g~) * u~| with [g~, u~] = (x A^T) * a.
                      Near-oracle selection for gated MLPs at 1/6 of an fp32 block's bytes. Reads the
                      block's own input (no lookahead).
    "glu_int4":       A: (2 total, d/2) uint8, gate rows then up rows in 4 bits (two codes a byte, low
                      nibble first, code + 8), scales a: (2 total, d/32) fp16 (one per 32 columns),
                      optional biases b: (2 total,); [g~, u~] = x dequant(A)^T + b, scores = |act(g~) * u~|.
                      The learned predictor for gated MLPs: fitted to the calibration activations
                      (predictors.fit_int4_glu_predictor), 1/11 of an fp32 block's bytes. With
                      lookahead it reads the attention block's input (and has the biases).
    "dense":          no predictor (k == total).

Values of the kept neurons (entry.values):
    "exact":      the block computes act(gate.x) * (up.x) for its kept neurons from its own weights.
    "predictor":  ("glu_int8" entries only) the kept neurons' act(g~) * u~ are the int8 predictor's own,
                  which it computes for every neuron to score them; the block then reads only the kept
                  rows of its down projection (gate and up weights are not read at all). Costs ~0.1%
                  perplexity on SmolLM2 (int8 rows, one scale each), saves 2/3 of the kept rows' bytes.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dejavu_compile import activations

FORMAT_VERSION = 1
KINDS = ("mlp", "attention")
NONLINEARITIES = ("none", "relu", "glu", "glu_int8", "glu_int4", "dense")
QUANTIZED = ("glu_int8", "glu_int4")  # tensors read as stored, not cast to the model dtype
VALUES = ("exact", "predictor")


@dataclass(eq=False)  # compared by identity: == on tensor fields is ambiguous (and Dynamo compares backend options)
class PlanEntry:
    layer: int
    kind: str  # "mlp" | "attention"
    k: int
    total: int
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    nonlinearity: str = "none"
    activation: str = "silu"  # used by "glu"
    lookahead: bool = False
    stats: dict[str, Any] = field(default_factory=dict)  # recall, mass etc. measured at calibration
    values: str = "exact"  # "predictor": kept neurons take the int8 predictor's act(g~) * u~ (see above)

    @property
    def density(self) -> float:
        return self.k / self.total

    @property
    def dense(self) -> bool:
        return self.k >= self.total

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., total) predictor scores (higher = keep)."""
        if self.A is None:
            return torch.ones(*x.shape[:-1], self.total, dtype=x.dtype, device=x.device)
        if self.nonlinearity == "glu_int8":
            from dejavu_compile.plan.predictors import int8_glu_scores

            t = {"A": self.A.to(x.device), "a": self.a.to(x.device, torch.float32)}
            flat = x.reshape(-1, x.shape[-1])
            return int8_glu_scores(flat, t, activations.torch_fn(self.activation)).view(*x.shape[:-1], -1)
        if self.nonlinearity == "glu_int4":
            from dejavu_compile.plan.predictors import int4_glu_scores

            t = {n: v.to(x.device) for n, v in self.tensors().items()}
            flat = x.reshape(-1, x.shape[-1])
            return int4_glu_scores(flat, t, activations.torch_fn(self.activation)).view(*x.shape[:-1], -1)
        A = self.A.to(x.device, x.dtype if x.dtype.is_floating_point else torch.float32)
        h = x.to(A.dtype) @ A
        if self.a is not None:
            h = h + self.a.to(h)
        B = self.B.to(h)
        if self.nonlinearity == "glu":
            r = B.shape[0] // 2
            act = activations.torch_fn(self.activation)
            s = (act(h[..., :r] @ B[:r]) * (h[..., r:] @ B[r:])).abs()
        else:
            if self.nonlinearity == "relu":
                h = torch.relu(h)
            s = h @ B
        if self.b is not None and self.nonlinearity != "glu":
            s = s + self.b.to(s)
        return s

    def select(self, x: torch.Tensor) -> torch.LongTensor:
        """(B, d) block (or lookahead) input -> (B, k) indices of the kept neurons / heads."""
        if self.dense:
            return torch.arange(self.total, device=x.device).expand(*x.shape[:-1], self.total)
        return self.scores(x).topk(self.k, dim=-1).indices

    def predictor_params(self) -> int:
        return sum(t.numel() for t in (self.A, self.B, self.a, self.b) if t is not None)

    def predictor_flops(self) -> int:
        """Multiply-adds x2 per token of the predictor."""
        if self.A is None:
            return 0
        if self.nonlinearity == "glu_int4":
            return 2 * 2 * self.A.numel()  # two codes a byte
        return 2 * sum(t.numel() for t in (self.A, self.B) if t is not None)

    def predictor_bytes(self) -> int:
        """Bytes of the predictor's tensors as stored."""
        return sum(t.numel() * t.element_size() for t in (self.A, self.B, self.a, self.b) if t is not None)

    def read_bytes(self, element_size: int) -> int:
        """Bytes the predictor reads per token in a model whose weights take `element_size` bytes."""
        return predictor_read_bytes(self.tensors().values(), self.nonlinearity in QUANTIZED, element_size)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: t.contiguous() for n, t in (("A", self.A), ("B", self.B), ("a", self.a), ("b", self.b)) if t is not None}


def predictor_read_bytes(tensors, quantized: bool, element_size: int) -> int:
    """Bytes a predictor reads per token: a quantized (int8, int4) predictor's tensors as stored,
    any other predictor's in the model's dtype (the backend casts them to it)."""
    if quantized:
        return sum(t.numel() * t.element_size() for t in tensors)
    return sum(t.numel() for t in tensors) * element_size


def model_fingerprint(model) -> dict[str, Any]:
    """Architecture, per-parameter shapes and a hash of the weights (sampled, fast, deterministic)."""
    cfg = model.config
    arch = {
        "model_type": getattr(cfg, "model_type", type(model).__name__),
        "num_layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_heads": getattr(cfg, "num_attention_heads", None),
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None),
    }
    h = hashlib.sha256()
    shapes = {}
    for name, p in sorted(model.state_dict().items()):
        shapes[name] = list(p.shape)
        flat = p.detach().reshape(-1).float().cpu()
        # Hash a strided sample (<= 4096 values per tensor): every tensor, fast for any size.
        step = max(1, flat.numel() // 4096)
        h.update(name.encode())
        h.update(flat[::step].numpy().tobytes())
    shape_hash = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    return {"architecture": arch, "shapes_hash": shape_hash, "weights_hash": h.hexdigest()[:16], "num_tensors": len(shapes)}


@dataclass(eq=False)
class SparsityPlan:
    entries: dict[tuple[int, str], PlanEntry]
    fingerprint: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- construction
    @classmethod
    def dense(cls, model, settings: dict | None = None) -> "SparsityPlan":
        """A plan that keeps every neuron and head (equivalence tests, baselines)."""
        cfg = model.config
        entries = {}
        for layer in range(cfg.num_hidden_layers):
            entries[(layer, "mlp")] = PlanEntry(layer, "mlp", cfg.intermediate_size, cfg.intermediate_size, nonlinearity="dense")
            entries[(layer, "attention")] = PlanEntry(
                layer, "attention", cfg.num_attention_heads, cfg.num_attention_heads, nonlinearity="dense"
            )
        return cls(entries, model_fingerprint(model), dict(settings or {"method": "dense"}))

    full_density = dense

    # ---------------------------------------------------------------- summaries
    def _density(self, kind: str) -> float:
        es = [e for (l, k), e in self.entries.items() if k == kind]
        if not es:
            return 1.0
        return sum(e.k for e in es) / sum(e.total for e in es)

    @property
    def mlp_density(self) -> float:
        """Average fraction of MLP neurons kept (over all layers)."""
        return self._density("mlp")

    @property
    def attn_density(self) -> float:
        return self._density("attention")

    @property
    def num_layers(self) -> int:
        return 1 + max(l for l, _ in self.entries) if self.entries else 0

    def entry(self, layer: int, kind: str) -> PlanEntry:
        return self.entries[(layer, kind)]

    def summary(self) -> str:
        lines = [f"SparsityPlan: {self.num_layers} layers, MLP density {self.mlp_density:.3f}, attention density {self.attn_density:.3f}"]
        for (l, kind), e in sorted(self.entries.items()):
            extra = " ".join(f"{k}={v:.3f}" for k, v in e.stats.items() if isinstance(v, float))
            values = "" if e.values == "exact" else f" values={e.values}"
            lines.append(f"  L{l:02d} {kind:9s} k={e.k:5d}/{e.total:<5d} {e.nonlinearity:5s} lookahead={e.lookahead}{values} {extra}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- model binding
    def check(self, model) -> None:
        """Raise ValueError saying what differs when `model` is not the model this plan was made for."""
        fp = model_fingerprint(model)
        diffs = []
        for key, want in self.fingerprint.get("architecture", {}).items():
            got = fp["architecture"].get(key)
            if got != want:
                diffs.append(f"{key}: plan has {want}, model has {got}")
        if not diffs and fp["shapes_hash"] != self.fingerprint.get("shapes_hash"):
            diffs.append("parameter names/shapes differ")
        if not diffs and fp["weights_hash"] != self.fingerprint.get("weights_hash"):
            diffs.append(
                f"weights differ (hash {self.fingerprint.get('weights_hash')} in plan vs {fp['weights_hash']}): "
                "same architecture but other weights (a fine-tune or another checkpoint); recalibrate"
            )
        if diffs:
            raise ValueError("SparsityPlan does not match this model: " + "; ".join(diffs))

    # ---------------------------------------------------------------- persistence
    def save(self, directory) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors, records = {}, []
        for (layer, kind), e in sorted(self.entries.items()):
            for n, t in e.tensors().items():
                stored = t.detach() if e.nonlinearity in QUANTIZED else t.detach().float()  # codes and scales as they are
                tensors[f"{layer}.{kind}.{n}"] = stored.cpu().contiguous()
            records.append(
                {"layer": layer, "kind": kind, "k": e.k, "total": e.total, "nonlinearity": e.nonlinearity,
                 "activation": e.activation, "lookahead": e.lookahead, "values": e.values,
                 "tensors": sorted(e.tensors()), "stats": e.stats}
            )
        digest = hashlib.sha256()
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(tensors[name].numpy().tobytes())
        meta = {"format": "dejavu-compile-plan", "version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "settings": self.settings, "entries": records, "tensors_sha256": digest.hexdigest()}
        save_file(tensors, str(d / "predictors.safetensors"))
        (d / "plan.json").write_text(json.dumps(meta, indent=1, default=_json_default))
        return d

    @classmethod
    def load(cls, directory, model=None) -> "SparsityPlan":
        """Read a plan directory; with `model`, also `check` it against the model."""
        d = Path(directory)
        if not d.is_dir():
            raise ValueError(f"SparsityPlan directory {d} does not exist")
        meta_path, tens_path = d / "plan.json", d / "predictors.safetensors"
        if not meta_path.exists():
            raise ValueError(f"{d} is not a SparsityPlan (plan.json missing: partial or wrong directory)")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{meta_path} is corrupt (not valid JSON: {err})") from err
        if not isinstance(meta, dict) or meta.get("format") != "dejavu-compile-plan":
            raise ValueError(f"{meta_path} is not a dejavu-compile plan file")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path} has plan format version {meta.get('version')}, this code reads {FORMAT_VERSION}")
        records = meta.get("entries")
        if not isinstance(records, list):
            raise ValueError(f"{meta_path} is corrupt: 'entries' missing")
        needs_tensors = any(r.get("tensors") for r in records)
        tensors: dict[str, torch.Tensor] = {}
        if needs_tensors:
            if not tens_path.exists():
                raise ValueError(f"{d} is partial: predictors.safetensors missing")
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                tensors = load_file(str(tens_path))
            except (SafetensorError, OSError, RuntimeError, ValueError) as err:
                raise ValueError(f"{tens_path} is corrupt or truncated ({err})") from err
            digest = hashlib.sha256()
            for name in sorted(tensors):
                digest.update(name.encode())
                digest.update(tensors[name].numpy().tobytes())
            if digest.hexdigest() != meta.get("tensors_sha256"):
                raise ValueError(f"{tens_path} does not match plan.json (checksum differs: corrupt or from another plan)")
        entries = {}
        for r in records:
            try:
                layer, kind, k, total = int(r["layer"]), r["kind"], int(r["k"]), int(r["total"])
                nl = r.get("nonlinearity", "none")
                values = r.get("values", "exact")  # plans written before values existed: exact
                if kind not in KINDS or nl not in NONLINEARITIES or values not in VALUES or not (1 <= k <= total):
                    raise ValueError(f"bad values {r!r}")
                ts = {n: tensors[f"{layer}.{kind}.{n}"] for n in r.get("tensors", [])}
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{meta_path} is corrupt: bad entry ({err})") from err
            e = PlanEntry(layer, kind, k, total, ts.get("A"), ts.get("B"), ts.get("a"), ts.get("b"), nl,
                          r.get("activation", "silu"), bool(r.get("lookahead", False)), r.get("stats", {}), values)
            _validate_entry(e)
            entries[(layer, kind)] = e
        plan = cls(entries, meta.get("fingerprint", {}), meta.get("settings", {}))
        if model is not None:
            plan.check(model)
        return plan


def _validate_entry(e: PlanEntry) -> None:
    if e.values not in VALUES:
        raise ValueError(f"plan entry layer {e.layer} {e.kind}: values must be one of {VALUES}, got {e.values!r}")
    if e.values == "predictor" and e.nonlinearity not in ("glu_int8", "dense"):
        raise ValueError(f"plan entry layer {e.layer} {e.kind}: values 'predictor' needs the int8 gate/up "
                         f"predictor ('glu_int8'), got {e.nonlinearity!r}")
    if e.A is None:
        if not e.dense:
            raise ValueError(f"plan entry layer {e.layer} {e.kind}: k={e.k} < total={e.total} but no predictor")
        return
    if e.nonlinearity == "glu_int8":
        if (e.A.dtype != torch.int8 or e.A.dim() != 2 or e.A.shape[0] != 2 * e.total
                or e.a is None or tuple(e.a.shape) != (2 * e.total,)):
            raise ValueError(f"plan entry layer {e.layer} {e.kind}: int8 predictor needs A int8 (2*{e.total}, d) "
                             f"and scales a ({2 * e.total},), got A {e.A.dtype} {tuple(e.A.shape)}")
        return
    if e.nonlinearity == "glu_int4":
        rows = 2 * e.total
        ok = (e.A.dtype == torch.uint8 and e.A.dim() == 2 and e.A.shape[0] == rows and e.a is not None
              and e.a.dim() == 2 and e.a.shape[0] == rows and e.a.shape[1] > 0
              and (2 * e.A.shape[1]) % e.a.shape[1] == 0 and (e.b is None or tuple(e.b.shape) == (rows,)))
        if not ok:
            raise ValueError(f"plan entry layer {e.layer} {e.kind}: int4 predictor needs A uint8 ({rows}, d/2), "
                             f"scales a ({rows}, groups) and optional biases b ({rows},), got A {e.A.dtype} "
                             f"{tuple(e.A.shape)}, a {None if e.a is None else tuple(e.a.shape)}")
        return
    if e.B is None or e.A.dim() != 2 or e.B.dim() != 2 or e.A.shape[1] != e.B.shape[0] or e.B.shape[1] != e.total:
        raise ValueError(
            f"plan entry layer {e.layer} {e.kind}: predictor shapes A {tuple(e.A.shape)}, "
            f"B {None if e.B is None else tuple(e.B.shape)} do not fit total={e.total}"
        )


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o)}")
