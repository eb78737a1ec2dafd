"""Block matching on traced decoders: every layer found, every weight given its role, or reported."""
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import dejavu_compile
from dejavu_compile.compiler.passes.match_mlp import MLPRule
from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model
from tests.helpers import token_ids

# The activation each HF config name must be recognised as (the matcher checks numerically).
HF_ACTIVATION = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                 "relu": "relu", "gelu": "gelu", "gelu_fast": "gelu_tanh", "relu2": "relu2"}


def _hidden_act(config):
    for key in ("hidden_activation", "hidden_act", "activation_function"):
        value = getattr(config, key, None)
        if value:
            return value
    raise AssertionError("config names no activation")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_explain_matches_every_layer(arch, attn):
    model = tiny_model(arch, layers=3, attn_implementation=attn)
    report = dejavu_compile.explain(model, token_ids(1, 5))
    assert report.num_layers == 3
    assert report.mlp_matched == 3, str(report)
    assert report.attention_matched == 3, str(report)
    assert report.fallbacks == [], str(report)

    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    names = dict(model.named_parameters())
    for block in report.blocks:
        for ref in block.weights.values():
            assert ref.name in names, f"{ref.name} is not a parameter of the model"
        if block.kind == "mlp":
            assert block.activation == HF_ACTIVATION[_hidden_act(config)]
            assert block.gated == (arch in ("llama", "mistral", "qwen2", "gemma3_text", "phi3"))
            assert block.intermediate_size == 128 and block.hidden_size == 64
            assert not block.decode and block.tokens == 5
        else:
            assert (block.num_heads, block.num_kv_heads, block.head_dim) == (heads, kv_heads, 64 // heads)
            assert block.attention == attn
            rotary = {"opt": "none", "gpt2": "none", "gpt_neox": "partial", "nemotron": "partial"}.get(arch, "full")
            assert block.rotary == rotary
            assert block.cache == "cat"
            # Head h of q must read the rows of its own slice of the (possibly fused) weight.
            rows = block.nodes.head_rows["q"]
            assert rows.shape == (heads, 64 // heads)
            assert rows.flatten().unique().numel() == 64
    assert "left dense: nothing" in str(report)


def test_explain_row_mapping_is_numerically_right():
    """The q rows a record names must reproduce q_proj's head outputs (GPT-NeoX interleaves q/k/v)."""
    model = tiny_model("gpt_neox", layers=1)
    report = dejavu_compile.explain(model, token_ids(1, 5))
    attn = report.blocks_of_layer(0)[0]
    assert attn.kind == "attention"
    weight = dict(model.named_parameters())[attn.q.name]
    x = torch.randn(3, 64)
    fused = F.linear(x, weight)  # (3, 3 * heads * head_dim), layout (heads, 3, head_dim)
    per_head = fused.view(3, 4, 3, 16)[:, :, 0, :]  # HF's own split: chunk(3) of each head's slice
    rows = attn.nodes.head_rows["q"]
    assert torch.equal(fused[:, rows], per_head)


# Decoders built from the same parts that the matcher was never told about.
EXTRA = {
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                   new_decoder_architecture=False, parallel_attn=True),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, multi_query=True),
    "stablelm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, partial_rotary_factor=0.25),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
    "olmo2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "phi": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                partial_rotary_factor=0.5),
    "starcoder2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
}


@pytest.mark.parametrize("arch", sorted(EXTRA))
def test_other_decoders_match_without_new_code(arch):
    config = AutoConfig.for_model(arch, vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **EXTRA[arch])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    report = dejavu_compile.explain(model, token_ids(1, 5))
    assert (report.num_layers, report.mlp_matched, report.attention_matched) == (2, 2, 2), str(report)
    assert report.fallbacks == []
    kinds = {b.kv_sharing for b in report.blocks if b.kind == "attention"}
    if EXTRA[arch].get("multi_query") or EXTRA[arch].get("num_key_value_heads") == 1:
        assert kinds == {"mqa"}
    if arch in ("stablelm", "phi", "gptj"):
        assert {b.rotary for b in report.blocks if b.kind == "attention"} == {"partial"}
    if arch in ("qwen3", "olmo2"):
        assert {b.qk_norm for b in report.blocks if b.kind == "attention"} == \
            {"qwen3": {"per_head"}, "olmo2": {"across_heads"}}[arch]


def test_alibi_attention_is_matched_with_its_per_head_bias():
    """BLOOM's ALiBi attention (baddbmm over heads folded into the batch axis) is multi-head
    attention with a per-head score bias: matched, the bias recorded on the block."""
    model = tiny_model("bloom")
    report = dejavu_compile.explain(model, token_ids(1, 5))
    assert (report.attention_matched, report.mlp_matched) == (2, 2) and report.fallbacks == [], str(report)
    for block in (b for b in report.blocks if b.kind == "attention"):
        assert (block.position_bias, block.attention, block.num_heads, block.head_dim) == ("alibi", "eager", 4, 16)
        assert block.nodes.position_bias is not None
        assert block.q.name == f"transformer.h.{block.layer}.self_attention.query_key_value.weight"
        # head h of q reads rows [48h, 48h + 16) of the per-head interleaved q/k/v weight
        rows = block.nodes.head_rows["q"]
        assert torch.equal(rows, torch.arange(4)[:, None] * 48 + torch.arange(16))
    llama = dejavu_compile.explain(tiny_model("llama", attn_implementation="eager"), token_ids(1, 5))
    assert {b.position_bias for b in llama.blocks if b.kind == "attention"} == {"none"}  # a shared mask is no bias


def test_unsupported_attention_is_reported_not_matched():
    """GPT-1's attention is a pattern the rule cannot prove: it must show up as left dense."""
    model = tiny_model("openai-gpt")
    report = dejavu_compile.explain(model, token_ids(1, 5))
    assert report.attention_matched == 0 and report.mlp_matched == 2
    assert {where for where, _ in report.fallbacks} == {"layer 0", "layer 1"}
    assert all("no attention block" in why for _, why in report.fallbacks)


def _decode_reports(model, cache):
    reports = []
    original = model.forward
    model.forward = torch.compile(original, backend="dejavu",
                                  options={"inner": "eager", "on_report": reports.append})
    try:
        with torch.no_grad():
            kwargs = {"cache_implementation": "static"} if cache == "static" else {}
            model.generate(token_ids(2, 4), max_new_tokens=4, min_new_tokens=4, do_sample=False, **kwargs)
    finally:
        model.forward = original
    return reports


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3", "opt"])
def test_decode_graphs_are_matched_and_marked(arch, cache):
    model = tiny_model(arch)
    reports = _decode_reports(model, cache)
    decode = [r for r in reports if r.match.attention and r.match.attention[0].decode]
    prefill = [r for r in reports if r.match.attention and not r.match.attention[0].decode]
    assert decode and prefill
    for report in decode:
        assert len(report.match.mlp) == 2 and len(report.match.attention) == 2
        assert all(b.decode and b.tokens == 1 and b.batch == 2 for b in report.match.blocks)
        expected_cache = "index_copy" if cache == "static" else "cat"
        assert {b.cache for b in report.match.attention} == {expected_cache}
        assert report.match.fallbacks == []


class CubedReLUMLP(nn.Module):
    def __init__(self, d=32, f=96):
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) ** 3)  # no built-in activation


class TinyCubedReLUModel(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(CubedReLUMLP() for _ in range(layers))
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(self.norm(x))
        return x


@contextlib.contextmanager
def registered(rule):
    """``rule`` in the registry for the duration of the block."""
    dejavu_compile.register_rule(rule)
    try:
        yield rule
    finally:
        dejavu_compile.unregister_rule(rule.name)


def test_user_rule_teaches_a_custom_mlp():
    model = TinyCubedReLUModel().eval()
    x = torch.randn(1, 3, 32)
    before = dejavu_compile.explain(model, x)
    assert before.mlp_matched == 0
    assert any("not act(up)" in why for _, why in before.fallbacks), before.fallbacks

    with registered(MLPRule("cubed_relu", {"relu3": lambda t: torch.relu(t) ** 3})) as rule:
        assert dejavu_compile.registered_rules()[0] is rule  # user rules run before the built-ins
        torch._dynamo.reset()
        after = dejavu_compile.explain(model, x)
    assert after.mlp_matched == 2
    assert {(b.rule, b.activation, b.up.name) for b in after.blocks} == {
        ("cubed_relu", "relu3", f"layers.{i}.up.weight") for i in range(2)}
    assert not any("layers." in where and "mlp" in why.lower() for where, why in after.fallbacks)


def test_user_rule_takes_precedence_over_builtin():
    model = tiny_model("llama", layers=1)
    with registered(MLPRule("my_silu", {"silu": F.silu})):
        report = dejavu_compile.explain(model, token_ids(1, 5))
    assert {b.rule for b in report.blocks if b.kind == "mlp"} == {"my_silu"}
    with pytest.raises(ValueError, match="already registered"):
        dejavu_compile.register_rule(MLPRule())  # the built-in "mlp" rule exists
    with pytest.raises(TypeError):
        dejavu_compile.register_rule(object())


class LeakyMLP(nn.Module):
    """An MLP whose activation is also read outside the block: rewriting it would change results."""

    def __init__(self):
        super().__init__()
        self.mlp = CubedReLUMLP()
        self.mlp.forward = self._forward
        self.probe = None

    def _forward(self, x):
        hidden = F.gelu(self.mlp.up(x))
        return self.mlp.down(hidden), hidden.mean(-1, keepdim=True)

    def forward(self, x):
        out, side = self.mlp(x)
        return out + side


def test_partly_recognised_block_stays_dense_and_is_reported():
    model = LeakyMLP().eval()
    x = torch.randn(1, 3, 32)
    report = dejavu_compile.explain(model, x)
    assert report.mlp_matched == 0
    assert any("also used" in why for _, why in report.fallbacks), report.fallbacks
    with torch.no_grad():
        expected = model(x)
        # projections left to aten: bit-exact equality shows the block was not rewritten (the GEMV
        # lowering of dense projections sums in another order; tests/test_dense_linear.py covers it)
        compiled = torch.compile(model, backend="dejavu", options={"inner": "eager", "dense_lowering": "aten"})(x)
    torch.testing.assert_close(compiled, expected, rtol=0, atol=0)


def test_model_without_decoder_blocks_runs_unchanged():
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 3, 16, 16)
    report = dejavu_compile.explain(cnn, x)
    assert (report.num_layers, report.mlp_matched, report.attention_matched) == (0, 0, 0)
    with torch.no_grad():
        expected = cnn(x)
        for inner in ("eager", "inductor"):
            torch._dynamo.reset()
            got = torch.compile(cnn, backend="dejavu", options={"inner": inner})(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unknown_option_is_a_value_error_naming_it():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="'bogus'"):
        torch.compile(model, backend="dejavu", options={"bogus": 1})(torch.randn(2, 4))
    with pytest.raises(ValueError, match="inner"):
        torch.compile(model, backend="dejavu", options={"inner": "tvm"})(torch.randn(2, 4))
    with pytest.raises(ValueError, match="SparsityPlan"):
        torch.compile(model, backend="dejavu", options={"plan": {"layers": 3}})(torch.randn(2, 4))


def test_training_mode_passes_through_dense_with_a_warning():
    model = tiny_model("gpt2", layers=1).train()  # GPT-2 has dropout, so training shows in the graph
    x = token_ids(1, 5)
    torch.manual_seed(0)
    expected = model(x).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        got = torch.compile(model, backend="dejavu", options={"inner": "eager"})(x).logits
    assert any("training mode" in str(w.message) for w in caught)
    torch.testing.assert_close(got, expected)
    got.sum().backward()  # gradients still flow through the dense graph
    assert model.transformer.h[0].mlp.c_fc.weight.grad is not None


def test_inputs_requiring_grad_pass_through_dense_with_a_warning():
    mlp = CubedReLUMLP().eval()
    x = torch.randn(2, 32, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(mlp, backend="dejavu", options={"inner": "eager"})(x)
    assert any("requires grad" in str(w.message) for w in caught)
    torch.testing.assert_close(out, mlp(x))
    out.sum().backward()
    assert x.grad is not None


def test_a_failing_pass_falls_back_to_the_untouched_graph(monkeypatch, caplog):
    from dejavu_compile.compiler import backend

    def broken(*args, **kwargs):
        raise RuntimeError("simulated pass failure")

    monkeypatch.setattr(backend.DejavuBackend, "run_passes", broken)
    model = tiny_model("llama", layers=1)
    x = token_ids(1, 5)
    with torch.no_grad(), caplog.at_level("WARNING", logger="dejavu_compile"):
        got = torch.compile(model, backend="dejavu", options={"inner": "eager"})(x).logits
        expected = model(x).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert "simulated pass failure" in caplog.text
