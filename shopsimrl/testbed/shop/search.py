"""Multi-field BM25 product search (``shopsimulator-multifield-bm25-v3``) on SQLite FTS5.

Every field is pre-tokenized (Chinese bigrams plus Latin/number tokens) before it is stored, so
FTS5's ``unicode61`` tokenizer only splits on the spaces between those tokens and Chinese lookup
does not depend on any machine-local segmenter. The index lives in memory and is built at start-up.

A search action goes through :meth:`SearchIndex.results`, which also keeps the real server's
WebShop-era prefixes: ``<r>`` samples 150 random products, ``<c> CATEGORY`` lists one exact
category in catalog order, and ``<a> …`` / a bare ``<c>`` fail with HTTP 500 (see docs/testbed.md).
"""

from __future__ import annotations

import random
import re
import sqlite3
import threading
import unicodedata
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from shopsimrl.testbed.shop.product import Product

__all__ = [
    "FIELD_WEIGHTS",
    "PAGE_SIZE",
    "SEARCH_VERSION",
    "TOP_K",
    "SearchIndex",
    "ServerFault",
    "normalize_query",
    "product_fields",
    "search_tokens",
]

SEARCH_VERSION = "shopsimulator-multifield-bm25-v3"
OPTION_DOCUMENT_VERSION = "public-axis-value-v1"
TOP_K = 150
PAGE_SIZE = 20
FIELD_WEIGHTS: dict[str, float] = {
    "title": 3.0,
    "brand": 2.0,
    "category": 2.0,
    "model": 2.5,
    "attributes": 1.5,
    "options": 1.2,
    "bullets": 0.8,
}
FIELDS = tuple(FIELD_WEIGHTS)

_HAN_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]+")
_LATIN_OR_NUMBER = re.compile(r"[a-z0-9]+(?:[._+\-/][a-z0-9]+)*")
# A model number is one alphanumeric token that has both a letter and a digit (e.g. "x200").
_MODEL = re.compile(
    r"(?<![a-z0-9])(?=[a-z0-9._+\-/]*[a-z])(?=[a-z0-9._+\-/]*\d)"
    r"[a-z0-9]+(?:[._+\-/][a-z0-9]+)*(?![a-z0-9])"
)


class ServerFault(Exception):
    """A request the real server fails with HTTP 500 and ``str(exc)`` as ``result.error``.

    The testbed reproduces these failures on purpose, with the real texts (they are the Python
    exception messages of the real server's code path), so that an agent that triggers one fails
    here as it would there.
    """


# The old WebShop search prefixes, matched against the first space-separated keyword exactly.
RANDOM_PREFIX, ATTRIBUTE_PREFIX, CATEGORY_PREFIX = "<r>", "<a>", "<c>"

_CURRENCY_WORD = re.compile(r"(?<=\d)\s*(?:rmb|cny|yuan)\b")
_PUNCTUATION = re.compile(r"[，,。；;：:！!？?、|]+")


def normalize_query(value: object) -> str:
    """NFKC + casefold, currency words to 元, basic punctuation to spaces, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", str(value or "")).casefold()
    text = text.replace("人民币", "元").replace("块钱", "元")
    text = _CURRENCY_WORD.sub("元", text)
    # whitespace collapsing happens in the final split/join
    return " ".join(_PUNCTUATION.sub(" ", text).split())


def search_tokens(value: object) -> tuple[str, ...]:
    """Chinese bigrams (a one-character run is kept whole), then Latin/number tokens; deduplicated."""
    text = normalize_query(value)
    tokens: list[str] = []
    for run in _HAN_RUN.findall(text):
        tokens.extend([run] if len(run) == 1 else [run[i : i + 2] for i in range(len(run) - 1)])
    tokens.extend(_LATIN_OR_NUMBER.findall(text))
    return tuple(dict.fromkeys(tokens))


def _flatten(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        out: list[str] = []
        for key in sorted(value, key=str):
            out.append(str(key))
            out.extend(_flatten(value[key]))
        return out
    if isinstance(value, (list, tuple, set)):
        return [text for item in value for text in _flatten(item)]
    return [str(value)]


def _option_text(raw_options: object) -> str:
    """Axis names and option values only: prices, images and variant ids must not be searchable."""
    if not isinstance(raw_options, dict):
        return ""
    parts: list[str] = []
    for axis in sorted(raw_options, key=str):
        if str(axis).strip():
            parts.append(str(axis).strip())
        entries = raw_options[axis]
        if not isinstance(entries, (list, tuple)):
            entries = [entries]
        for entry in entries:
            value = entry.get("value") if isinstance(entry, dict) else entry
            if value not in (None, "") and str(value).strip():
                parts.append(str(value).strip())
    return " ".join(parts)


def product_fields(product: Product) -> dict[str, str]:
    """The searchable document of a product (no task or reward fields)."""
    source: dict[str, Any] = product.search_source
    bullets = source.get("small_description") or source.get("sub_title") or []
    return {
        "title": product.title,
        "brand": str(source.get("brand") or product.shop_name or ""),
        "category": str(product.category or source.get("product_category") or ""),
        "model": " ".join(dict.fromkeys(_MODEL.findall(normalize_query(product.title)))),
        "attributes": " ".join(_flatten(product.attributes)),
        "options": _option_text(source.get("customization_options")),
        "bullets": " ".join(_flatten(bullets)),
    }


@lru_cache(maxsize=65536)
def _indexed_text(value: str) -> str:
    # Brands, categories and option documents repeat across products; tokenize each text once.
    return " ".join(search_tokens(value)) if value else ""


class SearchIndex:
    """In-memory FTS5 index; ``search`` returns up to ``TOP_K`` ASINs, best first."""

    def __init__(self, products: Iterable[Product]) -> None:
        # Catalog order and categories serve the legacy prefixes; the unseeded generator makes
        # every <r> search a fresh sample, as the real server's module-level ``random`` does.
        self._catalog_order: list[tuple[str, str]] = []
        self._random = random.Random()
        # One connection shared by the event loop; the lock covers use from other threads.
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute(
            "CREATE VIRTUAL TABLE products USING fts5("
            "asin UNINDEXED, title, brand, category, model, attributes, options, bullets,"
            " tokenize='unicode61 remove_diacritics 2')"
        )
        rows = []
        seen: set[str] = set()
        for product in products:
            if product.asin in seen:
                continue
            seen.add(product.asin)
            self._catalog_order.append((product.asin, product.category))
            fields = product_fields(product)
            rows.append((product.asin, *(_indexed_text(fields[f]) for f in FIELDS)))
        self._db.executemany("INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        self._db.commit()
        self.size = len(rows)
        # Rows are numbered 1..n in insertion order; row r - 1 indexes the arrays below.
        numbering = self._db.execute("SELECT count(*), min(rowid), max(rowid) FROM products").fetchone()
        if numbering not in ((0, None, None), (len(rows), 1, len(rows))):
            raise RuntimeError(f"the search index numbered its rows unexpectedly: {numbering}")
        self._asins = [asin for asin, _ in self._catalog_order]
        # The ranking's tie-break: ASINs in SQLite's BINARY order (ASCII digits: Python's str order).
        self._asin_rank = np.empty(len(rows), dtype=np.int64)
        self._asin_rank[sorted(range(len(rows)), key=self._asins.__getitem__)] = np.arange(len(rows))
        # bm25() weights are positional over all declared columns; the leading 0 is the ASIN.
        weights = ", ".join(str(w) for w in (0.0, *FIELD_WEIGHTS.values()))
        self._phrase_sql = f"SELECT rowid - 1, -bm25(products, {weights}) FROM products WHERE products MATCH ?"
        # The index never changes after this point, so rankings and per-token scores are pure
        # functions of their tokens: cached, repeated queries and shared tokens cost no scan.
        self._token_scores = lru_cache(maxsize=16384)(self._score_token)
        self._ranked = lru_cache(maxsize=4096)(self._rank)

    def search(self, text: object, k: int = TOP_K) -> list[str]:
        tokens = search_tokens(text)
        if not tokens or k <= 0:
            return []
        return list(self._ranked(tokens, int(k)))

    def _score_token(self, token: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """The rows matching one token and that token's bm25 term in each (FTS5's own arithmetic)."""
        # Tokens never contain a double quote, and quoting keeps FTS syntax out of user text.
        with self._lock:
            found = self._db.execute(self._phrase_sql, (f'"{token}"',)).fetchall()
        rows = np.fromiter((row for row, _ in found), dtype=np.int64, count=len(found))
        terms = np.fromiter((term for _, term in found), dtype=np.float64, count=len(found))
        return rows, terms

    def _rank(self, tokens: tuple[str, ...], k: int) -> tuple[str, ...]:
        """``SELECT asin ... MATCH '"t1" OR "t2" ...' ORDER BY bm25(...), asin LIMIT k``, bit for bit.

        FTS5's bm25 of a row is -(0.0 + term_1 + term_2 + ...), one term per query phrase in query
        order, where a phrase's term depends only on that phrase, the row and global statistics
        (IDF, average row length), and is 0.0 for a phrase absent from the row. A one-phrase query
        returns -term exactly, so summing the cached terms in query order repeats FTS5's own
        additions; tests compare both rankings over thousands of queries. The OR query scored
        every matching row on each call (~3 ms on the 6,000-product catalog, half the shop's CPU).
        """
        score = np.zeros(self.size)
        matched = np.zeros(self.size, dtype=bool)
        for token in tokens:
            rows, terms = self._token_scores(token)
            score[rows] += terms  # one term per row: a token matches a row once
            matched[rows] = True
        candidates = np.flatnonzero(matched)
        # lexsort: the last key is the primary one. bm25 ascending = score descending; then ASIN.
        order = np.lexsort((self._asin_rank[candidates], -score[candidates]))[:k]
        return tuple(self._asins[row] for row in candidates[order])

    def results(self, keywords: list[str]) -> list[str]:
        """The result list of ``search[ARG]``, where ``keywords`` is ARG split on single spaces."""
        head = keywords[0] if keywords else ""
        if head == RANDOM_PREFIX:
            try:
                return [asin for asin, _ in self._random.sample(self._catalog_order, k=TOP_K)]
            except ValueError as exc:  # a catalog of fewer than 150 products: the same 500 as there
                raise ServerFault(str(exc)) from None
        if head == ATTRIBUTE_PREFIX:
            # The real server never passes its attribute table to the search, so it indexes None.
            raise ServerFault("'NoneType' object is not subscriptable")
        if head == CATEGORY_PREFIX:
            if len(keywords) < 2:
                raise ServerFault("list index out of range")
            category = keywords[1].strip()  # only the second keyword; every match, no top-150 cut
            return [asin for asin, product_category in self._catalog_order if product_category == category]
        return self.search(" ".join(keywords), k=TOP_K)

    def close(self) -> None:
        with self._lock:
            self._db.close()
