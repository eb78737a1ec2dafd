"""Head-sparse attention in the backend: only the selected query heads are projected, attend and go
through the output projection; K/V and the cache stay exact."""
import copy

import pytest
import torch

from dejavu_compile.compiler.prepare import prepare_model
from dejavu_compile.testing import describe_difference
from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model
from tests.helpers import AlwaysSparseEntry, sparse_plan, token_batches, token_ids
from tests.references import logits_with_hooks, masked_heads_reference_llama

# (architecture, config overrides): every foundation architecture, plus LLaMA as MHA and Mistral as MQA.
VARIANTS = [(arch, {}) for arch in ARCHITECTURES] + [("llama", {"kv_heads": 4}), ("mistral", {"kv_heads": 1})]


def _compile(model, plan, reports=None, **options):
    torch._dynamo.reset()
    options = {"plan": plan, "strict": True, **options}
    if reports is not None:
        options["on_report"] = reports.append
    return torch.compile(model, backend="dejavu", options=options)


@pytest.mark.parametrize("batch, tokens, sdpa_gqa", [(3, 1, False), (2, 6, False), (3, 1, True)])
def test_head_sparse_matches_masked_reference(batch, tokens, sdpa_gqa, monkeypatch):
    """Decode-shaped: the head-sparse graph (eager and Inductor) and the simulation; prefill-shaped:
    the simulation, per token. sdpa_gqa: transformers hands SDPA the 2 KV heads with enable_gqa=True
    instead of repeating them to 4."""
    if sdpa_gqa:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    model = tiny_model("llama", layers=3)
    plan = sparse_plan(model, None, attn_density=0.5)
    ids = token_ids(batch, tokens)
    expected = masked_heads_reference_llama(model, plan, ids)
    variants = [{"simulate": True, "inner": "eager"}]
    if tokens == 1:
        variants += [{"inner": "eager"}, {"inner": "inductor"}]
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for options in variants:
            got = _compile(model, plan, **options)(ids, use_cache=False).logits
            assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None, options
    assert (dense - expected).abs().max() > 1e-3  # the plan really removed heads


@pytest.mark.parametrize("arch, overrides", VARIANTS, ids=[f"{a}{'-kv' + str(o['kv_heads']) if o else ''}"
                                                          for a, o in VARIANTS])
def test_head_sparse_decode_with_cache_matches_simulation(arch, overrides):
    """One decode step after a dense prefill, reading a populated cache (left padding in row 1):
    the head-sparse graph equals the masked simulation of the same plan, for MLP and attention."""
    from transformers import DynamicCache, StaticCache

    model = tiny_model(arch, **overrides)
    plan = sparse_plan(model, 0.5, attn_density=0.5)
    prompt = token_ids(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    step = token_ids(2, 1, seed=1)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    caches = [DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=12)]
    if arch == "opt":  # OPT's positions from a padded mask call .item() with a StaticCache: one graph per layer
        caches = caches[:1]
    for cache in caches:
        with torch.no_grad():
            model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
            dense = model(step, attention_mask=step_mask, past_key_values=copy.deepcopy(cache)).logits
            got = {}
            for name, options in (("sparse", {"inner": "eager"}), ("simulation", {"simulate": True, "inner": "eager"})):
                reports = []
                compiled = _compile(model, plan, reports, **options)
                got[name] = compiled(step, attention_mask=step_mask, past_key_values=copy.deepcopy(cache)).logits
                assert any("heads" in line for r in reports for line in r.rewritten), \
                    (name, [r.rewritten for r in reports])
        what = f"{arch} {type(cache).__name__}"
        assert describe_difference(what, got["sparse"], got["simulation"], rtol=1e-4, atol=1e-4) is None
        assert (got["sparse"] - dense).abs().max() > 1e-3, what


def test_only_the_selected_heads_rows_are_read():
    """The rewritten decode graph has no dense q or o projection left: the query heads come from a
    gather of w_q's rows, the output from an embedding_bag over w_o^T's rows; the head predictor
    reads the previous layer's MLP input (lookahead) and runs before this layer's attention."""
    model = tiny_model("llama", layers=3)
    prepare_model(model)
    plan = sparse_plan(model, None, attn_density=0.5)
    reports = []
    with torch.no_grad():
        _compile(model, plan, reports, inner="eager")(token_ids(1, 1), use_cache=False)
    report = reports[-1]
    assert not any("copied" in line for line in report.rewritten)  # prepare_model: free views only
    nodes = list(report.graph.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    linears = [str(n.args[1]) for n in nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert not any("q_proj" in w or "o_proj" in w for w in linears), linears
    assert sum(n.target is torch.nn.functional.embedding_bag for n in nodes) == 3
    attentions = [n for n in nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    assert len(attentions) == 3, "the dense attention must not run beside the head-sparse one"
    assert all(n.args[0].target is torch.take_along_dim for n in attentions)  # the selected query heads
    mlp_inputs = {b.layer: b.nodes.input.name for b in report.match.mlp}
    predictors = [n for n in nodes if n.meta.get("dejavu", {}).get("role") == "predictor"]
    assert len(predictors) == 3
    for node in predictors:
        meta = node.meta["dejavu"]
        if meta["layer"] == 0:
            assert not meta["lookahead"]
            continue
        assert meta["lookahead"] and meta["reads"] == mlp_inputs[meta["layer"] - 1]
        k_proj = next(n for n in nodes if n.op == "call_function"
                      and f"layers_modules_{meta['layer']}_modules_self_attn_modules_k_proj" in str(n.args[1:2]))
        assert position[node] < position[k_proj]


def test_eager_attention_stays_dense_and_is_reported():
    model = tiny_model("llama", attn_implementation="eager")
    plan = sparse_plan(model, None, attn_density=0.5)
    ids = token_ids(2, 1)
    reports = []
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = _compile(model, plan, reports, inner="eager")(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected)
    reasons = [reason for r in reports for _, reason in r.match.fallbacks]
    assert any("scaled_dot_product_attention" in reason for reason in reasons), reasons


def test_full_density_head_sparse_logits_within_fp32_tolerance_with_inductor():
    model = tiny_model("qwen2")  # q/k/v biases
    plan = sparse_plan(model, None, attn_density=1.0, attn_entry_cls=AlwaysSparseEntry)
    ids = token_ids(2, 1)
    reports = []
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = _compile(model, plan, reports)(ids, use_cache=False).logits
    assert any("4/4 heads" in line for line in reports[-1].rewritten)
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None


# ALiBi: a per-head additive score bias. BLOOM folds the heads into the batch axis (baddbmm, bmm);
# MPT adds it to eager matmul scores; Falcon (alibi=True) hands it to SDPA inside the mask, or adds
# it to eager scores in place.
ALIBI = [("bloom", {}), ("mpt", {}), ("falcon", {"alibi": True}),
         ("falcon", {"alibi": True, "attn_implementation": "eager"})]


def _alibi_model_and_plan(arch, overrides):
    """A tiny ALiBi model and a calibrated plan keeping half of the heads (MLPs dense; the calibration
    may spread the heads unevenly over the layers), each head predictor reading its own block's input."""
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

    model = tiny_model(arch, **overrides)
    samples, _ = collect(model, token_batches(3, 24), progress=False)
    plan = calibrate(model, None, samples=samples, predictor="lowrank", mlp_density=1.0, attn_density=0.5,
                     lookahead=False, train_steps=8, progress=False, dense_when_unprofitable=False)
    return model, plan


def _masked_heads_reference(model, plan, blocks, ids):
    """Eager logits with hooks: each attention block's output projection sees only the heads its
    plan entry selects from the block's input (the other heads' outputs zeroed), whatever the model."""
    modules = dict(model.named_modules())
    handles, inputs = [], {}
    for block in blocks:
        entry = plan.entries[(block.layer, "attention")]
        assert not entry.lookahead and not entry.dense

        def keep_input(module, args, layer=block.layer):
            inputs[layer] = args[0].reshape(-1, args[0].shape[-1])

        def mask_heads(module, args, block=block, entry=entry):
            heads = args[0]  # (B, T, H*D)
            idx = entry.select(inputs[block.layer])
            mask = torch.zeros(idx.shape[0], entry.total).scatter(-1, idx, 1.0).repeat_interleave(block.head_dim, -1)
            return (heads * mask.view_as(heads), *args[1:])

        handles.append(modules[block.q.name.rsplit(".", 1)[0]].register_forward_pre_hook(keep_input))
        handles.append(modules[block.o.name.rsplit(".", 1)[0]].register_forward_pre_hook(mask_heads))
    return logits_with_hooks(model, ids, handles)


@pytest.mark.parametrize("arch, overrides", ALIBI,
                         ids=[f"{a}-{o.get('attn_implementation', 'default')}" for a, o in ALIBI])
def test_alibi_attention_is_matched_calibrated_and_masked_like_the_reference(arch, overrides):
    """ALiBi heads are independent (the bias is per head): matched, calibrated, and the masked
    simulation (prefill and decode shapes) equals zeroing the unselected heads before the output
    projection. The head-sparse lowering takes SDPA (Falcon) and equals the same reference; eager
    ALiBi attention (BLOOM, MPT, Falcon eager) stays dense there, and says why."""
    from dejavu_compile import explain

    model, plan = _alibi_model_and_plan(arch, overrides)
    report = explain(model, token_ids(2, 5))
    blocks = [b for b in report.blocks if b.kind == "attention"]
    assert report.attention_matched == 2 and report.fallbacks == [], str(report)
    assert {b.position_bias for b in blocks} == {"alibi"}
    sdpa = arch == "falcon" and "attn_implementation" not in overrides
    assert {b.attention for b in blocks} == {"sdpa" if sdpa else "eager"}
    with torch.no_grad():
        for ids in (token_ids(2, 5), token_ids(2, 1)):
            expected = _masked_heads_reference(model, plan, blocks, ids)
            dense = model(ids, use_cache=False).logits
            assert (dense - expected).abs().max() > 1e-3  # the plan really removed heads
            got = _compile(model, plan, simulate=True, inner="eager")(ids, use_cache=False).logits
            what = f"{arch} simulation {tuple(ids.shape)}"
            assert describe_difference(what, got, expected, rtol=1e-4, atol=1e-4) is None
        reports = []
        got = _compile(model, plan, reports)(ids, use_cache=False).logits
    lowered = [line for r in reports for line in r.rewritten if "/4 heads" in line]
    reasons = [why for r in reports for _, why in r.match.fallbacks]
    if sdpa:
        assert len(lowered) == 2, [r.rewritten for r in reports]
        assert describe_difference(f"{arch} decode", got, expected, rtol=1e-4, atol=1e-4) is None
    else:
        assert not lowered and any("scaled_dot_product_attention" in why for why in reasons), reasons
        assert describe_difference(f"{arch} decode", got, dense, rtol=1e-4, atol=1e-4) is None
