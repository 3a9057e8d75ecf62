"""``shopsimrl view``: a local, read-only web viewer of one run's episodes.

At start the run is read once: one :func:`~shopsimrl.research.episodes.episode_row` per episode
into a DataFrame (:func:`~shopsimrl.research.tables.episodes_table`) and where each winning
record lies (:meth:`Run.index`). The episode table is filtered, sorted and paged on the server
from that frame; opening an episode reads its one record (:meth:`Run.record`: one line of a
local run, one part of a sharded run).

Trace text is model and environment output, so every value is HTML-escaped where it is put into
a page (:func:`esc`, :func:`h`); the pages have no script at all and a Content-Security-Policy
that forbids any, and load nothing from elsewhere. Only GET is served, and only to the host
names the viewer was bound under (a DNS-rebinding page cannot read it).
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import math
import re
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from http import HTTPStatus
from typing import Any
from urllib.parse import quote, urlencode

import h11
import pandas as pd  # type: ignore[import-untyped]  # no type information (pandas-stubs is not a dependency)
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from shopsimrl.records import RecordVersionError
from shopsimrl.research.tables import episodes_table, to_frame
from shopsimrl.research.transcript import StepView, Transcript, headline, outline, read_transcript, step_usage
from shopsimrl.schemas import escape_lone_surrogates
from shopsimrl.storage.objectstore import StoreUnavailableError
from shopsimrl.storage.reading import Run, RunReadError

__all__ = [
    "MAX_PAGE_SIZE",
    "PAGE_SIZE",
    "EpisodeIndex",
    "Query",
    "QueryError",
    "ViewerError",
    "allowed_hosts",
    "bind",
    "create_app",
    "esc",
    "h",
    "serve",
    "valid_host_name",
]

PAGE_SIZE = 50
"""Episodes per table page unless the query says (``per_page``)."""
MAX_PAGE_SIZE = 500

COLUMNS: tuple[tuple[str, str], ...] = (
    ("episode_id", "episode"),
    ("task_id", "task"),
    ("category", "category"),
    ("status", "status"),
    ("termination_reason", "ending"),
    ("failure_class", "failure"),
    ("reward", "reward"),
    ("success", "success"),
    ("steps", "steps"),
    ("invalid_actions", "invalid"),
    ("protocol_errors", "protocol"),
    ("total_tokens", "tokens"),
    ("model_latency_ms_total", "model ms"),
    ("duration_ms", "wall ms"),
    ("attempt", "attempt"),
)
"""The table's columns (every one sortable): frame column, heading."""
SORTABLE = frozenset(name for name, _ in COLUMNS)


class ViewerError(ValueError):
    """The viewer cannot start as asked (exit 2): the address cannot be bound."""


class QueryError(ValueError):
    """A table filter or sort parameter is malformed (answered 400, naming it)."""


# --------------------------------------------------------------------------- escaping


class Html(str):
    """Markup built here from escaped values; :func:`esc` passes it through unchanged."""

    __slots__ = ()


def esc(value: Any) -> Html:
    """``value`` as HTML text: escaped unless it already is :class:`Html`."""
    return value if isinstance(value, Html) else Html(html.escape(str(value), quote=True))


def h(template: str, *values: Any) -> Html:
    """``template`` (markup written here) with each ``{}`` filled by an escaped value."""
    if template.count("{}") != len(values):
        raise ValueError(f"{template!r} has {template.count('{}')} places for {len(values)} values")
    return Html(template.format(*(esc(value) for value in values)))


def join(parts: Any) -> Html:
    return Html("".join(esc(part) for part in parts))


# --------------------------------------------------------------------------- the index


MAX_DIGITS = 18
"""The most digits of a page, row count or task id (any such number fits 64 bits)."""


def _shown(text: str) -> str:
    """A query value as an error message quotes it: its beginning, and its length when long."""
    return repr(text) if len(text) <= 40 else f"{text[:40]!r}… ({len(text)} characters)"


def _whole_number(name: str, text: str, what: str) -> int:
    """``text`` as a non-negative integer: ASCII digits only (``str.isdigit`` also takes ``²``
    and ``٣``, which ``int`` refuses or reads), at most :data:`MAX_DIGITS` of them (``int`` of
    more than 4,300 raises)."""
    if not (text.isascii() and text.isdigit()):
        raise QueryError(f"{name}: {_shown(text)} is not {what}")
    if len(text.lstrip("0")) > MAX_DIGITS:
        raise QueryError(f"{name}: {_shown(text)} is too large ({len(text)} digits; at most {MAX_DIGITS})")
    return int(text)


@dataclass(frozen=True)
class Query:
    """The table's filters, sort and page, from and to the URL's query string."""

    status: str = ""
    success: str = ""
    """``1``, ``0``, ``none`` (not scored) or empty."""
    reward_min: float | None = None
    reward_max: float | None = None
    termination_reason: str = ""
    failure_class: str = ""
    task_id: int | None = None
    category: str = ""
    """A part of the category path (``数码`` matches ``数码›电脑配件›机械键盘``)."""
    sort: str = "episode_id"
    desc: bool = False
    page: int = 1
    per_page: int = PAGE_SIZE

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Query:
        values: dict[str, Any] = {}
        for name in ("status", "termination_reason", "failure_class", "category"):
            values[name] = params.get(name, "").strip()
        success = params.get("success", "").strip()
        if success not in ("", "1", "0", "none"):
            raise QueryError(f"success: {_shown(success)} is not one of 1, 0, none")
        values["success"] = success
        for name in ("reward_min", "reward_max"):
            text = params.get(name, "").strip()
            if text:
                try:
                    values[name] = float(text)
                except ValueError:
                    raise QueryError(f"{name}: {_shown(text)} is not a number") from None
                if not math.isfinite(values[name]):
                    raise QueryError(f"{name}: {_shown(text)} is not a finite number")
        task = params.get("task_id", "").strip()
        if task:
            values["task_id"] = _whole_number("task_id", task, "a task number")
        sort = params.get("sort", "episode_id")
        if sort not in SORTABLE:
            raise QueryError(f"sort: {_shown(sort)} is not a column of the table")
        values["sort"] = sort
        values["desc"] = params.get("desc", "") == "1"
        page = params.get("page", "1").strip()
        values["page"] = _whole_number("page", page, "a page number")
        if values["page"] < 1:
            raise QueryError(f"page: {_shown(page)} is not a page number")
        per_page = params.get("per_page", str(PAGE_SIZE)).strip()
        rows = f"a number of rows from 1 to {MAX_PAGE_SIZE}"
        values["per_page"] = _whole_number("per_page", per_page, rows)
        if not 1 <= values["per_page"] <= MAX_PAGE_SIZE:
            raise QueryError(f"per_page: {_shown(per_page)} is not {rows}")
        return cls(**values)

    def url(self, path: str = "/", **changes: Any) -> str:
        """``path`` with this query (changed by ``changes``) as its query string; defaults left out."""
        query = replace(self, **changes)
        default = Query()
        params = {}
        for item in fields(query):
            value = getattr(query, item.name)
            if value != getattr(default, item.name):
                params[item.name] = "1" if value is True else value
        return path + (f"?{urlencode(params)}" if params else "")


@dataclass
class EpisodeIndex:
    """Every episode's row, held once; the table's queries run on it."""

    frame: pd.DataFrame
    seconds: float
    """How long reading the run took."""
    choices: dict[str, list[str]]
    """The values present of the filters offered as lists."""

    @classmethod
    def build(cls, run: Run) -> EpisodeIndex:
        started = time.perf_counter()
        frame = to_frame(episodes_table(run))
        choices = {
            name: sorted(str(value) for value in frame[name].dropna().unique())
            for name in ("status", "termination_reason", "failure_class", "category")
        }
        return cls(frame, time.perf_counter() - started, choices)

    def select(self, query: Query) -> pd.DataFrame:
        """The rows the filters keep, in the query's order."""
        frame = self.frame
        mask = pd.Series(True, index=frame.index)
        for name in ("status", "termination_reason", "failure_class"):
            value = getattr(query, name)
            if value:
                mask &= frame[name] == value
        if query.category:
            mask &= frame["category"].str.contains(query.category, regex=False, na=False)
        if query.success == "none":
            mask &= frame["success"].isna()
        elif query.success:
            mask &= frame["success"] == float(query.success)
        if query.reward_min is not None:
            mask &= frame["reward"] >= query.reward_min
        if query.reward_max is not None:
            mask &= frame["reward"] <= query.reward_max
        if query.task_id is not None:
            mask &= frame["task_id"] == query.task_id
        selected = frame[mask.fillna(False).astype(bool)]
        keys = [query.sort] if query.sort == "episode_id" else [query.sort, "episode_id"]
        return selected.sort_values(
            keys, ascending=[not query.desc] + [True] * (len(keys) - 1), na_position="last", kind="stable"
        )


# --------------------------------------------------------------------------- pages

CSS = """
:root { --fg: #1d232a; --muted: #5c6670; --line: #d8dde2; --bg: #f6f7f9; --ok: #1a7f37; --bad: #b42318; --warn: #9a6700; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg); }
header.top { background: #fff; border-bottom: 1px solid var(--line); padding: 10px 20px; }
header.top h1 { font-size: 17px; margin: 0 0 2px; }
header.top .meta { color: var(--muted); font-size: 12.5px; }
main { padding: 14px 20px 40px; max-width: 1500px; }
a { color: #0b5cad; text-decoration: none; } a:hover { text-decoration: underline; }
form.filters { display: flex; flex-wrap: wrap; gap: 8px 14px; align-items: end; background: #fff;
  border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; margin-bottom: 10px; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); gap: 2px; }
form.filters input, form.filters select { font: inherit; padding: 3px 5px; min-width: 7em; }
form.filters input.num { width: 7em; min-width: 0; }
table.episodes { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
table.episodes th, table.episodes td { padding: 4px 7px; border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; }
table.episodes td.num, table.episodes th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.episodes tbody tr:hover { background: #eef4fb; }
th a.sorted { font-weight: 700; }
.failed { color: var(--bad); } .completed { color: var(--ok); }
nav.pager { margin: 10px 0; display: flex; gap: 12px; align-items: center; }
.count { margin: 6px 0; color: var(--muted); }
.error-box { background: #fdecea; border: 1px solid #f5c2bd; padding: 10px 14px; border-radius: 6px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; background: #fff;
  border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px; }
dl.facts dt { color: var(--muted); } dl.facts dd { margin: 0; }
section { margin-top: 16px; }
h2 { font-size: 15px; margin: 18px 0 6px; }
pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; font: 13px/1.45 ui-monospace, monospace; }
.box { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 8px 12px; }
ol.steps { list-style: none; padding: 0; margin: 0; }
li.step { background: #fff; border: 1px solid var(--line); border-radius: 6px; margin: 10px 0; padding: 8px 12px; }
li.step h3 { font-size: 14px; margin: 0 0 6px; }
li.step h3 .usage { color: var(--muted); font-weight: 400; margin-left: 8px; }
.observation { background: var(--bg); border-left: 3px solid #9fb3c8; padding: 4px 10px; max-height: 28em; overflow: auto; }
.label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; margin-top: 6px; }
.tools { margin-top: 6px; } .tools summary { cursor: pointer; }
#persona { max-height: 24em; overflow: auto; }
details.thinking summary { color: #6f42c1; cursor: pointer; }
details.thinking pre { color: #4b3a7a; }
.call { color: #0a5a70; } .valid { color: var(--ok); } .invalid { color: var(--bad); } .warn { color: var(--warn); }
table.detail { border-collapse: collapse; } table.detail td { padding: 2px 12px 2px 0; }
"""

FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    b'<rect width="16" height="16" rx="3" fill="#0b5cad"/><path d="M4 5h8M4 8h8M4 11h5" stroke="#fff" stroke-width="1.6"/></svg>'
)

SECURITY_HEADERS = {
    # No script of any kind, styles and the icon from this server only, forms submit here only.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _page(title: str, body: Html, header: Html, status: int = 200) -> HTMLResponse:
    document = h(
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{}</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/viewer.css"><link rel="icon" href="/favicon.svg" type="image/svg+xml">'
        "</head><body>{}<main>{}</main></body></html>",
        title,
        header,
        body,
    )
    # A lone surrogate a model server sent (kept exactly in the trace) is shown as its escape: the
    # page must be valid UTF-8.
    return HTMLResponse(escape_lone_surrogates(document), status_code=status, headers=SECURITY_HEADERS)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"
    return str(value)


class Viewer:
    """The pages of one run."""

    def __init__(self, run: Run, index: EpisodeIndex) -> None:
        self.run = run
        self.index = index
        identity = run.identity
        facts = [run.location, f"{run.kind} run", f"{len(index.frame)} episodes", f"read in {index.seconds:.1f} s"]
        for key in ("experiment", "checkpoint_id", "model"):
            if identity.get(key):
                facts.append(f"{key} {identity[key]}")
        if identity.get("plan_fingerprint"):
            facts.append(f"plan {str(identity['plan_fingerprint'])[:12]}")
        if run.unreadable_lines:
            facts.append(f"{run.unreadable_lines} unreadable lines skipped")
        uncommitted = [str(shard) for shard, state in run.shard_states.items() if state != "committed"]
        if uncommitted:
            facts.append(f"shards not read (not committed): {', '.join(uncommitted)}")
        self.header = h(
            '<header class="top"><h1><a href="/">shopsimrl view</a></h1><div class="meta">{}</div></header>', " · ".join(facts)
        )

    # -- the table --------------------------------------------------------------------------

    def table(self, request: Request) -> Response:
        try:
            query = Query.parse(request.query_params)
        except QueryError as exc:
            return self._error(400, str(exc))
        selected = self.index.select(query)
        pages = max(1, math.ceil(len(selected) / query.per_page))
        page = min(query.page, pages)
        rows = selected.iloc[(page - 1) * query.per_page : page * query.per_page]
        body = [self._filters(query)]
        body.append(
            h(
                '<p class="count" id="count">{} of {} episodes · page {} of {}</p>',
                len(selected),
                len(self.index.frame),
                page,
                pages,
            )
        )
        heads = []
        for name, title in COLUMNS:
            desc = query.sort == name and not query.desc
            arrow = (" ▼" if query.desc else " ▲") if query.sort == name else ""
            heads.append(
                h(
                    '<th class="{}"><a href="{}" class="{}" data-column="{}">{}{}</a></th>',
                    "num" if self._numeric(name) else "",
                    query.url(sort=name, desc=desc, page=1),
                    "sorted" if query.sort == name else "",
                    name,
                    title,
                    arrow,
                )
            )
        body.append(h('<table class="episodes" id="episodes"><thead><tr>{}</tr></thead><tbody>', join(heads)))
        for record in rows.to_dict("records"):
            cells = []
            for name, _ in COLUMNS:
                value = record[name]
                if name == "episode_id":
                    cells.append(h('<td><a href="{}">{}</a></td>', query.url(_episode_path(value), page=page), value))
                elif name == "status":
                    cells.append(h('<td class="{}">{}</td>', value, _fmt(value)))
                else:
                    digits = 0 if name.endswith(("_ms", "_ms_total")) else 3
                    cells.append(h('<td class="{}">{}</td>', "num" if self._numeric(name) else "", _fmt(value, digits)))
            body.append(h("<tr>{}</tr>", join(cells)))
        body.append(Html("</tbody></table>"))
        body.append(self._pager(query, page, pages))
        return _page("episodes · shopsimrl view", join(body), self.header)

    def _numeric(self, name: str) -> bool:
        return name not in ("episode_id", "category", "status", "termination_reason", "failure_class")

    def _filters(self, query: Query) -> Html:
        def select(name: str, label: str, options: list[tuple[str, str]]) -> Html:
            items = join(
                h('<option value="{}"{}>{}</option>', value, Html(" selected") if getattr(query, name) == value else "", text)
                for value, text in [("", "any"), *options]
            )
            return h('<label>{}<select name="{}">{}</select></label>', label, name, items)

        def number(name: str, label: str, step: str) -> Html:
            value = getattr(query, name)
            return h(
                '<label>{}<input class="num" type="number" step="{}" name="{}" value="{}"></label>',
                label,
                step,
                name,
                "" if value is None else _fmt(value, 6),
            )

        def select_rows(current: int) -> Html:
            sizes = sorted({25, PAGE_SIZE, 100, 200, current})
            items = join(
                h('<option value="{}"{}>{}</option>', size, Html(" selected") if size == current else "", size) for size in sizes
            )
            return h('<label>rows per page<select name="per_page">{}</select></label>', items)

        choices = self.index.choices
        parts = [
            select("status", "status", [(value, value) for value in choices["status"]]),
            select("success", "success", [("1", "1"), ("0", "0"), ("none", "not scored")]),
            number("reward_min", "reward ≥", "any"),
            number("reward_max", "reward ≤", "any"),
            select("termination_reason", "ending", [(value, value) for value in choices["termination_reason"]]),
            select("failure_class", "failure class", [(value, value) for value in choices["failure_class"]]),
            number("task_id", "task id", "1"),
            h(
                '<label>category contains<input type="text" name="category" value="{}" list="categories"></label>'
                '<datalist id="categories">{}</datalist>',
                query.category,
                join(h('<option value="{}">', value) for value in choices["category"]),
            ),
            select_rows(query.per_page),
            h('<input type="hidden" name="sort" value="{}">', query.sort),
        ]
        if query.desc:
            parts.append(Html('<input type="hidden" name="desc" value="1">'))
        parts.append(Html('<button type="submit" id="apply">Filter</button> <a href="/" id="reset">reset</a>'))
        return h('<form class="filters" method="get" action="/" id="filters">{}</form>', join(parts))

    def _pager(self, query: Query, page: int, pages: int) -> Html:
        links = []
        for label, target, rel in (
            (Html("&laquo; first"), 1, "first"),
            (Html("&lsaquo; previous"), page - 1, "prev"),
            (Html("next &rsaquo;"), page + 1, "next"),
            (Html("last &raquo;"), pages, "last"),
        ):
            if 1 <= target <= pages and target != page:
                links.append(h('<a href="{}" rel="{}" id="page-{}">{}</a>', query.url(page=target), rel, rel, label))
            else:
                links.append(h('<span class="disabled">{}</span>', label))
        return h('<nav class="pager">{}</nav>', join(links))

    # -- one episode --------------------------------------------------------------------------

    def episode(self, request: Request) -> Response:
        episode_id = request.path_params["episode_id"]
        try:
            query = Query.parse(request.query_params)
        except QueryError as exc:
            return self._error(400, str(exc))
        source = self.run.index().get(episode_id)
        if source is None:
            return self._error(404, f"{self.run.location} has no episode {episode_id!r}")
        try:
            record = self.run.record(episode_id)
        except (RunReadError, RecordVersionError) as exc:
            return self._error(409, str(exc))
        except StoreUnavailableError as exc:
            return self._error(503, f"the run's store did not answer: {exc}")
        transcript = read_transcript(record, source)
        order = self.index.select(replace(query, page=1))["episode_id"].tolist()
        position = order.index(episode_id) if episode_id in order else None
        back_page = query.page if position is None else position // query.per_page + 1
        nav = [h('<a href="{}" id="back">← episodes</a>', query.url(page=back_page))]
        if position is not None:
            if position > 0:
                nav.append(
                    h('<a href="{}" id="prev" rel="prev">&lsaquo; previous</a>', query.url(_episode_path(order[position - 1])))
                )
            if position + 1 < len(order):
                nav.append(
                    h('<a href="{}" id="next" rel="next">next &rsaquo;</a>', query.url(_episode_path(order[position + 1])))
                )
            nav.append(h("<span>{} of {} in the table</span>", position + 1, len(order)))
        body = h('<nav class="pager">{}</nav>{}', join(nav), _transcript_html(transcript))
        return _page(f"{episode_id} · shopsimrl view", body, self.header)

    def _error(self, status: int, message: str) -> HTMLResponse:
        body = h(
            '<div class="error-box" id="error"><strong>{}</strong> {}</div><p><a href="/">← episodes</a></p>', status, message
        )
        return _page(f"error {status} · shopsimrl view", body, self.header, status=status)


def _episode_path(episode_id: str) -> str:
    return f"/episodes/{quote(episode_id, safe='')}"


def _pre(text: Any, css: str = "") -> Html:
    return h('<pre class="{}">{}</pre>', css, text if isinstance(text, str) else outline(text))


def _transcript_html(transcript: Transcript) -> Html:
    row = transcript.row
    facts = [
        ("outcome", headline(transcript)),
        ("job", f"task {row['task_id']} · sample {row['sample_id']} · seed {row['seed']} · split {row['split']}"),
        ("model", transcript.model),
        ("category", row.get("category")),
        ("skills", ", ".join(transcript.skills) or None),
        ("duration", f"{row['duration_ms'] / 1000:.1f} s" if row.get("duration_ms") is not None else None),
        ("tokens", row.get("total_tokens")),
        ("started", row.get("started_at")),
    ]
    parts = [
        h('<h1 id="episode-id">{}</h1>', transcript.episode_id),
        h(
            '<dl class="facts">{}</dl>',
            join(h("<dt>{}</dt><dd>{}</dd>", name, value) for name, value in facts if value is not None),
        ),
        h(
            '<section><h2>Instruction</h2><div class="box" id="instruction">{}</div></section>',
            _pre(transcript.instruction or "(none recorded)"),
        ),
    ]
    if transcript.persona:
        parts.append(
            h(
                '<section><h2>Persona (public)</h2><div class="box" id="persona">{}</div></section>',
                _pre(outline(transcript.persona)),
            )
        )
    if transcript.system_prompt:
        parts.append(
            h(
                '<section><details class="box"><summary>System prompt ({} characters)</summary>{}</details></section>',
                len(transcript.system_prompt),
                _pre(transcript.system_prompt),
            )
        )
    steps = join(_step_html(step) for step in transcript.steps)
    parts.append(h('<section><h2>Steps</h2><ol class="steps" id="steps">{}</ol></section>', steps))
    parts.append(_end_html(transcript))
    return join(parts)


def _step_html(step: StepView) -> Html:
    parts = [
        h('<h3>step {} · {}<span class="usage">{}</span></h3>', step.index, step.page_type or "?", step_usage(step)),
        h(
            '<div class="label">observation (as sent to the model)</div><div class="observation">{}</div>',
            _pre(step.observation or ""),
        ),
    ]
    tools = ", ".join(step.tools) or "none"
    if step.click_values:
        parts.append(
            h(
                '<details class="tools"><summary><span class="label">tools offered</span> {} ({} click values)</summary>{}</details>',
                tools,
                len(step.click_values),
                _pre("\n".join(step.click_values)),
            )
        )
    else:
        parts.append(h('<div class="tools"><span class="label">tools offered</span> {}</div>', tools))
    if step.reasoning:
        parts.append(
            h(
                '<details class="thinking"><summary>thinking ({} characters)</summary>{}</details>',
                len(step.reasoning),
                _pre(step.reasoning),
            )
        )
    if step.content:
        parts.append(h('<div class="label">text</div>{}', _pre(step.content)))
    for call in step.tool_calls:
        parts.append(h('<div class="call"><strong>call</strong> {} <code>{}</code></div>', call.name, call.arguments))
    if step.protocol_error:
        parts.append(
            h(
                '<div class="warn"><strong>protocol error</strong> {}: {}</div>',
                step.protocol_error.code,
                step.protocol_error.message,
            )
        )
        if step.protocol_feedback:
            parts.append(h('<div class="label">sent back to the model</div>{}', _pre(step.protocol_feedback, "warn")))
    if step.policy_failure:
        parts.append(
            h(
                '<div class="invalid"><strong>policy failure</strong> {}: {}</div>',
                step.policy_failure.code,
                step.policy_failure.message,
            )
        )
    if step.action is not None:
        outcome = [h("<strong>action</strong> <code>{}</code>", step.action)]
        if step.feedback:
            valid = step.feedback.valid
            outcome.append(
                h(
                    ' → <span class="{}">{}</span> {}: {}',
                    "valid" if valid else "invalid",
                    "valid" if valid else "invalid" if valid is False else "?",
                    step.feedback.reason,
                    step.feedback.get("message"),
                )
            )
        if step.reward is not None:
            outcome.append(h(" · reward {}{}", _fmt(step.reward), " · done" if step.done else ""))
        parts.append(h('<div class="action">{}</div>', join(outcome)))
    if len(step.attempts) > 1 or any(attempt.error for attempt in step.attempts):
        rows = join(
            h(
                "<tr><td>{}</td><td>{}</td><td>{} ms</td><td>{}</td><td>backoff {} ms</td></tr>",
                attempt.attempt,
                attempt.status,
                _fmt(attempt.latency_ms, 0),
                attempt.error or "",
                _fmt(attempt.backoff_ms, 0),
            )
            for attempt in step.attempts
        )
        parts.append(h('<div class="label">HTTP attempts</div><table class="detail attempts">{}</table>', rows))
    if step.raw_response is not None:
        parts.append(h("<details><summary>raw response</summary>{}</details>", _pre(step.raw_response)))
    return h('<li class="step" id="step-{}">{}</li>', step.index, join(parts))


def _end_html(transcript: Transcript) -> Html:
    parts = [Html('<section id="end"><h2>End</h2>')]
    if transcript.error:
        error = transcript.error
        parts.append(
            h(
                '<div class="error-box"><strong>error at {}</strong> {}: {}</div>',
                error.stage,
                error.type,
                error.message,
            )
        )
        if error.traceback:
            parts.append(h("<details><summary>traceback</summary>{}</details>", _pre(error.traceback)))
    if transcript.reward_detail:
        rows = join(
            h("<tr><td>{}</td><td>{}</td></tr>", key, _fmt(value) if isinstance(value, float) else value)
            for key, value in transcript.reward_detail.items()
        )
        parts.append(h('<h2>Reward detail</h2><table class="detail" id="reward-detail">{}</table>', rows))
    for name, value in (("Goal", transcript.goal), ("Purchase", transcript.purchase)):
        if value:
            parts.append(h('<h2>{}</h2><div class="box">{}</div>', name, _pre(outline(value))))
    parts.append(Html("</section>"))
    return join(parts)


# --------------------------------------------------------------------------- the app


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
"""Host names every viewer answers to: only this machine reaches them."""


def _host_form(name: str) -> str:
    """A bind address or host name as a ``Host`` header names it: lower case, without a final
    dot, an IPv6 address in brackets."""
    name = name.strip().lower().rstrip(".")
    try:
        return f"[{ipaddress.IPv6Address(name.strip('[]'))}]"
    except ValueError:
        return name


def valid_host_name(name: str) -> bool:
    """Whether ``--allow-host NAME`` is a host name or an IP address, nothing more."""
    form = _host_form(name)
    return bool(form) and (form.startswith("[") or re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", form) is not None)


def allowed_hosts(host: str, extra: Sequence[str] = ()) -> list[str]:
    """The ``Host`` names the viewer answers to: the local names, the address it is bound to and
    the names given with ``--allow-host``. On every bind, 0.0.0.0 too: a page elsewhere that
    rebinds its DNS name to this machine names its own host and is refused."""
    return sorted({*LOCAL_NAMES, _host_form(host), *(_host_form(name) for name in extra)})


def _request_host(value: str) -> str | None:
    """The host part of a ``Host`` header (port dropped), in :func:`_host_form`; None when it is
    malformed."""
    value = value.strip()
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        return _host_form(inside)
    name, _, port = value.partition(":")
    if not name or (port and not port.isascii()) or (port and not port.isdigit()):
        return None
    return _host_form(name)


MAX_HEAD_BYTES = 64 * 1024
"""The most bytes of a request line and headers (browsers send a few KB; cookies of other local
services included). A larger head is answered 431 and the connection closed."""
MAX_BODY_BYTES = 64 * 1024
"""The most bytes of a request body (the viewer reads none: only GET is served). Larger: 413."""
HEAD_TIMEOUT_S = 10.0
"""Seconds from a connection's opening, or from the first byte of its next request, to the end
of the request's head; then 408 (or, when nothing was sent, the connection is closed)."""
BODY_TIMEOUT_S = 10.0
"""Seconds a request body may pause between two of its pieces before the request gets 408."""


def _refusal(status: int, message: str) -> Response:
    return Response(
        message + "\n",
        status_code=status,
        media_type="text/plain",
        headers={**SECURITY_HEADERS, "Connection": "close"},
    )


class _Guard:
    """The checks before any page: the ``Host`` header is one of :func:`allowed_hosts` (400
    otherwise), and a body is bounded in size (413) and time (408), its connection closed after
    the answer. (The head's bounds are the protocol's: :class:`_BoundedH11Protocol`.)"""

    def __init__(self, app: Any, allowed: list[str]) -> None:
        self.app = app
        self.allowed = frozenset(allowed)
        self.names = ", ".join(allowed)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope["headers"]}
        raw_host = headers.get(b"host", b"").decode("latin-1")
        host = _request_host(raw_host)
        if host is None or host not in self.allowed:
            shown = _shown(raw_host)
            message = (
                f"Host {shown} is not a name this viewer answers to ({self.names}); "
                "start it with --allow-host NAME to serve another name"
            )
            await _refusal(400, message)(scope, receive, send)
            return
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if length and (not length.isdigit() or len(length) > MAX_DIGITS or int(length) > MAX_BODY_BYTES):
            await _refusal(413, f"a request body of {_shown(length)} bytes; the viewer takes at most {MAX_BODY_BYTES}")(
                scope, receive, send
            )
            return
        if length not in ("", "0") or b"transfer-encoding" in headers:
            body = await self._body(scope, receive, send)
            if body is None:
                return
            receive = _replay(body)
        await self.app(scope, receive, send)

    async def _body(self, scope: Any, receive: Any, send: Any) -> bytes | None:
        """The request's body, read within the bounds; None once it was refused."""
        pieces: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except TimeoutError:
                await _refusal(408, f"the request body paused for more than {BODY_TIMEOUT_S:.0f} s")(scope, receive, send)
                return None
            if message["type"] != "http.request":
                return None  # the client went away
            piece = message.get("body", b"")
            size += len(piece)
            if size > MAX_BODY_BYTES:
                await _refusal(413, f"a request body of more than {MAX_BODY_BYTES} bytes; the viewer takes at most that")(
                    scope, receive, send
                )
                return None
            pieces.append(piece)
            if not message.get("more_body", False):
                return b"".join(pieces)


def _replay(body: bytes) -> Callable[[], Any]:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # as a server does: nothing more until the client leaves
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


_HEAD_END = re.compile(rb"\r?\n\r?\n")


BACKLOG = 128
"""Connections the kernel queues for the viewer (a browser opens a few at once)."""
LINGER_S = 2.0
"""How long a closed connection still reads (and drops) what its client sends."""
LINGER_BYTES = 1024 * 1024
"""How much it drops before it gives up on the client and resets the connection."""


class _LingeringTransport:
    """The connection as uvicorn's protocol sees it, closed the lingering way: what is queued is
    sent, the sending side ended, and the client's further bytes read and dropped until it closes
    (at most :data:`LINGER_S`, :data:`LINGER_BYTES`). A socket closed with unread bytes (the
    rest of a refused head or body) would reset the connection and lose the answer in flight."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self.lingering = False
        self._dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        try:
            self._transport.write_eof()
            self._transport.resume_reading()  # read on to drop, even where flow control paused it
        except (OSError, RuntimeError, NotImplementedError):
            self._transport.close()
            return
        self._timer = self._loop.call_later(LINGER_S, self._transport.close)

    def drop(self, data: bytes) -> None:
        self._dropped += len(data)
        if self._dropped > LINGER_BYTES:
            self._transport.close()

    def lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport.close()


class _BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the request head bounded: at most :data:`MAX_HEAD_BYTES`
    (431) within :data:`HEAD_TIMEOUT_S` (408), each answered and the connection closed, so one
    client sending a huge or endless head holds neither memory nor the event loop. A head h11
    cannot take apart is answered 400 here too. Every close lingers (:class:`_LingeringTransport`),
    so that a refused client reads its answer."""

    _head_timer: asyncio.TimerHandle | None = None
    _refused = False
    _lingering: _LingeringTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._lingering = _LingeringTransport(self.transport, self.loop)
        self.transport = self._lingering  # type: ignore[assignment]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._lingering is not None:
            self._lingering.lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None and self._lingering.lingering:
            self._lingering.drop(data)
            return
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:
            pending = self.conn.trailing_data[0] + data
            end = _HEAD_END.search(pending)
            if (end.end() if end else len(pending)) > MAX_HEAD_BYTES:
                self._refuse(431, f"the request's head is larger than {MAX_HEAD_BYTES} bytes")
                return
        try:
            super().data_received(data)
        except (ValueError, UnicodeError) as exc:  # a target that is not ASCII, …
            self._refuse(400, f"a malformed request ({type(exc).__name__})")
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_head_timer()  # a head has begun: its deadline runs from its first byte
        elif self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            self._refuse(408, f"the request's head did not arrive within {HEAD_TIMEOUT_S:.0f} s")
        else:
            self.transport.close()  # a connection opened and left idle: nothing to answer

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` outside h11 (no request was parsed to answer) and close."""
        self._refused = True
        self._cancel_head_timer()
        body = (message + "\n").encode("utf-8")
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def create_app(run: Run, index: EpisodeIndex, *, host: str = "127.0.0.1", allow_hosts: Sequence[str] = ()) -> Any:
    """The viewer's ASGI app. Requests must name one of :func:`allowed_hosts` in their ``Host``
    header, whatever the bind: a page elsewhere that rebinds its DNS name to this machine gets 400."""
    viewer = Viewer(run, index)

    def css(request: Request) -> Response:
        return Response(CSS, media_type="text/css", headers=SECURITY_HEADERS)

    def icon(request: Request) -> Response:
        return Response(FAVICON, media_type="image/svg+xml", headers=SECURITY_HEADERS)

    routes = [
        Route("/", viewer.table, methods=["GET"]),
        Route("/episodes/{episode_id:path}", viewer.episode, methods=["GET"]),
        Route("/static/viewer.css", css, methods=["GET"]),
        Route("/favicon.svg", icon, methods=["GET"]),
        Route("/favicon.ico", icon, methods=["GET"]),
    ]
    return _Guard(Starlette(routes=routes), allowed_hosts(host, allow_hosts))


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (port 0: a free one), bound before the run is
    read so that a taken port fails at once. Raises :class:`ViewerError`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ViewerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(
    run: Run, sock: socket.socket, *, announce: Callable[[str], None], host: str | None = None, allow_hosts: Sequence[str] = ()
) -> None:
    """Read the run, then serve it on ``sock`` until SIGINT/SIGTERM (then return). ``host``: the
    address as given to bind (default: the socket's); ``allow_hosts``: more names to answer to."""
    index = EpisodeIndex.build(run)
    bound, port = sock.getsockname()[:2]
    host = host or bound
    announce(f"read {len(index.frame)} episodes of {run.location} in {index.seconds:.1f} s")
    names = allowed_hosts(host, allow_hosts)
    if not _loopback(bound):
        announce(f"warning: {bound} is reachable from other machines and the viewer has no authentication")
        announce(f"answering requests for the host names {', '.join(names)} only (more: --allow-host NAME)")
    shown = f"[{bound}]" if ":" in bound else bound
    sock.listen(BACKLOG)  # connections from now on wait for the server instead of being refused
    announce(f"viewer at http://{shown}:{port}/ (read-only; Ctrl-C stops it)")
    config = uvicorn.Config(
        create_app(run, index, host=host, allow_hosts=allow_hosts),
        http=_BoundedH11Protocol,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        log_level="warning",
        access_log=False,
        lifespan="off",
        proxy_headers=False,
        backlog=BACKLOG,
    )
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM while it serves and raises the signal again once it has shut
    # down; ignored then, so that a viewer stopped on purpose ends normally.
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
