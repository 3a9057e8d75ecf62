"""Rule labels: what went wrong in an episode, read from its frozen trace, with the steps that show it.

One label record per episode (``episode_labels.jsonl``), versioned by :data:`LABELS_VERSION`:
the label names present (in taxonomy order) and, per label, the codes seen and the evidence as
step references (``step`` is the trace's ``step_index``; 0 is the reset page; None an
episode-level fact such as a failure outside any step). The taxonomy, with the rule of each
label, is :data:`TAXONOMY`; docs/analysis.md explains it.

The rules read only the trace. Some use what the environment revealed after the episode (the
goal's product, category and options, the reward components): the label records therefore
carry goal-derived evidence and are analysis data, never judge or training input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shopsimrl.metrics import step_facts
from shopsimrl.records import EpisodeTrace, ErrorInfo
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.outputs import check_output_location, replacing
from shopsimrl.schemas import json_bytes, parse_json_exact
from shopsimrl.storage.reading import Run

__all__ = [
    "LABELS_VERSION",
    "TAXONOMY",
    "LabelCounts",
    "LabelsFileError",
    "episode_labels",
    "label_counts",
    "read_labels",
    "write_labels",
]

LABELS_VERSION = "shopsimrl-labels-v1"

TAXONOMY: dict[str, str] = {
    "retrieval_failure": "an unsuccessful completed episode in which no relevant product was reached: neither the goal's "
    "product nor (when the goal names a category) a product of its category was listed or opened",
    "wrong_product": "a purchase whose product does not match the request (r_type < 1 or r_att < 1)",
    "wrong_or_missing_options": "a purchase whose options do not match the goal's (r_option < 1); code missing (fewer "
    "options chosen than the goal has) or wrong",
    "budget_violation": "a purchase that fails the price condition (r_price < 1); code over_budget or price_unverifiable",
    "invalid_action": "actions the environment rejected, by its feedback code (action_feedback.reason)",
    "repeated_action": "the same action sent again on a page showing the same text as before: in a deterministic shop "
    "it can only repeat the earlier outcome",
    "protocol_error": "model replies that were unusable (nothing reached the environment), by protocol error code",
    "generation_length": "the reply was cut off by the token limit without one valid tool call (episode terminated)",
    "context_length": "the server refused the prompt: the conversation outgrew the context window (episode terminated)",
    "action_limit": "the episode ended at the action limit without a purchase; code environment (the shop's count) or "
    "runtime (max_steps model calls)",
    "time_limit": "the runtime ended the episode at its time limit (runtime.max_model_seconds of model time) without a purchase",
    "infrastructure_failure": "the episode failed for an infrastructure reason (retryable: service unavailable, lease, "
    "timeout); legacy traces without failure_class are classified from the error type",
    "episode_error": "the episode failed for another reason; code = failure_class (environment_error, model_error, "
    "runtime_error) or unclassified",
}
"""Every label, in the order records list them, with its rule."""

_STEP_STAGE = re.compile(r"_step_(\d+)$")
_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
_INFRASTRUCTURE_ERRORS = frozenset(
    {"EnvironmentUnavailableError", "LeaseError", "TimeoutError", "ConnectionError", "CleanupError", "ReadTimeout"}
)
_RETRYABLE_HTTP = frozenset({408, 409, 429})
_MESSAGE_CHARS = 300
_PRODUCT_PAGES = frozenset({"product_detail", "information_subpage"})


class LabelsFileError(ValueError):
    """A labels file cannot be read: missing, a bad line, or another labels version (exit 2)."""


# --------------------------------------------------------------------------- labelling one episode


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass
class _Label:
    codes: dict[str, int] = field(default_factory=dict)
    evidence: list[dict[str, Any]] = field(default_factory=list)

    def add(self, evidence: dict[str, Any], code: str | None = None) -> None:
        if code is not None:
            self.codes[code] = self.codes.get(code, 0) + 1
        self.evidence.append(evidence)


@dataclass
class _Pages:
    """Where the goal's product and products of its category were listed or opened."""

    gold_asin: str | None
    category: str | None
    gold_seen_at: int | None = None
    category_seen_at: int | None = None
    opened: dict[str, int] = field(default_factory=dict)
    """asin → the first step that showed its product page."""

    def visit(self, step: int, state: dict[str, Any]) -> None:
        shown = [_map(product) for product in state.get("products") or [] if isinstance(product, dict)]
        product = _map(state.get("product"))
        # Only a product page shows its product; the terminal page names the bought one too.
        if product.get("asin") is not None and state.get("page_type") in _PRODUCT_PAGES:
            self.opened.setdefault(str(product["asin"]), step)
            shown.append(product)
        for item in shown:
            asin = item.get("asin")
            if asin is None:
                continue
            if self.gold_seen_at is None and self.gold_asin is not None and str(asin) == self.gold_asin:
                self.gold_seen_at = step
            if self.category_seen_at is None and self.category and item.get("category") == self.category:
                self.category_seen_at = step


def _failure_class(record: EpisodeTrace) -> tuple[str, bool]:
    """The failure class of a failed record, and whether it was inferred (legacy traces carry none)."""
    if record.failure_class is not None:
        return record.failure_class, False
    error = record.error or ErrorInfo()
    kind = error.type or ""
    if kind in _INFRASTRUCTURE_ERRORS:
        return "infrastructure", True
    if kind == "ModelRequestError":
        status = _HTTP_STATUS.search(error.message or "")
        code = int(status.group(1)) if status else None
        return (
            "model_error" if code is not None and 400 <= code < 500 and code not in _RETRYABLE_HTTP else "infrastructure"
        ), True
    if kind in ("ModelConfigError",):
        return "model_error", True
    if kind.endswith("EnvironmentError"):
        return "environment_error", True
    return ("runtime_error" if kind else "unclassified"), True


def _error_step(error: ErrorInfo) -> int | None:
    match = _STEP_STAGE.search(error.stage or "")
    return int(match.group(1)) if match else None


def episode_labels(record: EpisodeTrace) -> dict[str, Any]:
    """The label record of one trace record (the winning record of its episode)."""
    row = episode_row(record)
    final = record.final
    detail = final.reward_detail if final is not None else {}
    goal = _map(final.get("goal")) if final is not None else {}
    purchase = _map(final.get("purchase")) if final is not None else {}
    steps = record.steps
    completed = bool(row["completed"])
    termination = row["termination_reason"]
    found: dict[str, _Label] = {}

    def label(name: str) -> _Label:
        return found.setdefault(name, _Label())

    gold = goal.get("asin")
    pages = _Pages(str(gold) if gold is not None else None, goal.get("category") or None)
    pages.visit(0, _map((record.reset or {}).get("observation_state")))
    seen_pairs: dict[tuple[str, str], int] = {}
    searches: list[dict[str, Any]] = []
    option_clicks: list[int] = []
    purchase_step: int | None = None
    last_step = 0
    for step in steps:
        index = step.step_index
        last_step = index
        facts = step_facts(step)
        protocol_error = step.effective_protocol_error
        if protocol_error is not None:
            code = protocol_error.code or "unknown"
            label("protocol_error").add({"step": index, "code": code}, code)
        if facts.policy_failure is not None:
            name = facts.policy_failure if facts.policy_failure in ("generation_length", "context_length") else None
            if name is not None:
                label(name).add({"step": index, "finish_reason": step.model.finish_reason})
        environment = step.environment
        if environment is None:
            continue
        action = step.action or ""
        feedback = environment.action_feedback
        valid = feedback.valid if feedback is not None else None
        if facts.invalid_action and feedback is not None:
            code = str(feedback.get("reason") or "unknown")
            label("invalid_action").add({"step": index, "action": action, "code": code}, code)
        observation = step.observation
        if observation is not None and action:
            earlier = seen_pairs.get((observation, action))
            if earlier is None:
                seen_pairs[(observation, action)] = index
            else:
                label("repeated_action").add({"step": index, "action": action, "repeats_step": earlier})
        state = environment.observation_state or {}
        if action.startswith("search[") and valid is not False:
            searches.append({"step": index, "query": action[len("search[") : -1], "results": state.get("total_results")})
        if action.startswith("click[") and "=" in action and valid is True:
            option_clicks.append(index)
        if action == "click[buy now]" and valid is True and environment.done is True:
            purchase_step = index
        pages.visit(index, state)

    successful = completed and row["success"] == 1
    if completed and termination == "purchase":
        _purchase_labels(label, detail, goal, purchase, pages, purchase_step, option_clicks)
    # An agent that never searched did not fail to retrieve (its episode ended otherwise).
    reached = pages.gold_seen_at is not None or pages.category_seen_at is not None
    if completed and not successful and searches and pages.gold_asin is not None and not reached:
        label("retrieval_failure").add(
            {"step": None, "goal_asin": pages.gold_asin, "goal_category": pages.category, "searches": searches}
        )
    if completed and termination == "action_limit":
        last = steps[-1].environment if steps else None
        by_environment = last is not None and last.done is True
        code = "environment" if by_environment else "runtime"
        label("action_limit").add(
            {"step": last_step or None, "model_steps": len(steps), "actions": row["actions"]},
            code,
        )
    if completed and termination == "time_limit" and record.time_limit is not None:
        limit = record.time_limit
        label("time_limit").add(
            {
                "step": last_step or None,
                "model_steps": len(steps),
                "model_seconds": limit.model_seconds,
                "max_model_seconds": limit.max_model_seconds,
            }
        )
    if not completed:
        error = record.error or ErrorInfo()
        failure_class, inferred = _failure_class(record)
        evidence = {
            "step": _error_step(error),
            "stage": error.stage,
            "error_type": error.type,
            "message": (error.message or "")[:_MESSAGE_CHARS],
        }
        if inferred:
            evidence["inferred_class"] = True
        if failure_class == "infrastructure":
            label("infrastructure_failure").add(evidence, failure_class)
        else:
            label("episode_error").add(evidence, failure_class)

    names = [name for name in TAXONOMY if name in found]
    return {
        "labels_version": LABELS_VERSION,
        "episode_id": record.episode_id,
        "task_id": row["task_id"],
        "sample_id": row["sample_id"],
        "split": row["split"],
        "category": row["category"],
        "outcome": {
            "status": row["status"],
            "completed": completed,
            "termination_reason": termination,
            "reward": row["reward"],
            "success": row["success"],
            "failure_class": row["failure_class"],
            "steps": row["steps"],
        },
        "labels": names,
        "details": {
            name: ({"codes": found[name].codes} if found[name].codes else {}) | {"evidence": found[name].evidence}
            for name in names
        },
    }


def _purchase_labels(
    label: Any,
    detail: dict[str, Any],
    goal: dict[str, Any],
    purchase: dict[str, Any],
    pages: _Pages,
    purchase_step: int | None,
    option_clicks: list[int],
) -> None:
    """wrong_product, wrong_or_missing_options and budget_violation from the reward components."""
    asin = purchase.get("asin")
    opened_at = pages.opened.get(str(asin)) if asin is not None else None
    r_type, r_att = _number(detail.get("r_type")), _number(detail.get("r_att"))
    if (r_type is not None and r_type < 1) or (r_att is not None and r_att < 1):
        label("wrong_product").add(
            {
                "step": purchase_step,
                "purchased_asin": asin,
                "goal_asin": goal.get("asin"),
                "opened_at_step": opened_at,
                "goal_listed_at_step": pages.gold_seen_at,
                "r_type": r_type,
                "r_att": r_att,
            }
        )
    r_option = _number(detail.get("r_option"))
    if r_option is not None and r_option < 1:
        chosen = _map(purchase.get("options"))
        wanted = goal.get("goal_options")
        wanted_count = len(wanted) if isinstance(wanted, list | dict) else 0
        code = "missing" if len(chosen) < wanted_count else "wrong"
        label("wrong_or_missing_options").add(
            {
                "step": purchase_step,
                "chosen": chosen,
                "goal_options": wanted,
                "option_clicks": option_clicks,
                "r_option": r_option,
            },
            code,
        )
    r_price = _number(detail.get("r_price"))
    if r_price is not None and r_price < 1:
        resolution = _map(detail.get("price_resolution"))
        price = _number(resolution.get("price"))
        upper = _number(detail.get("price_upper"))
        if upper is None:
            upper = _number(goal.get("price_upper"))
        if resolution.get("status") == "pass" and price is not None and upper is not None and price > upper:
            code = "over_budget"
        else:
            code = "price_unverifiable"
        label("budget_violation").add(
            {
                "step": purchase_step,
                "price": price,
                "price_upper": upper,
                "resolution": resolution.get("status"),
                "method": resolution.get("method"),
            },
            code,
        )


# --------------------------------------------------------------------------- runs and files


def run_labels(run: Run) -> list[dict[str, Any]]:
    """The label record of every episode of a run (its winning records), by episode id: a local
    run and a sharded run of one plan give the same list."""
    return sorted((episode_labels(record) for record in run.records()), key=lambda labels: str(labels["episode_id"]))


def write_labels(run: Run, output: Path) -> LabelCounts:
    """Label every episode of ``run`` into ``output`` (JSONL, by episode id, written whole or not
    at all; never inside the run) and return the counts."""
    output = Path(output)
    check_output_location(run, output)
    counts = _Counter()
    with replacing(output) as handle:
        for labels in run_labels(run):
            handle.write(json_bytes(labels) + b"\n")
            counts.add(labels)
    return counts.result()


def read_labels(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a labels file, checked line by line: each must be a label record of
    :data:`LABELS_VERSION`."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise LabelsFileError(f"{path}: cannot read the labels file ({exc.strerror or exc})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = parse_json_exact(raw)
            except ValueError:
                raise LabelsFileError(f"{path}:{number}: not a JSON line") from None
            if not isinstance(record, dict) or not isinstance(record.get("labels"), list):
                raise LabelsFileError(f"{path}:{number}: not a label record (no 'labels' list)")
            version = record.get("labels_version")
            if version != LABELS_VERSION:
                raise LabelsFileError(f"{path}:{number}: labels_version {version!r}; this version reads {LABELS_VERSION!r}")
            yield record


# --------------------------------------------------------------------------- counts


@dataclass(frozen=True)
class LabelCounts:
    """Episodes per label over a run (an episode counts once per label it carries)."""

    labels_version: str
    episodes: int
    """Label records counted (every episode of the run with a record)."""
    labels: dict[str, int]
    """Every label of :data:`TAXONOMY`, in its order, with the number of episodes carrying it (0 included)."""
    codes: dict[str, dict[str, int]]
    """Per label that has codes: episodes per code (an episode with two codes counts under both)."""
    clean: int
    """Episodes that carry no label."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels_version": self.labels_version,
            "episodes": self.episodes,
            "clean": self.clean,
            "labels": dict(self.labels),
            "codes": {name: dict(codes) for name, codes in self.codes.items()},
        }


class _Counter:
    def __init__(self) -> None:
        self.episodes = self.clean = 0
        self.labels = dict.fromkeys(TAXONOMY, 0)
        self.codes: dict[str, dict[str, int]] = {}

    def add(self, record: Mapping[str, Any]) -> None:
        self.episodes += 1
        names = record.get("labels") or []
        self.clean += not names
        details = _map(record.get("details"))
        for name in names:
            self.labels[name] = self.labels.get(name, 0) + 1
            for code in _map(_map(details.get(name)).get("codes")):
                per_code = self.codes.setdefault(name, {})
                per_code[code] = per_code.get(code, 0) + 1

    def result(self) -> LabelCounts:
        codes = {name: dict(sorted(self.codes[name].items())) for name in TAXONOMY if name in self.codes}
        return LabelCounts(LABELS_VERSION, self.episodes, self.labels, codes, self.clean)


def label_counts(source: Run | Iterable[Mapping[str, Any]]) -> LabelCounts:
    """Episodes per label: of a :class:`Run` (labelled on the fly from its traces) or of label
    records already made (e.g. ``read_labels(path)``)."""
    counter = _Counter()
    for record in run_labels(source) if isinstance(source, Run) else source:
        counter.add(record)
    return counter.result()
