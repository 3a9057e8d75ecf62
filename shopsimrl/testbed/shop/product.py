"""One catalog product: what the catalog loader builds and the pages, the search index and the
reward read (a module of its own, so that those import it without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Product"]


@dataclass(slots=True)
class Product:
    """One catalog product, as the shop pages and the reward see it."""

    asin: str
    title: str
    shop_name: str
    category: str
    product_category: str
    pricing: list[Any]
    price_display: str
    # axis -> public option values (lowercased, "/" shown as " | "), in source order
    options: dict[str, list[str]]
    # the raw customization entries, needed to resolve the SKU price
    customization_options: dict[str, list[dict[str, Any]]]
    attributes: list[str]
    bullet_points: list[Any]
    description: str
    instruction_text: str
    # fields only the search index reads (brand, raw small_description …)
    search_source: dict[str, Any] = field(default_factory=dict)
