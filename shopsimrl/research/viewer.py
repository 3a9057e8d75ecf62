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

import html
import ipaddress
import math
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import quote, urlencode

import pandas as pd  # type: ignore[import-untyped]  # no type information (pandas-stubs is not a dependency)
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from shopsimrl.research.runs import Run, RunReadError
from shopsimrl.research.tables import episodes_table, to_frame
from shopsimrl.research.transcript import StepView, Transcript, headline, outline, read_transcript, step_usage
from shopsimrl.schemas import escape_lone_surrogates
from shopsimrl.sharded.objectstore import StoreUnavailableError

__all__ = [
    "MAX_PAGE_SIZE",
    "PAGE_SIZE",
    "EpisodeIndex",
    "Query",
    "QueryError",
    "ViewerError",
    "bind",
    "create_app",
    "esc",
    "h",
    "serve",
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
            raise QueryError(f"success: {success!r} is not one of 1, 0, none")
        values["success"] = success
        for name in ("reward_min", "reward_max"):
            text = params.get(name, "").strip()
            if text:
                try:
                    values[name] = float(text)
                except ValueError:
                    raise QueryError(f"{name}: {text!r} is not a number") from None
                if not math.isfinite(values[name]):
                    raise QueryError(f"{name}: {text!r} is not a finite number")
        task = params.get("task_id", "").strip()
        if task:
            if not task.isdigit():
                raise QueryError(f"task_id: {task!r} is not a task number")
            values["task_id"] = int(task)
        sort = params.get("sort", "episode_id")
        if sort not in SORTABLE:
            raise QueryError(f"sort: {sort!r} is not a column of the table")
        values["sort"] = sort
        values["desc"] = params.get("desc", "") == "1"
        page = params.get("page", "1").strip()
        if not page.isdigit() or int(page) < 1:
            raise QueryError(f"page: {page!r} is not a page number")
        values["page"] = int(page)
        per_page = params.get("per_page", str(PAGE_SIZE)).strip()
        if not per_page.isdigit() or not 1 <= int(per_page) <= MAX_PAGE_SIZE:
            raise QueryError(f"per_page: {per_page!r} is not a number of rows from 1 to {MAX_PAGE_SIZE}")
        values["per_page"] = int(per_page)
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
        except RunReadError as exc:
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
                step.protocol_error.get("code"),
                step.protocol_error.get("message"),
            )
        )
        if step.protocol_feedback:
            parts.append(h('<div class="label">sent back to the model</div>{}', _pre(step.protocol_feedback, "warn")))
    if step.policy_failure:
        parts.append(
            h(
                '<div class="invalid"><strong>policy failure</strong> {}: {}</div>',
                step.policy_failure.get("code"),
                step.policy_failure.get("message"),
            )
        )
    if step.action is not None:
        outcome = [h("<strong>action</strong> <code>{}</code>", step.action)]
        if step.feedback:
            valid = step.feedback.get("valid")
            outcome.append(
                h(
                    ' → <span class="{}">{}</span> {}: {}',
                    "valid" if valid else "invalid",
                    "valid" if valid else "invalid" if valid is False else "?",
                    step.feedback.get("reason"),
                    step.feedback.get("message"),
                )
            )
        if step.reward is not None:
            outcome.append(h(" · reward {}{}", _fmt(step.reward), " · done" if step.done else ""))
        parts.append(h('<div class="action">{}</div>', join(outcome)))
    if len(step.attempts) > 1 or any(attempt.get("error") for attempt in step.attempts):
        rows = join(
            h(
                "<tr><td>{}</td><td>{}</td><td>{} ms</td><td>{}</td><td>backoff {} ms</td></tr>",
                attempt.get("attempt"),
                attempt.get("status"),
                _fmt(attempt.get("latency_ms"), 0),
                attempt.get("error") or "",
                _fmt(attempt.get("backoff_ms"), 0),
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
                error.get("stage"),
                error.get("type"),
                error.get("message"),
            )
        )
        if error.get("traceback"):
            parts.append(h("<details><summary>traceback</summary>{}</details>", _pre(error["traceback"])))
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


def create_app(run: Run, index: EpisodeIndex, *, host: str = "127.0.0.1") -> Starlette:
    """The viewer's ASGI app. Requests must name the host it was bound to (or, on loopback,
    ``localhost``/``127.0.0.1``): a page elsewhere that rebinds its DNS name to 127.0.0.1 gets 400."""
    viewer = Viewer(run, index)
    allowed = (
        ["*"]
        if host in ("0.0.0.0", "::", "")
        else sorted({host, *(("localhost", "127.0.0.1", "::1") if _loopback(host) else ())})
    )

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
    return Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed)])


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


def serve(run: Run, sock: socket.socket, *, announce: Callable[[str], None]) -> None:
    """Read the run, then serve it on ``sock`` until SIGINT/SIGTERM (then return)."""
    index = EpisodeIndex.build(run)
    host, port = sock.getsockname()[:2]
    announce(f"read {len(index.frame)} episodes of {run.location} in {index.seconds:.1f} s")
    shown = f"[{host}]" if ":" in host else host
    announce(f"viewer at http://{shown}:{port}/ (read-only; Ctrl-C stops it)")
    if not _loopback(host):
        announce(f"warning: {host} is reachable from other machines and the viewer has no authentication")
    server = uvicorn.Server(
        uvicorn.Config(create_app(run, index, host=host), log_level="warning", access_log=False, lifespan="off")
    )
    # uvicorn handles SIGINT/SIGTERM while it serves and raises the signal again once it has shut
    # down; ignored then, so that a viewer stopped on purpose ends normally.
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
