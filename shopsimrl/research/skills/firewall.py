"""The leakage firewall: what a card's deployable text may not contain, and the rules that
force a failure card to NO_PROPOSAL.

Rules over any text: ``mentions_asin`` (the word ASIN, an Amazon-style ``B0`` id, or a product
id the trace's pages show), ``contains_long_identifier`` (10 or more digits),
``contains_task_id`` (``task-N``). With the trace, copied instance facts: a product title of 6
or more characters from the goal, the purchase or any page (``copies_instance_product_title``),
a brand of 3 or more (``copies_instance_brand``), a gold option value of 6 or more
(``copies_gold_option``). Matching ignores case and whitespace.

The forced NO_PROPOSAL rules are pure functions over a card and the facts of its live session
(:func:`forced_no_proposal_reasons`, :func:`enforce_no_proposal`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from shopsimrl.records import EpisodeTrace
from shopsimrl.research.skills.cards import FailureCard
from shopsimrl.research.skills.compact import product_ids

__all__ = [
    "FIREWALL_RULES",
    "FORCED_NO_PROPOSAL_RULES",
    "MIN_BRAND_CHARS",
    "MIN_OPTION_CHARS",
    "MIN_TITLE_CHARS",
    "Stage",
    "card_text",
    "enforce_no_proposal",
    "firewall_findings",
    "forced_no_proposal_reasons",
    "page_findings",
]

MIN_TITLE_CHARS = 6
MIN_BRAND_CHARS = 3
MIN_OPTION_CHARS = 6
FIREWALL_RULES = (
    "mentions_asin",
    "contains_long_identifier",
    "contains_task_id",
    "copies_instance_product_title",
    "copies_instance_brand",
    "copies_gold_option",
)
FORCED_NO_PROPOSAL_RULES = (
    "proposal_without_grounded_live_action",
    "proposal_without_successful_counterfactual",
    "rewrite_at_cold_start",
    "invalid_rewrite_target",
    "firewall_finding",
)
Stage = Literal["cold_start", "online"]

_ASIN = re.compile(r"\bASIN\b|\bB0[0-9A-Z]{8}\b", re.IGNORECASE)
_LONG_NUMBER = re.compile(r"\d{10,}")
_TASK_ID = re.compile(r"task[-_]\d+", re.IGNORECASE)


def _norm(text: str) -> str:
    return "".join(text.split()).casefold()


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _instance_facts(trace: EpisodeTrace) -> dict[str, set[str]]:
    """Titles, brands and gold option values of the trace's instance."""
    titles: set[str] = set()
    brands: set[str] = set()
    options: set[str] = set()

    def product(value: Any) -> None:
        if not isinstance(value, dict):
            return
        for key in ("title", "name", "product_title"):
            if isinstance(value.get(key), str):
                titles.add(value[key])
        if isinstance(value.get("brand"), str):
            brands.add(value["brand"])

    reset_state = (trace.reset or {}).get("observation_state")
    states = [reset_state] + [s.environment.observation_state if s.environment else None for s in trace.steps]
    for state in states:
        if isinstance(state, dict):
            for item in state.get("products") or []:
                product(item)
            product(state.get("product"))
    final = trace.final.as_dict() if trace.final is not None else {}
    product(final.get("purchase"))
    goal = final.get("goal")
    product(goal)
    if isinstance(goal, dict):
        options.update(_strings(goal.get("goal_options")))
    return {
        "copies_instance_product_title": {t for t in titles if len(_norm(t)) >= MIN_TITLE_CHARS},
        "copies_instance_brand": {b for b in brands if len(_norm(b)) >= MIN_BRAND_CHARS},
        "copies_gold_option": {o for o in options if len(_norm(o)) >= MIN_OPTION_CHARS},
    }


def firewall_findings(text: str, trace: EpisodeTrace | None = None) -> list[dict[str, str]]:
    """Every rule ``text`` breaks, ``{"rule", "match"}``, in :data:`FIREWALL_RULES` order; [] when clean."""
    findings: list[dict[str, str]] = []
    asin = _ASIN.search(text)
    known = [pid for pid in sorted(product_ids(trace)) if pid in text] if trace is not None else []
    if asin or known:
        findings.append({"rule": "mentions_asin", "match": asin.group(0) if asin else known[0]})
    long_number = _LONG_NUMBER.search(text)
    if long_number:
        findings.append({"rule": "contains_long_identifier", "match": long_number.group(0)})
    task = _TASK_ID.search(text)
    if task:
        findings.append({"rule": "contains_task_id", "match": task.group(0)})
    if trace is not None:
        haystack = _norm(text)
        for rule, values in _instance_facts(trace).items():
            copied = sorted(value for value in values if _norm(value) in haystack)
            if copied:
                findings.append({"rule": rule, "match": copied[0]})
    return findings


def page_findings(text: str, states: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The instance rules over pages that are no part of a trace (the failure analyst's live
    session): a product id (``mentions_asin``), a title of 6 or more characters, a brand of 3 or
    more that the pages show; [] when clean."""
    ids: set[str] = set()
    titles: set[str] = set()
    brands: set[str] = set()
    for state in states:
        products = [*(state.get("products") or []), state.get("product")]
        for item in products:
            if not isinstance(item, Mapping):
                continue
            if isinstance(item.get("asin"), str | int) and len(str(item["asin"])) >= 4:
                ids.add(str(item["asin"]))
            if isinstance(item.get("title"), str) and len(_norm(item["title"])) >= MIN_TITLE_CHARS:
                titles.add(item["title"])
            if isinstance(item.get("brand"), str) and len(_norm(item["brand"])) >= MIN_BRAND_CHARS:
                brands.add(item["brand"])
    haystack = _norm(text)
    findings = []
    for rule, values in (
        ("mentions_asin", ids),
        ("copies_instance_product_title", titles),
        ("copies_instance_brand", brands),
    ):
        found = sorted(value for value in values if _norm(value) in haystack)
        if found:
            findings.append({"rule": rule, "match": found[0]})
    return findings


def card_text(value: Any) -> str:
    """Every string of a card (or part of one), one per line: what the firewall reads."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return "\n".join(_strings(value))


def forced_no_proposal_reasons(
    card: FailureCard,
    *,
    stage: Stage,
    valid_live_actions: int,
    successful_trials: int,
    active_skill_ids: Iterable[str] = (),
    trace: EpisodeTrace | None = None,
) -> list[str]:
    """Why a proposing card must become NO_PROPOSAL ([] when it may propose, or does not):
    no valid action in its live session, no trial with ``r_success = 1``, a REWRITE at cold
    start (there is no bank to rewrite), a REWRITE whose target is not an active skill id, or a
    firewall finding in its deployable abstraction."""
    if card.status == "NO_PROPOSAL":
        return []
    reasons = []
    if valid_live_actions < 1:
        reasons.append("proposal_without_grounded_live_action")
    if successful_trials < 1:
        reasons.append("proposal_without_successful_counterfactual")
    target = card.deployable_abstraction.target if card.deployable_abstraction is not None else None
    if card.status == "PROPOSE_REWRITE":
        if stage == "cold_start":
            reasons.append("rewrite_at_cold_start")
        elif target not in set(active_skill_ids):
            reasons.append("invalid_rewrite_target")
    if card.deployable_abstraction is not None and firewall_findings(card_text(card.deployable_abstraction), trace):
        reasons.append("firewall_finding")
    return reasons


def enforce_no_proposal(card: FailureCard, reasons: list[str]) -> tuple[FailureCard, list[str]]:
    """The card with status NO_PROPOSAL when ``reasons`` is not empty (the analysis is kept for
    the record), and the reasons."""
    if not reasons:
        return card, []
    return card.model_copy(update={"status": "NO_PROPOSAL"}), list(reasons)
