"""SparsityPlan: per-layer predictors and k, bound to one model by a fingerprint.

On disk (a directory):
    plan.json                format version, fingerprint, calibration settings, one record per entry
    predictors.safetensors   "{layer}.{kind}.{tensor name}" for each entry's predictor tensors
`SparsityPlan.load` validates everything it reads and raises ValueError naming the problem;
`plan.check(model)` raises ValueError listing what differs between the plan's model and `model`.
Plans of format version 1 (tensors "A", "B", "a", "b" and a "nonlinearity") load converted.

The fingerprint holds a weight sample (format 3): a few fp32 values of every parameter at positions
derived from its name. `sample_differences` compares it with a model's parameters within the
precision of the coarser dtype, so a bf16 or fp16 cast of the calibrated checkpoint passes and
another checkpoint (a fine-tune) does not; the backend runs the same comparison (compiler pass
`weights_check`). Plans of formats 1 and 2 have no sample: `check` compares the weights hash.

An entry's `predictor` names a kind in the table of `dejavu_compile.plan.predictors`, which says
what its tensors are and how they score; None means no predictor (the entry keeps everything).

The output head (``plan.head_candidates``, in the settings): 0 keeps it dense; k > 0 screens it in
decode graphs with an int8 copy of its weight built at compile time, the top k logits of each token
recomputed exactly (compiler pass ``head_screen``). Plans without the setting keep it dense.

The down rows of entries with values "predictor" (``plan.down_rows``, in the settings): "model" reads
the model's own down weights; "bfloat16" a bf16 copy the compiled graph builds from them and holds,
half the bytes (CPU fp32 decode, where the C++ op reads them; the masked simulation applies the same
rounding). Plans without it read "model".

Values of the kept neurons (entry.values):
    "exact":      the block computes act(gate.x) * (up.x) for its kept neurons from its own weights.
    "predictor":  the kept neurons take the predictor's own act(g~) * u~, which a kind that
                  `gives_values` (the int8 gate/up copy) computes for every neuron to score them; the
                  block then reads only the kept rows of its down projection (gate and up weights are
                  not read at all), at the cost of the predictor's int8 rounding.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dejavu_compile.errors import PlanMismatchError
from dejavu_compile.plan import predictors
from dejavu_compile.plan.predictors.registry import PredictorKind

FORMAT_VERSION = 3  # 3: the fingerprint holds a weight sample; 1 and 2 load without one
READABLE_VERSIONS = (1, 2, 3)
KINDS = ("mlp", "attention")
VALUES = ("exact", "predictor")
# calibrate()'s default screen of the output head: exact logits for the top HEAD_CANDIDATES tokens,
# on heads of at least HEAD_MIN_ROWS rows (every real tokenizer; a tiny test vocabulary stays exact)
HEAD_CANDIDATES = 64
HEAD_MIN_ROWS = 4096
DOWN_ROWS = ("model", "bfloat16")
DEFAULT_DOWN_ROWS = "bfloat16"  # calibrate()'s default
# Format 1 named the predictor by its nonlinearity (each kind's v1_code); its tensors A/B/a/b map
# through each kind's v1_names.


@dataclass(eq=False)  # compared by identity: == on tensor fields is ambiguous (and Dynamo compares backend options)
class PlanEntry:
    layer: int
    kind: str  # "mlp" | "attention"
    k: int
    total: int
    predictor: str | None = None  # a predictor kind's name; None: no predictor (k == total)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # named as the kind names them
    activation: str = "silu"  # the block's activation (gated predictors compute act(g~) * u~)
    lookahead: bool = False
    stats: dict[str, Any] = field(default_factory=dict)  # recall, mass etc. measured at calibration
    values: str = "exact"  # "predictor": kept neurons take the predictor's act(g~) * u~ (see above)

    def __post_init__(self):
        if self.predictor is not None:
            predictors.get(self.predictor)  # an unknown name fails here, naming the known ones

    @property
    def predictor_kind(self) -> PredictorKind | None:
        return None if self.predictor is None else predictors.get(self.predictor)

    @property
    def density(self) -> float:
        return self.k / self.total

    @property
    def dense(self) -> bool:
        return self.k >= self.total

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., total) predictor scores (higher = keep)."""
        if self.predictor is None:
            return torch.ones(*x.shape[:-1], self.total, dtype=x.dtype, device=x.device)
        return self.predictor_kind.scores(self.tensors, x, self.activation)

    def select(self, x: torch.Tensor) -> torch.LongTensor:
        """(B, d) block (or lookahead) input -> (B, k) indices of the kept neurons / heads."""
        if self.dense:
            return torch.arange(self.total, device=x.device).expand(*x.shape[:-1], self.total)
        return self.scores(x).topk(self.k, dim=-1).indices

    def predictor_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def predictor_flops(self) -> int:
        """Multiply-adds x2 per token of the predictor."""
        return 0 if self.predictor is None else self.predictor_kind.flops(self.tensors)

    def predictor_bytes(self) -> int:
        """Bytes of the predictor's tensors as stored."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def read_bytes(self, element_size: int) -> int:
        """Bytes the predictor reads per token in a model whose weights take `element_size` bytes."""
        return 0 if self.predictor is None else self.predictor_kind.read_bytes(self.tensors, element_size)


def default_head_candidates(head_rows: int | None) -> int:
    """The output head screen's k for a head of ``head_rows`` rows (None: no head): HEAD_CANDIDATES
    on a real vocabulary, 0 (dense) below HEAD_MIN_ROWS."""
    return HEAD_CANDIDATES if head_rows is not None and head_rows >= HEAD_MIN_ROWS else 0


def check_head_candidates(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"head_candidates must be an int >= 0 (0: the output head stays dense), got {k!r}")
    return k


def check_down_rows(kind) -> str:
    if kind not in DOWN_ROWS:
        raise ValueError(f"down_rows must be one of {DOWN_ROWS}, got {kind!r}")
    return kind


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
    return {"architecture": arch, "shapes_hash": shape_hash, "weights_hash": h.hexdigest()[:16],
            "num_tensors": len(shapes),
            "weight_sample": weight_sample(model.named_parameters(remove_duplicate=False))}


SAMPLE_PER_PARAMETER = 16
SAMPLE_AGREEMENT = 0.75  # share of a parameter's sampled values that must agree for "same weights"


def sample_positions(name: str, shape) -> list[tuple[int, ...]]:
    """Where a parameter is sampled: indices derived from its name (sha256, the same on every
    platform and torch version), SAMPLE_PER_PARAMETER of them (every element of a smaller tensor)."""
    numel = math.prod(shape)
    if numel <= SAMPLE_PER_PARAMETER:
        flat = list(range(numel))
    else:
        flat = [int.from_bytes(hashlib.sha256(f"{name}:{i}".encode()).digest()[:8], "little") % numel
                for i in range(SAMPLE_PER_PARAMETER)]
    out = []
    for f in flat:  # row-major logical index: independent of strides (prepare_model re-lays out in place)
        index = []
        for size in reversed(tuple(shape)):
            index.append(f % size)
            f //= size
        out.append(tuple(reversed(index)))
    return out


def sampled_values(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The fp32 values of `tensor` at `sample_positions(name, ...)` (reads a few elements, no copy)."""
    positions = sample_positions(name, tensor.shape)
    t = tensor.detach()
    if not positions:
        return torch.zeros(0)
    if t.dim() == 0:
        return t.reshape(1).float().cpu()
    index = tuple(torch.tensor(axis, device=t.device) for axis in zip(*positions))
    return t[index].float().cpu()


def weight_sample(named_tensors) -> dict[str, Any]:
    """The fingerprint's weight sample of (name, tensor) pairs: fp32 values and each tensor's dtype."""
    values, dtypes = {}, {}
    for name, tensor in named_tensors:
        if tensor.device.type == "meta" or name in values:
            continue
        values[name] = sampled_values(name, tensor).tolist()
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
    return {"per_parameter": SAMPLE_PER_PARAMETER, "values": values, "dtypes": dtypes}


def sample_name(sample: dict[str, Any], name: str) -> str | None:
    """The sample's name for a parameter path, which may carry a prefix (a compiled wrapper's
    attribute path, e.g. ``self.model.layers.0...``): the longest dotted suffix the sample holds."""
    values = sample["values"]
    parts = name.split(".")
    for start in range(len(parts)):
        candidate = ".".join(parts[start:])
        if candidate in values:
            return candidate
    return None


def same_weights(sample: dict[str, Any], name: str, tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds the sampled parameter `name`'s values, up to the precision of the
    coarser of its dtype and the sampled one: at least SAMPLE_AGREEMENT of the values agree."""
    want = torch.tensor(sample["values"][name], dtype=torch.float32)
    got = sampled_values(name, tensor)
    if want.shape != got.shape:
        return False
    if want.numel() == 0:
        return True
    coarse = _coarser(getattr(torch, sample["dtypes"].get(name, "float32"), torch.float32), tensor.dtype)
    if coarse.is_floating_point:
        info = torch.finfo(coarse)
        # one eps relative: twice the rounding of a cast; subnormals: the coarse dtype's spacing there
        agree = torch.isclose(got, want, rtol=info.eps, atol=info.smallest_normal * info.eps, equal_nan=True)
    else:
        agree = got == want
    return agree.float().mean().item() >= SAMPLE_AGREEMENT


def sample_differences(sample: dict[str, Any], named_tensors) -> tuple[list[str], int]:
    """(names of the parameters whose values differ from the sample's, parameters compared).
    Parameters the sample does not hold are not compared."""
    differ, compared = [], 0
    for name, tensor in named_tensors:
        key = sample_name(sample, name)
        if key is None or tensor.device.type == "meta":
            continue
        compared += 1
        if not same_weights(sample, key, tensor):
            differ.append(key)
    return differ, compared


def describe_weight_differences(differ: list[str], compared: int) -> str:
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return (f"weights differ from the ones the plan was calibrated on in {len(differ)} of {compared} parameters "
            f"({shown}): same architecture but other weights (a fine-tune or another checkpoint); recalibrate "
            "on this model")


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if not (a.is_floating_point and b.is_floating_point):
        return a if not a.is_floating_point else b
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


@dataclass(eq=False)
class SparsityPlan:
    entries: dict[tuple[int, str], PlanEntry]
    fingerprint: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    # the format of the file the plan was loaded from (a plan made in memory has the current one)
    format_version: int = FORMAT_VERSION

    # ---------------------------------------------------------------- construction
    @classmethod
    def dense(cls, model, settings: dict | None = None) -> SparsityPlan:
        """A plan that keeps every neuron and head (equivalence tests, baselines)."""
        cfg = model.config
        entries = {}
        for layer in range(cfg.num_hidden_layers):
            entries[(layer, "mlp")] = PlanEntry(layer, "mlp", cfg.intermediate_size, cfg.intermediate_size)
            heads = cfg.num_attention_heads
            entries[(layer, "attention")] = PlanEntry(layer, "attention", heads, heads)
        return cls(entries, model_fingerprint(model), dict(settings or {"method": "dense"}))

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

    @property
    def head_candidates(self) -> int:
        """Tokens per decode row whose logits the output head computes exactly from an int8 screen of
        every row (0: the head stays dense)."""
        return int(self.settings.get("head_candidates") or 0)

    @head_candidates.setter
    def head_candidates(self, k: int) -> None:
        self.settings["head_candidates"] = check_head_candidates(k)

    @property
    def down_rows(self) -> str:
        """What entries with values "predictor" read their kept down rows from: "model" (the model's
        own weights) or "bfloat16" (a bf16 copy the compiled graph holds)."""
        return self.settings.get("down_rows") or "model"

    @down_rows.setter
    def down_rows(self, kind: str) -> None:
        self.settings["down_rows"] = check_down_rows(kind)

    def entry(self, layer: int, kind: str) -> PlanEntry:
        return self.entries[(layer, kind)]

    def summary(self) -> str:
        head = f", output head screened (top {self.head_candidates} exact)" if self.head_candidates else ""
        if self.down_rows != "model":
            head += f", {self.down_rows} down rows"
        lines = [f"SparsityPlan: {self.num_layers} layers, MLP density {self.mlp_density:.3f}, attention density "
                 f"{self.attn_density:.3f}{head}"]
        for (l, kind), e in sorted(self.entries.items()):
            extra = " ".join(f"{k}={v:.3f}" for k, v in e.stats.items() if isinstance(v, float))
            values = "" if e.values == "exact" else f" values={e.values}"
            lines.append(f"  L{l:02d} {kind:9s} k={e.k:5d}/{e.total:<5d} {e.predictor or 'dense':13s} "
                         f"lookahead={e.lookahead}{values} {extra}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- model binding
    @property
    def weight_sample(self) -> dict[str, Any] | None:
        """The sampled weights of the model the plan was made for (None in plans of formats 1 and 2)."""
        sample = self.fingerprint.get("weight_sample")
        return sample if isinstance(sample, dict) and isinstance(sample.get("values"), dict) else None

    def check(self, model) -> None:
        """Raise ValueError saying what differs when `model` is not the model this plan was made for.
        A dtype cast of the same weights (bf16, fp16) is the same model."""
        fp = model_fingerprint(model)
        diffs = []
        for key, want in self.fingerprint.get("architecture", {}).items():
            got = fp["architecture"].get(key)
            if got != want:
                diffs.append(f"{key}: plan has {want}, model has {got}")
        if not diffs and fp["shapes_hash"] != self.fingerprint.get("shapes_hash"):
            diffs.append("parameter names/shapes differ")
        sample = self.weight_sample
        if not diffs and sample is not None:
            differ, compared = sample_differences(sample, model.named_parameters(remove_duplicate=False))
            if differ:
                diffs.append(describe_weight_differences(differ, compared))
        elif not diffs and fp["weights_hash"] != self.fingerprint.get("weights_hash"):  # formats 1, 2
            diffs.append(
                f"weights differ (hash {self.fingerprint.get('weights_hash')} in plan vs {fp['weights_hash']}): "
                "same architecture but other weights (a fine-tune or another checkpoint); recalibrate"
            )
        if diffs:
            raise PlanMismatchError("SparsityPlan does not match this model: " + "; ".join(diffs))

    # ---------------------------------------------------------------- persistence
    def save(self, directory) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors, records = {}, []
        for (layer, kind), e in sorted(self.entries.items()):
            for n, t in e.tensors.items():
                tensors[f"{layer}.{kind}.{n}"] = e.predictor_kind.storage(t).cpu().contiguous()
            records.append(
                {"layer": layer, "kind": kind, "k": e.k, "total": e.total, "predictor": e.predictor,
                 "activation": e.activation, "lookahead": e.lookahead, "values": e.values,
                 "tensors": sorted(e.tensors), "stats": e.stats}
            )
        meta = {"format": "dejavu-compile-plan", "version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "settings": self.settings, "entries": records, "tensors_sha256": _digest(tensors)}
        save_file(tensors, str(d / "predictors.safetensors"))
        (d / "plan.json").write_text(json.dumps(meta, indent=1, default=_json_default))
        # safetensors writes through a private (0600) temporary file: give both files plan.json's mode
        os.chmod(d / "predictors.safetensors", stat.S_IMODE((d / "plan.json").stat().st_mode))
        return d

    @classmethod
    def load(cls, directory, model=None) -> SparsityPlan:
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
        version = meta.get("version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise ValueError(f"{meta_path} has plan format version {version}, newer than this code reads "
                             f"(1 to {FORMAT_VERSION}): update dejavu-compile or recalibrate")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"{meta_path} has unknown plan format version {version!r} "
                             f"(this code reads 1 to {FORMAT_VERSION})")
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
            if _digest(tensors) != meta.get("tensors_sha256"):
                raise ValueError(f"{tens_path} does not match plan.json "
                                 "(checksum differs: corrupt or from another plan)")
        entries = {}
        for r in records:
            try:
                layer, kind, k, total = (_json_int(r, "layer"), r["kind"], _json_int(r, "k"),
                                         _json_int(r, "total"))
                values = r.get("values", "exact")  # plans written before values existed: exact
                if kind not in KINDS or values not in VALUES or not (1 <= k <= total):
                    raise ValueError(f"bad values {r!r}")
                stored = {n: tensors[f"{layer}.{kind}.{n}"] for n in r.get("tensors", [])}
                predictor, ts = _v1_predictor(r, stored) if version == 1 else (r.get("predictor"), stored)
                e = PlanEntry(layer, kind, k, total, predictor, ts, r.get("activation", "silu"),
                              bool(r.get("lookahead", False)), r.get("stats", {}), values)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{meta_path} is corrupt: bad entry ({err})") from err
            _validate_entry(e)
            entries[(layer, kind)] = e
        fingerprint = meta.get("fingerprint", {})
        if version >= 3 and not (isinstance(fingerprint, dict) and "weight_sample" in fingerprint):
            raise ValueError(f"{meta_path} is corrupt: plan format {version} binds the plan to its model's weights "
                             "with 'fingerprint.weight_sample', which is missing; recalibrate")
        _validate_weight_sample(fingerprint, meta_path)
        settings = meta.get("settings", {})
        if not isinstance(settings, dict):
            raise ValueError(f"{meta_path} is corrupt: 'settings' is not a mapping")
        try:
            check_head_candidates(settings.get("head_candidates", 0))
            check_down_rows(settings.get("down_rows", "model"))
        except ValueError as err:
            raise ValueError(f"{meta_path} is corrupt: {err}") from None
        plan = cls(entries, fingerprint, settings, format_version=version)
        if model is not None:
            plan.check(model)
        return plan


def _json_int(record: dict, key: str) -> int:
    """``record[key]`` if it is a JSON integer; a bool, string or float is a corrupt field, not cast."""
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _v1_predictor(record: dict, stored: dict[str, torch.Tensor]) -> tuple[str | None, dict[str, torch.Tensor]]:
    """A format-1 record's predictor name and tensors, renamed as its kind names them."""
    nonlinearity = record.get("nonlinearity", "none")
    name = predictors.v1_kind(nonlinearity)
    if not stored:
        return None, {}  # format 1 wrote tensorless (dense) entries with any nonlinearity
    if name is None:
        raise ValueError("a 'dense' entry with predictor tensors")
    renames = predictors.get(name).v1_names
    unknown = set(stored) - set(renames)
    if unknown:
        raise ValueError(f"{nonlinearity!r} entry with unexpected tensors {sorted(unknown)}")
    return name, {renames[old]: t for old, t in stored.items()}


def _validate_entry(e: PlanEntry) -> None:
    where = f"plan entry layer {e.layer} {e.kind}"
    if e.values not in VALUES:
        raise ValueError(f"{where}: values must be one of {VALUES}, got {e.values!r}")
    kind = e.predictor_kind
    if e.values == "predictor" and kind is not None and not kind.gives_values:
        givers = [n for n in predictors.names() if predictors.get(n).gives_values]
        raise ValueError(f"{where}: values 'predictor' needs the int8 gate/up predictor (a kind that gives "
                         f"the neurons' values: {', '.join(map(repr, givers))}), got {e.predictor!r}")
    if kind is None:
        if not e.dense:
            raise ValueError(f"{where}: k={e.k} < total={e.total} but no predictor")
        if e.tensors:
            raise ValueError(f"{where}: tensors {sorted(e.tensors)} but no predictor")
        return
    try:
        kind.validate(e.tensors, e.total)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _validate_weight_sample(fingerprint, meta_path) -> None:
    sample = fingerprint.get("weight_sample") if isinstance(fingerprint, dict) else None
    if sample is None:
        return
    values = sample.get("values") if isinstance(sample, dict) else None
    if not (isinstance(values, dict) and isinstance(sample.get("dtypes", {}), dict)
            and all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in values.values())):
        raise ValueError(f"{meta_path} is corrupt: bad weight sample in the fingerprint")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].numpy().tobytes())
    return digest.hexdigest()


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o)}")
