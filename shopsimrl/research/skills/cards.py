"""The analysts' cards, the tools that submit them, and their validation by code.

The tool schemas are generated from the models (:func:`tool`): the schema the model is offered
and the check its answer gets cannot drift apart. :func:`validate_arguments` checks a tool's
arguments strictly (no coercion, no unknown keys) and names the failing field as a JSON path
(``$.cards[0].confidence: ...``), the message a repair turn quotes.

Success card ids are ``success-{episode}-{NN}`` (NN from 01, in answer order). An empty answer
(no card) gives one placeholder card, ineligible, so every analysed success trajectory is
accounted for in ``evidence_cards.jsonl``.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "CLUSTERS_TOOL",
    "FAILURE_TOOL",
    "INITIAL_SKILL_TOOL",
    "ONLINE_CANDIDATES_TOOL",
    "SUCCESS_TOOL",
    "Cluster",
    "Clusters",
    "DeployableAbstraction",
    "EarliestDivergence",
    "EvidenceItem",
    "FailureCard",
    "InitialSkill",
    "OnlineCandidate",
    "OnlineCandidates",
    "PrivilegedAudit",
    "SkillChunk",
    "SuccessCard",
    "SuccessCards",
    "accounted_once",
    "placeholder_card",
    "success_card_id",
    "tool",
    "tool_schema",
    "validate_arguments",
]

SUCCESS_TOOL = "submit_success_cards"
FAILURE_TOOL = "submit_failure_card"
CLUSTERS_TOOL = "submit_clusters"
INITIAL_SKILL_TOOL = "submit_initial_skill"
ONLINE_CANDIDATES_TOOL = "submit_online_candidates"

Text = str
M = TypeVar("M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _text(description: str) -> Any:
    return Field(min_length=1, description=description)


class EvidenceItem(_Strict):
    """One observation in the trace that supports the card, with its step."""

    step: int = Field(ge=0, description="the step_index (the `step` of the compact trace) it was seen at")
    evidence: Text = _text("what was seen or done at that step")


class SuccessCard(_Strict):
    mechanism: Text = _text("why the decision worked (中文)")
    applicable_when: Text = _text("when the lesson applies, in general terms (中文)")
    observed_evidence: list[EvidenceItem] = Field(min_length=1, description="steps of this trace that show it")
    decisive_behavior: Text = _text("the non-trivial decision the agent made (中文)")
    generalizable_lesson: Text = _text("the lesson for other tasks, without product names or ids (中文)")
    related_chunk_ids: list[Text] = Field(default_factory=list, description="ids of current skill chunks it relates to")
    confidence: float = Field(ge=0.0, le=1.0, description="0 to 1")


class SuccessCards(_Strict):
    """The arguments of ``submit_success_cards``; the maximum number of cards is set per call."""

    cards: list[SuccessCard] = Field(description="0 to max_cards cards; none when nothing was non-trivial")


class EarliestDivergence(_Strict):
    step: int = Field(ge=0)
    description: Text = _text("what went wrong first, causally (中文)")


class PrivilegedAudit(_Strict):
    """What the failure analyst found with the gold in view; never deployed."""

    gold_asins: list[Text] = Field(default_factory=list)
    failure_surface: Text = _text("where the failure showed (中文)")
    earliest_divergence: EarliestDivergence
    oracle_comparison: Text = _text("the gold against what was chosen (中文)")
    replay_evidence: list[Text] = Field(default_factory=list, description="what the live trials showed")
    minimal_repair: Text = _text("the smallest change of behaviour that fixes it (中文)")
    repair_validation_result: Text = _text("what the counterfactual trial gave (中文)")


class DeployableAbstraction(_Strict):
    """What may become skill text: checked by the firewall."""

    mechanism: Text = _text("(中文)")
    applicable_when: Text = _text("(中文)")
    trigger: Text = _text("(中文)")
    corrective_procedure: list[Text] = Field(min_length=1)
    verification: Text = _text("(中文)")
    target: Text | None = Field(default=None, description="the chunk id a REWRITE replaces; null for ADD")
    proposed_content: Text = _text("the skill text proposed (中文)")


class FailureCard(_Strict):
    status: Literal["PROPOSE_ADD", "PROPOSE_REWRITE", "NO_PROPOSAL"]
    privileged_audit: PrivilegedAudit
    deployable_abstraction: DeployableAbstraction | None = Field(
        default=None, description="required unless status is NO_PROPOSAL"
    )

    @model_validator(mode="after")
    def _proposal_has_abstraction(self) -> FailureCard:
        if self.status != "NO_PROPOSAL" and self.deployable_abstraction is None:
            raise ValueError(f"deployable_abstraction is required when status is {self.status}")
        return self


class Cluster(_Strict):
    workflow_stage: Text = _text("(中文)")
    mechanism: Text = _text("(中文)")
    applicable_when: Text = _text("(中文)")
    procedure: list[Text] = Field(min_length=1)
    verification: Text = _text("(中文)")
    common_failure: Text = _text("(中文)")
    evidence_card_ids: list[Text] = Field(min_length=1)


class Clusters(_Strict):
    clusters: list[Cluster]
    evidence_only_card_ids: list[Text] = Field(default_factory=list)


class SkillChunk(_Strict):
    title: Text = _text("short title")
    workflow_stage: Text = _text("(中文)")
    applicable_when: Text = _text("(中文)")
    procedure: list[Text] = Field(min_length=1)
    verification: Text = _text("(中文)")
    common_failure: Text = _text("(中文)")
    evidence_cluster_ids: list[Text] = Field(min_length=1)


class InitialSkill(_Strict):
    skill_title: Text = _text("(中文)")
    chunks: list[SkillChunk] = Field(min_length=1)
    evidence_only_cluster_ids: list[Text] = Field(default_factory=list)
    conflicts_resolved: list[Text] = Field(default_factory=list)


class OnlineCandidate(_Strict):
    """One online proposal: a new chunk (ADD, no target) or a new version of an active one."""

    operation: Literal["ADD", "REWRITE"]
    target_chunk_id: Text | None = Field(default=None, description="the active chunk a REWRITE replaces; null for ADD")
    title: Text = _text("short title")
    workflow_stage: Text = _text("(中文)")
    failure_mechanism: Text = _text("the failure it prevents (中文)")
    applicable_when: Text = _text("(中文)")
    procedure: list[Text] = Field(min_length=1)
    verification: Text = _text("(中文)")
    common_failure: Text = _text("(中文)")
    evidence_card_ids: list[Text] = Field(min_length=1)

    @model_validator(mode="after")
    def _target_matches_operation(self) -> OnlineCandidate:
        if self.operation == "ADD" and self.target_chunk_id is not None:
            raise ValueError("an ADD candidate has no target_chunk_id (null)")
        if self.operation == "REWRITE" and self.target_chunk_id is None:
            raise ValueError("a REWRITE candidate names the active chunk it replaces in target_chunk_id")
        return self


class OnlineCandidates(_Strict):
    """The arguments of ``submit_online_candidates``; the maximum number is set per call."""

    candidates: list[OnlineCandidate]
    evidence_only_card_ids: list[Text] = Field(default_factory=list)


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with every ``$ref`` replaced by its definition and pydantic's titles dropped:
    the plain JSON Schema OpenAI-compatible servers (llama.cpp's grammar among them) accept."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
        out = {}
        for key, value in schema.items():
            if key in ("$defs", "title") or (key == "default" and value is None):
                continue
            if key == "properties":
                out[key] = {name: _inline(item, defs) for name, item in value.items()}
            else:
                out[key] = _inline(value, defs)
        return out
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    return schema


def tool_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema of ``model``'s fields, self-contained; unknown keys are refused."""
    schema = model.model_json_schema()
    out: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return out


def tool(name: str, description: str, model: type[BaseModel], **limits: int) -> dict[str, Any]:
    """The OpenAI tool definition of ``name``; ``limits`` set ``maxItems`` of top-level lists
    (``cards=2``)."""
    parameters = tool_schema(model)
    for field, count in limits.items():
        parameters["properties"][field]["maxItems"] = count
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _path(location: tuple[int | str, ...]) -> str:
    out = "$"
    for part in location:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def validate_arguments(model: type[M], arguments: Any, **limits: int) -> tuple[M | None, str | None]:
    """(the parsed arguments, None) or (None, every problem, each naming its field)."""
    if not isinstance(arguments, dict):
        return None, f"$: the arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        value = model.model_validate(arguments)
    except ValidationError as exc:
        problems = [f"{_path(tuple(error['loc']))}: {error['msg']}" for error in exc.errors(include_url=False)]
        return None, "; ".join(problems[:8])
    for field, count in limits.items():
        items = getattr(value, field)
        if len(items) > count:
            return None, f"$.{field}: {len(items)} items, at most {count} allowed"
    return value, None


def accounted_once(expected: list[str], cited: list[str], kind: str, grouped_in: str, left_out: str) -> str | None:
    """The contract that every id of ``expected`` is cited exactly once (in a group or left out
    on purpose): None, or the first problem naming the ids (``kind``: ``card``, ``cluster``)."""
    unknown = sorted(set(cited) - set(expected))
    if unknown:
        return f"$: {kind} ids not among those given: {', '.join(unknown)}"
    twice = sorted({item for item in cited if cited.count(item) > 1})
    if twice:
        return f"$: {kind} ids given more than once: {', '.join(twice)}"
    missing = [item for item in expected if item not in cited]
    if missing:
        return f"$: {kind} ids in no {grouped_in} and not {left_out}: {', '.join(missing)}"
    return None


def success_card_id(episode_id: str, number: int) -> str:
    return f"success-{episode_id}-{number:02d}"


def placeholder_card(episode_id: str) -> dict[str, Any]:
    """The card of a success analysis that found nothing worth a card: accounted for, ineligible."""
    return {
        "card_id": success_card_id(episode_id, 0),
        "channel": "success",
        "episode_id": episode_id,
        "placeholder": True,
        "eligible": False,
        "ineligible_reasons": ["empty_answer"],
        "card": None,
        "firewall_findings": [],
    }
