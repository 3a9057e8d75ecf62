"""Exporters: data sets derived from a run, redacted by default, never written into the run.

- :func:`export_sft`: OpenAI chat fine-tuning JSONL (:func:`shopsimrl.research.training.sft_records`)
  from the selected episodes (completed with ``r_success == 1`` by default), exact and near
  duplicates removed, and a report: kept, dropped and why, coverage over tasks and categories.
- :func:`export_judge_input`: one record per selected episode with what a judge may see: the
  task, the transcript (observations, replies, actions and the shop's feedback) and the public
  outcome; never the reward, the rule labels or (unless included) the goal, persona, reasoning.

Both refuse the held-out test split, apply :mod:`shopsimrl.research.redaction`, and write their
files whole or not at all (temporary files renamed into place). Records are ordered by episode
id, so a local run and a sharded run of the same plan give identical files.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from shopsimrl.prompts import persona_section
from shopsimrl.records import EpisodeTrace, ErrorInfo
from shopsimrl.research.dedup import NearDuplicateIndex
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.outputs import OutputWriteError, check_output_location, replacing
from shopsimrl.research.redaction import (
    IDENTIFYING_PERSONA_FIELDS,
    RedactionError,
    persona_of,
    refuse_test_split,
    refusing_test_records,
    removed_persona_fields,
)
from shopsimrl.research.training import TraceShapeError, check_chat_record, sft_records
from shopsimrl.schemas import canonical_json, json_bytes, parse_json_exact
from shopsimrl.storage.reading import Run

__all__ = [
    "EXPORT_REPORT_VERSION",
    "JUDGE_INPUT_VERSION",
    "SELECTIONS",
    "ExportError",
    "check_sft_file",
    "export_judge_input",
    "export_sft",
    "iter_judge_inputs",
    "judge_input",
    "report_path_for",
]

EXPORT_REPORT_VERSION = "shopsimrl-export-report-v1"
JUDGE_INPUT_VERSION = "shopsimrl-judge-input-v1"
SELECTIONS = ("success", "completed", "all")
"""``success``: completed with ``r_success == 1``; ``completed``: every scored episode; ``all``:
failed ones too (judge input only: an SFT record needs a finished episode)."""
DEFAULT_NEAR_DUPLICATE = 0.9
_PERSONA_LABEL = persona_section({}).partition("\n")[0]
_PURCHASE_KEYS = ("asin", "name", "category", "product_category", "price", "options")
"""What a judge sees of a purchase: what the agent bought. The shop's purchase object also holds
the bought product's own task instruction, which for the goal's product is the private goal."""


class ExportError(ValueError):
    """Bad input for an export (exit 2): a selection or inclusion the export does not take."""


def report_path_for(output: Path) -> Path:
    """``sft.jsonl`` → ``sft.report.json``, next to it."""
    return output.with_name(f"{output.stem}.report.json")


def _selected(row: dict[str, Any], select: str) -> str | None:
    """Why the episode is not selected, None when it is."""
    if select == "all":
        return None
    if not row["completed"]:
        return "not completed"
    if select == "success" and row["success"] != 1:
        return "not successful (r_success != 1)"
    return None


@dataclass
class _Spool:
    """Episodes' lines in reading order in a temporary file, replayed in episode-id order."""

    handle: IO[bytes]
    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """episode id → (offset, bytes, lines)."""

    def add(self, episode_id: str, lines: list[bytes]) -> None:
        data = b"".join(lines)
        self.spans[episode_id] = (self.handle.tell(), len(data), len(lines))
        self.handle.write(data)

    def write_to(self, episode_ids: list[str], out: IO[bytes]) -> None:
        """The lines of these episodes, in this order."""
        for episode_id in episode_ids:
            offset, size, _ = self.spans[episode_id]
            self.handle.seek(offset)
            out.write(self.handle.read(size))
        self.handle.seek(0, os.SEEK_END)


@contextmanager
def _spool(output: Path) -> Iterator[_Spool]:
    """A spool next to ``output`` (the same disk the output will need)."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        handle = tempfile.TemporaryFile("w+b", dir=output.parent, prefix=f".{output.name}.spool.")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise OutputWriteError(f"{output}: cannot write ({exc.strerror or exc})") from None
    with handle:
        yield _Spool(handle)


@dataclass
class _Coverage:
    tasks: dict[str, set[str]] = field(default_factory=lambda: {"in_run": set(), "selected": set(), "kept": set()})
    categories: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, stage: str, row: dict[str, Any]) -> None:
        self.tasks[stage].add(str(row["task_id"]))
        category = str(row["category"] or "unknown")
        per_stage = self.categories.setdefault(category, {"in_run": 0, "selected": 0, "kept": 0})
        per_stage[stage] += 1

    def to_dict(self) -> dict[str, Any]:
        lost = sorted(name for name, counts in self.categories.items() if counts["selected"] and not counts["kept"])
        return {
            "tasks": {stage: len(ids) for stage, ids in self.tasks.items()},
            "categories": {name: self.categories[name] for name in sorted(self.categories)},
            "categories_kept": sum(1 for counts in self.categories.values() if counts["kept"]),
            "categories_selected_but_not_kept": lost,
        }


def _selected_records(
    run: Run, select: str, selection: dict[str, Any], coverage: _Coverage
) -> Iterator[tuple[EpisodeTrace, dict[str, Any]]]:
    """Each selected episode's record and row, refusing test-split records on the way; counts
    every episode of the run into the report's ``selection`` and the coverage's ``in_run`` and
    ``selected`` stages (``kept`` is the exporter's to count)."""
    for record in refusing_test_records(run.records(), run.location):
        row = episode_row(record)
        selection["episodes_in_run"] += 1
        coverage.count("in_run", row)
        why = _selected(row, select)
        if why is not None:
            selection["not_selected"][why] = selection["not_selected"].get(why, 0) + 1
            continue
        selection["selected"] += 1
        coverage.count("selected", row)
        yield record, row


def _normalised_ids(records: list[dict[str, Any]]) -> str:
    """Canonical JSON of an episode's records with tool-call ids replaced by their order of
    appearance: ids are random per call, so two identical episodes differ only there."""
    names: dict[str, str] = {}

    def rename(value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key in ("id", "tool_call_id") and isinstance(item, str):
                    out[key] = names.setdefault(item, f"call-{len(names)}")
                else:
                    out[key] = rename(item)
            return out
        if isinstance(value, list):
            return [rename(item) for item in value]
        return value

    return canonical_json(rename(records))


def _trajectory_text(record: EpisodeTrace) -> str:
    """The episode as the shop saw it, for near-duplicate detection: the task message, then every
    action and the page it led to. Repair turns are left out: two samples that took the same
    actions through the same pages teach the same thing, whatever the unusable replies between."""
    conversation = record.conversation
    parts = [str(conversation[1].get("content") or "")] if len(conversation) > 1 and isinstance(conversation[1], dict) else []
    for step in record.steps:
        if step.environment is not None:
            parts += [str(step.action or ""), str(step.environment.get("observation") or "")]
    return "\n".join(parts)


_TERMS = re.compile(r"[\s,，、;；:：/|()（）\[\]【】\"'“”]+")


def _uses_persona_words(item: dict[str, Any]) -> bool:
    """Whether the record's target (the last reply's call arguments) uses a word of two or more
    characters that the persona section holds and no other message of the record does: a pair
    that would break if the persona were removed."""
    messages = item.get("messages") or []
    system = messages[0].get("content") if messages and isinstance(messages[0], dict) else None
    if not isinstance(system, str) or _PERSONA_LABEL not in system:
        return False
    start = system.index(_PERSONA_LABEL)
    end = system.find("\n\n", start)
    persona = system[start : end if end >= 0 else len(system)]
    context = [system.replace(persona, "")]
    for message in messages[1:-1]:
        if isinstance(message, dict):
            context.append(str(message.get("content") or ""))
            context += [str(_map(call.get("function")).get("arguments")) for call in message.get("tool_calls") or []]
    others = "\n".join(context)
    words: set[str] = set()
    for call in _map(messages[-1]).get("tool_calls") or []:
        try:
            arguments = orjson.loads(_map(call.get("function")).get("arguments") or "{}")
        except orjson.JSONDecodeError:
            continue
        for value in arguments.values() if isinstance(arguments, dict) else ():
            words.update(word for word in _TERMS.split(str(value)) if len(word) >= 2)
    return any(word in persona and word not in others for word in words)


def _identity(run: Run) -> dict[str, Any]:
    identity = run.identity
    return {key: identity.get(key) for key in ("uri", "experiment", "model_id", "checkpoint_id", "plan_fingerprint", "split")} | {
        "location": run.location,
        "kind": run.kind,
    }


def _base_report(kind: str, run: Run, output: Path, include: frozenset[str], select: str) -> dict[str, Any]:
    return {
        "report_version": EXPORT_REPORT_VERSION,
        "kind": kind,
        "created_at": datetime.now(UTC).isoformat(),
        "run": _identity(run),
        "output": str(output),
        "selection": {"select": select, "episodes_in_run": 0, "selected": 0, "not_selected": {}},
        "redaction": {
            "included": sorted(include),
            # SFT records keep the persona the policy saw (without identifying fields): see "persona".
            "left_out": [name for name in _LEFT_OUT[kind] if name not in include],
        },
    }


_LEFT_OUT = {"sft": ("reasoning", "goal"), "judge-input": ("reasoning", "persona", "goal")}


def export_sft(
    run: Run,
    output: Path,
    *,
    include: frozenset[str] = frozenset(),
    select: str = "success",
    near_duplicate: float = DEFAULT_NEAR_DUPLICATE,
    report: Path | None = None,
) -> dict[str, Any]:
    """Write the SFT file and its report (``report`` or :func:`report_path_for`); return the report."""
    if select not in ("success", "completed"):
        raise ExportError(f"--select {select!r}: SFT records come from finished episodes; choose success or completed")
    if "goal" in include:
        raise ExportError("--include goal: SFT records hold only what the model saw, and it never saw the goal")
    output, report = Path(output), Path(report) if report is not None else report_path_for(Path(output))
    check_output_location(run, output)
    check_output_location(run, report)
    refuse_test_split(run)
    index = NearDuplicateIndex(near_duplicate)
    summary = _base_report("sft", run, output, include, select)
    selection = summary["selection"]
    coverage = _Coverage()
    dropped: list[dict[str, Any]] = []
    candidates: list[tuple[str, str, np.ndarray, dict[str, Any]]] = []
    persona_fields: dict[str, list[str]] = {}
    persona_dependent: dict[str, int] = {}
    refused_for_persona = 0
    with _spool(output) as spool:
        for record, row in _selected_records(run, select, selection, coverage):
            episode_id = str(row["episode_id"])
            try:
                records = sft_records(record, include=include)
            except (TraceShapeError, RedactionError) as exc:
                refused_for_persona += isinstance(exc, RedactionError)
                dropped.append({"episode_id": episode_id, "reason": "unusable", "detail": str(exc)})
                continue
            persona_fields[episode_id] = removed_persona_fields(record, include)
            persona_dependent[episode_id] = sum(_uses_persona_words(item) for item in records)
            if not records:
                dropped.append({"episode_id": episode_id, "reason": "unusable", "detail": "no model call made a valid action"})
                continue
            problems = [error for item in records for error in check_chat_record(item, reasoning="reasoning" in include)]
            if problems:
                dropped.append({"episode_id": episode_id, "reason": "format", "detail": problems[0]})
                continue
            spool.add(episode_id, [json_bytes(item) + b"\n" for item in records])
            exact = hashlib.sha256(_normalised_ids(records).encode("utf-8")).hexdigest()
            candidates.append((episode_id, exact, index.signature(_trajectory_text(record)), row))

        kept: list[str] = []
        first_of: dict[str, str] = {}
        for episode_id, exact, signature, row in sorted(candidates, key=lambda item: item[0]):
            if exact in first_of:
                dropped.append({"episode_id": episode_id, "reason": "exact_duplicate", "of": first_of[exact]})
                continue
            similar = index.most_similar(signature)
            if similar is not None:
                dropped.append(
                    {"episode_id": episode_id, "reason": "near_duplicate", "of": similar[0], "similarity": round(similar[1], 4)}
                )
                continue
            first_of[exact] = episode_id
            index.add(episode_id, signature)
            kept.append(episode_id)
            coverage.count("kept", row)

        lines: list[dict[str, Any]] = []
        line = 1
        for episode_id in kept:
            count = spool.spans[episode_id][2]
            lines.append({"episode_id": episode_id, "first_line": line, "records": count})
            line += count
        with replacing(output) as out:
            spool.write_to(kept, out)

    reasons: dict[str, int] = {}
    for item in dropped:
        reasons[item["reason"]] = reasons.get(item["reason"], 0) + 1
    removed: dict[str, int] = {}
    for episode_id in kept:
        for name in persona_fields[episode_id]:
            removed[name] = removed.get(name, 0) + 1
    summary["redaction"]["persona"] = {
        "exported": "in full" if "persona" in include else "as the policy saw it, without its identifying fields",
        "identifying_fields": [] if "persona" in include else sorted(IDENTIFYING_PERSONA_FIELDS),
        "kept_episodes_with_fields_removed": dict(sorted(removed.items())),
        "episodes_refused": refused_for_persona,
        "records_using_persona_words": sum(persona_dependent[episode_id] for episode_id in kept),
    }
    summary |= {
        "dedup": {
            "exact": "identical records once tool-call ids are numbered in order",
            "near": {
                "threshold": near_duplicate,
                "text": "the task message, then each action and the page it led to (repair turns left out)",
                "method": "MinHash (128 permutations, 32 bands) over 5-character shingles",
            },
            "order": "episodes are considered by episode id; the first of a group is kept",
        },
        "kept": len(kept),
        "records": line - 1,
        "dropped": {
            "total": len(dropped),
            "by_reason": dict(sorted(reasons.items())),
            "episodes": sorted(dropped, key=lambda d: d["episode_id"]),
        },
        "coverage": coverage.to_dict(),
        "episodes": lines,
        "format_check": {"records": line - 1, "errors": 0},
    }
    with replacing(report) as out:
        out.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return summary


def check_sft_file(path: Path, *, reasoning: bool = False) -> list[str]:
    """Every format error of an SFT file, ``line N: …`` (empty when it passes)."""
    errors: list[str] = []
    with Path(path).open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                record = parse_json_exact(raw)
            except ValueError:
                errors.append(f"line {number}: not JSON")
                continue
            errors += [f"line {number}: {error}" for error in check_chat_record(record, reasoning=reasoning)]
    return errors


# --------------------------------------------------------------------------- judge input


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def judge_input(record: EpisodeTrace, include: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a judge may see of one episode (see the module docstring)."""
    row = episode_row(record)
    reset, final = record.reset or {}, record.final
    transcript = []
    for step in record.steps:
        model = step.model
        environment = step.environment
        entry: dict[str, Any] = {
            "step": step.step_index,
            "observation": step.observation,
            "tools": [_map(tool.get("function")).get("name") for tool in step.tools if isinstance(tool, dict)],
            "reply": {
                "content": model.content,
                "tool_calls": [{"name": call.name, "arguments": call.raw_arguments} for call in model.tool_calls],
            },
            "action": step.action,
        }
        if "reasoning" in include:
            entry["reasoning"] = model.reasoning
        if environment is not None:
            feedback = environment.get("action_feedback")
            entry["feedback"] = {key: _map(feedback).get(key) for key in ("valid", "reason", "message")}
        problems = {"protocol_error": step.effective_protocol_error, "policy_failure": step.effective_policy_failure}
        for key, problem in problems.items():
            if problem is not None:
                entry[key] = {"code": problem.code, "message": problem.message}
        transcript.append(entry)
    outcome: dict[str, Any] = {"status": row["status"], "completed": row["completed"], "steps": row["steps"]}
    if row["completed"] and final is not None:
        purchase = _map(final.get("purchase"))
        outcome |= {
            "termination_reason": row["termination_reason"],
            "purchase": {key: purchase[key] for key in _PURCHASE_KEYS if key in purchase} or None,
            "final_observation": final.get("observation"),
        }
    else:
        error = record.error or ErrorInfo()
        outcome["error"] = {"stage": error.stage, "type": error.type}
    data: dict[str, Any] = {
        "judge_input_version": JUDGE_INPUT_VERSION,
        "episode_id": row["episode_id"],
        "task_id": row["task_id"],
        "sample_id": row["sample_id"],
        "task_instruction": reset.get("task_instruction"),
    }
    if "persona" in include:
        data["persona"] = persona_of(record)
    if "goal" in include:
        goal = _map(final.get("goal")) if final is not None else {}
        data["goal"] = {key: value for key, value in goal.items() if key != "user_persona"} or None
    data |= {"transcript": transcript, "outcome": outcome}
    return data


def iter_judge_inputs(
    run: Run, *, select: str = "completed", include: frozenset[str] = frozenset(), not_selected: dict[str, int] | None = None
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(episode_row, judge_input)`` of every episode ``select`` takes, in reading order: the
    selection and redaction of ``export judge-input``, for the judge stage. The held-out test
    split is refused. ``not_selected`` (when given) counts the others by reason."""
    if select not in SELECTIONS:
        raise ExportError(f"--select {select!r}: choose one of {', '.join(SELECTIONS)}")
    refuse_test_split(run)
    for record in refusing_test_records(run.records(), run.location):
        row = episode_row(record)
        why = _selected(row, select)
        if why is not None:
            if not_selected is not None:
                not_selected[why] = not_selected.get(why, 0) + 1
            continue
        yield row, judge_input(record, include)


def export_judge_input(
    run: Run,
    output: Path,
    *,
    include: frozenset[str] = frozenset(),
    select: str = "completed",
    report: Path | None = None,
) -> dict[str, Any]:
    """Write one judge-input record per selected episode, by episode id, and a report."""
    if select not in SELECTIONS:
        raise ExportError(f"--select {select!r}: choose one of {', '.join(SELECTIONS)}")
    output, report = Path(output), Path(report) if report is not None else report_path_for(Path(output))
    check_output_location(run, output)
    check_output_location(run, report)
    refuse_test_split(run)
    summary = _base_report("judge-input", run, output, include, select)
    selection = summary["selection"]
    coverage = _Coverage()
    with _spool(output) as spool:
        for record, row in _selected_records(run, select, selection, coverage):
            coverage.count("kept", row)
            spool.add(str(row["episode_id"]), [json_bytes(judge_input(record, include)) + b"\n"])
        written = sorted(spool.spans)
        with replacing(output) as out:
            spool.write_to(written, out)
    summary |= {"records": len(written), "coverage": coverage.to_dict()}
    with replacing(report) as out:
        out.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return summary
