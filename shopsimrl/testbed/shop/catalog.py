"""Load a ShopSimulator catalog file (cleaned-v2 record format) into products and private goals.

A catalog file is a JSON list (optionally gzip-compressed) of product records; every record
carries exactly one task in ``instructions[0]``. Products keep the fields the pages, the search
index and the reward read; goals are keyed by task id and never reach an observation.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shopsimrl.testbed.shop.product import Product
from shopsimrl.testbed.shop.reward import explicit_budget_from_instruction

__all__ = ["Catalog", "CatalogError", "build_goal", "load_catalog", "product_from_record"]

# The observation renderer only accepts ASINs of this shape, so a catalog that breaks it is
# rejected at load time instead of failing on the first search.
_ASIN = re.compile(r"^\d{8,12}$")


class CatalogError(ValueError):
    """A catalog file or one of its records is malformed."""


@dataclass(slots=True)
class Catalog:
    """Products by ASIN plus the active goals by task id."""

    path: Path
    products: list[Product]
    by_asin: dict[str, Product]
    goals: dict[int, dict[str, Any]]


def _where(path: Path | str, index: int, key: str) -> str:
    return f"{path}: record {index}: field {key!r}"


def _require(record: dict[str, Any], key: str, path: Path | str, index: int) -> Any:
    if key not in record:
        raise CatalogError(f"{_where(path, index, key)} is missing")
    return record[key]


def _price_display(pricing: list[Any]) -> str:
    # Same display strings as the real loader: "X", "X to Y", or "100.0" without pricing.
    if len(pricing) == 1:
        return f"{pricing[0]}"
    return f"{pricing[0]} to {pricing[1]}"


def product_from_record(record: dict[str, Any], *, path: Path | str = "<record>", index: int = 0) -> Product:
    """Build a :class:`Product` from one raw catalog record (raises :class:`CatalogError`)."""
    if not isinstance(record, dict):
        raise CatalogError(f"{path}: record {index} must be an object, got {type(record).__name__}")
    asin = str(_require(record, "asin", path, index)).strip()
    if not _ASIN.match(asin):
        raise CatalogError(f"{_where(path, index, 'asin')} must be 8-12 digits, got {asin!r}")
    title = str(_require(record, "title", path, index) or "")
    shop_name = str(_require(record, "shop_name", path, index) or "")
    category = str(_require(record, "category", path, index) or "")
    attributes = _require(record, "attribute", path, index)
    if not isinstance(attributes, list):
        raise CatalogError(f"{_where(path, index, 'attribute')} must be a list of strings")
    images = _require(record, "images", path, index)
    if not isinstance(images, list) or not images:
        raise CatalogError(f"{_where(path, index, 'images')} must be a non-empty list")
    instructions = _require(record, "instructions", path, index)
    if not isinstance(instructions, list) or not instructions or not isinstance(instructions[0], dict):
        raise CatalogError(f"{_where(path, index, 'instructions')} must be a non-empty list of objects")
    if "instruction" not in instructions[0]:
        raise CatalogError(f"{_where(path, index, 'instructions[0].instruction')} is missing")

    pricing = record.get("pricing")
    if not pricing:
        pricing, display = [100.0], "100.0"
    elif not isinstance(pricing, list) or not all(isinstance(p, (int, float)) for p in pricing):
        raise CatalogError(f"{_where(path, index, 'pricing')} must be a list of numbers")
    else:
        pricing = list(pricing[:2])
        display = _price_display(pricing)

    raw_options = record.get("customization_options") or {}
    if not isinstance(raw_options, dict):
        raise CatalogError(f"{_where(path, index, 'customization_options')} must be an object")
    options: dict[str, list[str]] = {}
    customization: dict[str, list[dict[str, Any]]] = {}
    for axis, entries in raw_options.items():
        if entries is None:  # the real loader skips axes without entries
            continue
        if not isinstance(entries, list):
            raise CatalogError(f"{_where(path, index, 'customization_options')}[{axis!r}] must be a list")
        values: list[str] = []
        for position, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("value"), str):
                raise CatalogError(f"{_where(path, index, 'customization_options')}[{axis!r}][{position}] needs a string 'value'")
            values.append(entry["value"].strip().replace("/", " | ").lower())
        options[str(axis)] = values
        customization[str(axis)] = entries

    small = record.get("small_description", "")
    bullets = small if isinstance(small, list) else [small]
    return Product(
        asin=asin,
        title=title,
        shop_name=shop_name,
        category=category,
        product_category=str(record.get("product_category") or ""),
        pricing=pricing,
        price_display=display,
        options=options,
        customization_options=customization,
        attributes=[str(a) for a in attributes],
        bullet_points=bullets,
        description=str(record.get("full_description") or ""),
        instruction_text=str(instructions[0]["instruction"]),
        search_source={
            "brand": record.get("brand"),
            "small_description": record.get("small_description"),
            "sub_title": record.get("sub_title"),
            "product_category": record.get("product_category"),
            "customization_options": raw_options,
        },
    )


def build_goal(
    record: dict[str, Any], *, position: int, default_task_id: int = 0, path: Path | str = "<record>"
) -> dict[str, Any] | None:
    """The private goal of a record's task, or None when the task has no goal attributes.

    ``default_task_id`` is used only when the instruction has no ``task_id`` (the real server
    then numbers goals in load order).
    """
    instruction = record["instructions"][0]
    attributes = list(instruction.get("attributes") or [])
    if not attributes:  # such tasks are inactive in the real server as well
        return None
    full_text = str(instruction["instruction"])
    simple_text = instruction.get("instruction_simple") or full_text
    raw_upper = instruction.get("price_upper")
    price_upper: float | None
    if raw_upper not in (None, ""):
        try:
            price_upper = float(raw_upper)
        except (TypeError, ValueError):
            price_upper = math.nan
        if not math.isfinite(price_upper) or price_upper < 0:
            raise CatalogError(
                f"{_where(path, position, 'instructions[0].price_upper')} must be a finite number >= 0, got {raw_upper!r}"
            )
    else:
        price_upper = explicit_budget_from_instruction(simple_text)
        if price_upper is None and simple_text != full_text:
            price_upper = explicit_budget_from_instruction(full_text)
    raw_task_id = instruction.get("task_id", default_task_id)
    if isinstance(raw_task_id, str) and raw_task_id.strip().isdigit():
        raw_task_id = int(raw_task_id)
    if isinstance(raw_task_id, bool) or not isinstance(raw_task_id, int):
        raise CatalogError(f"{_where(path, position, 'instructions[0].task_id')} must be an integer")
    persona = record.get("user_persona")
    goal_options = instruction.get("instruction_options") or []
    if isinstance(goal_options, dict):
        goal_options = list(goal_options.values())
    return {
        "task_id": raw_task_id,
        "task_uid": instruction.get("task_uid"),
        "source_product_index": record.get("source_product_index"),
        "asin": str(record["asin"]).strip(),
        "category": record.get("category", ""),
        "name": record.get("title", ""),
        "instruction_text": full_text,
        "instruction_simple": simple_text,
        "attributes": attributes,
        "price_upper": price_upper,
        "price_constraint": instruction.get("price_constraint"),
        "goal_options": list(goal_options),
        "user_persona": dict(persona) if isinstance(persona, dict) else {},
        "reason_key": record.get("reason_key"),
        "weight": 1,
    }


def _read_records(path: Path) -> list[Any]:
    if not path.is_file():
        raise CatalogError(f"catalog file not found: {path}")
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: not a readable JSON catalog: {exc}") from exc
    if not isinstance(data, list):
        raise CatalogError(f"{path}: the catalog must be a JSON list of product records")
    return data


def load_catalog(path: str | Path) -> Catalog:
    """Read a ``.json``/``.json.gz`` catalog; skip the records the real loader skips."""
    catalog_path = Path(path)
    products: list[Product] = []
    by_asin: dict[str, Product] = {}
    goals: dict[int, dict[str, Any]] = {}
    for index, record in enumerate(_read_records(catalog_path)):
        if isinstance(record, dict):
            raw_asin = str(record.get("asin", ""))
            if raw_asin == "nan" or len(raw_asin) > 20:
                continue
            if raw_asin.strip() in by_asin:  # duplicate ASINs: the first record wins
                continue
        product = product_from_record(record, path=catalog_path, index=index)
        products.append(product)
        by_asin[product.asin] = product
        goal = build_goal(record, position=index, default_task_id=len(goals), path=catalog_path)
        if goal is None:
            continue
        if goal["task_id"] in goals:
            raise CatalogError(f"{catalog_path}: record {index}: duplicate task_id {goal['task_id']}")
        goals[goal["task_id"]] = goal
    return Catalog(path=catalog_path, products=products, by_asin=by_asin, goals=goals)
