"""WikiText document splitting (`relational_hf.lm.data`): the one heading rule shared by the reference checkpoints
and the quality benchmark; articles concatenate back to the text, splits fall on article boundaries."""

from __future__ import annotations

import pytest
from conftest import corpus_or_skip

from relational_hf.lm.data import document_split, split_text, wikitext_documents


def _article(i: int, sections: int = 1) -> str:
    body = "".join(f" = = Section {i}.{k} = = \n \n Text {i}.{k} . \n" for k in range(sections))
    return f" = Title {i} = \n \n Lead of article {i} . \n{body}"


def test_wikitext_documents_split_at_top_level_headings_only():
    text = " \n" + "".join(_article(i, sections=2) for i in range(5))
    docs = wikitext_documents(text)
    assert "".join(docs) == text  # nothing lost, nothing reordered
    assert len(docs) == 5
    assert docs[0].startswith(" \n = Title 0 = ")  # text before the first heading stays with the first article
    for i, doc in enumerate(docs[1:], start=1):
        assert doc.startswith(f" = Title {i} = ")
        assert f"Section {i}.1" in doc  # section headings do not split


def test_text_without_headings_is_one_document_and_splits_at_a_line():
    text = "".join(f"line {i}\n" for i in range(100))
    assert wikitext_documents(text) == [text]
    assert document_split(text, 0.1) == split_text(text, 0.1)


@pytest.mark.parametrize("val_fraction", [0.1, 0.3, 0.5])
def test_document_split_cuts_at_the_article_boundary_closest_to_the_mark(val_fraction):
    docs = [_article(i, sections=i % 3) for i in range(20)]
    text = "".join(docs)
    train, val = document_split(text, val_fraction)
    assert train + val == text
    boundaries = [len("".join(docs[:k])) for k in range(1, len(docs))]
    assert len(train) in boundaries and val.startswith(" = Title ")
    mark = (1.0 - val_fraction) * len(text)
    assert abs(len(train) - mark) == min(abs(b - mark) for b in boundaries)


def test_document_split_rejects_a_fraction_outside_the_open_interval():
    text = "".join(_article(i) for i in range(4))
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="val_fraction"):
            document_split(text, bad)


def test_real_wikitext_articles():
    path = corpus_or_skip("wikitext-2")
    text = path.read_text(encoding="utf-8")
    docs = wikitext_documents(text)
    assert "".join(docs) == text and len(docs) > 10
    assert all(doc.lstrip(" \n").startswith("= ") and not doc.lstrip(" \n").startswith("= =") for doc in docs[1:])
    train, val = document_split(text)
    assert train + val == text and any(len(train) == len("".join(docs[:k])) for k in range(1, len(docs)))
