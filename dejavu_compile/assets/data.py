"""Real English text for calibration and held-out evaluation, from the files in gensim's wheel.

* `wiki_articles(split)`: the shortened Wikipedia dump in `gensim/test/test_data/` (~100 articles),
  split deterministically *by article* (a hash of the title) into "calibration" and "eval"
  so that evaluation never sees calibration text.
* `news_texts()`: `lee_background.cor` (news, one article per line): another domain, evaluation only.
* `tokenize_chunks(...)`: any list of strings (or a text file via `read_text_file`) -> (1, T) chunks.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import torch

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILE = "lee_background.cor"
SPLITS = ("calibration", "eval", "all")


def _gensim_data_dir() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        from dejavu_compile.assets.models import _INSTALL_HINT, MissingExtraError

        raise MissingExtraError("package 'gensim' (the bundled English text) not found.\n" + _INSTALL_HINT)
    return Path(spec.origin).parent / "test" / "test_data"


def _is_eval(title: str, eval_fraction: float) -> bool:
    # Stable across Python runs (unlike hash()), independent of article order.
    h = int(hashlib.sha1(title.encode("utf-8")).hexdigest()[:8], 16)
    return (h % 1000) < eval_fraction * 1000


def _clean_wiki(markup: str) -> str:
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(markup)
    # filter_wiki leaves table/heading debris; keep prose lines only.
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if len(line) < 40 or line.startswith(("|", "!", "=", "*")):
            continue
        line = re.sub(r"'{2,}", "", line)  # bold/italic quotes
        lines.append(re.sub(r"\s+", " ", line))
    return "\n".join(lines)


@lru_cache(maxsize=1)
def _all_wiki() -> tuple[tuple[str, str], ...]:
    import bz2

    from gensim.corpora.wikicorpus import extract_pages

    path = _gensim_data_dir() / WIKI_FILE
    out = []
    with bz2.open(path, "rb") as fh:
        for title, markup, _pageid in extract_pages(fh):
            if not markup or markup.lower().startswith("#redirect"):
                continue
            text = _clean_wiki(markup)
            if len(text) > 500:
                out.append((title, text))
    return tuple(out)


def wiki_articles(split: str = "calibration", eval_fraction: float = 0.25) -> list[str]:
    """Wikipedia articles (cleaned prose) of one split: "calibration", "eval" or "all"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    arts = _all_wiki()
    if split == "all":
        return [t for _, t in arts]
    want_eval = split == "eval"
    return [t for title, t in arts if _is_eval(title, eval_fraction) == want_eval]


def news_texts() -> list[str]:
    """News articles of lee_background.cor (one per line): held-out text of another domain."""
    path = _gensim_data_dir() / NEWS_FILE
    with open(path, encoding="utf-8", errors="replace") as fh:
        return [line.strip() for line in fh if line.strip()]


def read_text_file(path: str | os.PathLike) -> list[str]:
    """A user text file, split into paragraphs on blank lines."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return paras or [text]


def tokenize_chunks(
    tokenizer, texts: Iterable[str] | str, seq_len: int = 256, max_tokens: int | None = None
) -> list[torch.LongTensor]:
    """Concatenate the texts (EOS-separated) and cut them into (1, seq_len) LongTensor chunks.

    At most `max_tokens` tokens in total (rounded down to whole chunks; a final shorter chunk is
    kept only when it would be the only one).
    """
    if isinstance(texts, str):
        texts = [texts]
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not toks:
            continue
        ids.extend(toks)
        if sep is not None:
            ids.append(sep)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise ValueError("no tokens: the text is empty")
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    if len(chunks) > 1 and len(chunks[-1]) < seq_len:
        chunks = chunks[:-1]
    return [torch.tensor(c, dtype=torch.long).unsqueeze(0) for c in chunks]
