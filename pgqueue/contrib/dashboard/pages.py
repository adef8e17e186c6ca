"""The dashboard's pages: HTML written here, on the server, from what ``store`` read.

Every value goes through ``e`` (HTML-escaped); links are relative to the ``<base>`` of the
page, itself relative (``./`` or ``../``), so the dashboard works under any path a proxy or
a mount serves it from. The live parts of a page are fragments (``fragment/...``) that
``dashboard.js`` fetches again every few seconds and swaps in; the lease bars shrink in the
browser between two fetches, from the seconds left that the database's clock gave.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from .filters import ACTIONS, STATUSES, Filter

HIDDEN = '<span class="muted">hidden (--hide-payload)</span>'


def e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def page(
    title: str, body: str, *, base: str, read_only: bool, live: str | None = None, head: str = ""
) -> str:
    """A whole page: ``head``, then ``body``, which the fragment ``live`` (if any) replaces
    every few seconds."""
    mode = (
        '<span class="tag">read-only</span>'
        if read_only
        else '<span id="token-state" class="tag">actions need the token</span>'
    )
    fragment = f' data-fragment="{e(live)}"' if live else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<base href="{e(base)}">
<title>{e(title)} · pgqueue</title>
<link rel="stylesheet" href="static/dashboard.css">
<script src="static/dashboard.js" defer></script>
</head><body data-read-only="{int(read_only)}">
<header><strong>pgqueue</strong> <a href="./">Overview</a> <a href="jobs">Jobs</a>
<span class="grow"></span>{mode}</header>
<div id="said" role="status"></div>
<main>{head}<div id="live"{fragment}>{body}</div></main>
</body></html>"""


def when(value: str | None) -> str:
    """A time from the database as UTC, to the second (the full value in a tooltip)."""
    if not value:
        return ""
    t = datetime.fromisoformat(value).astimezone(timezone.utc)
    return f'<time datetime="{e(value)}" title="{e(value)}">{t:%Y-%m-%d %H:%M:%S}</time>'


def seconds(value: float | None) -> str:
    if value is None:
        return ""
    value = float(value)
    if abs(value) < 120:
        return f"{value:.1f} s"
    if abs(value) < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def button(action: str, label: str, read_only: bool, confirm: str | None = None) -> str:
    if read_only:
        return ""
    ask = f' data-confirm="{e(confirm)}"' if confirm else ""
    return f'<button type="button" data-action="{e(action)}"{ask}>{e(label)}</button>'


def table(head: Sequence[str], rows: Iterable[str], empty: str) -> str:
    body = "".join(rows)
    if not body:
        return f'<p class="muted">{e(empty)}</p>'
    cells = "".join(f"<th>{e(h)}</th>" for h in head)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


# -- the overview --------------------------------------------------------------------------
def overview(data: dict[str, Any], read_only: bool) -> str:
    """The overview's fragment: attention, queues, history, lease bars, schedules, limits."""
    return "".join(
        (
            _attention(data),
            _queues(data, read_only),
            _history(data),
            _running(data),
            _schedules(data, read_only),
            _limits(data),
        )
    )


def _attention(data: dict[str, Any]) -> str:
    items = [
        f'<li><a href="jobs?{e(urlencode({"queue": q["queue"]}))}">{e(q["queue"])}</a>: '
        f"{e(why)}</li>"
        for q in data["queues"]
        for why in q["attention"]
    ]
    items += [
        f"<li>schedule {e(s['name'])}: {e(s['attention'])}</li>" for s in data["late_schedules"]
    ]
    said = f'<ul class="warn">{"".join(items)}</ul>' if items else '<p class="ok">nothing</p>'
    return f'<section id="attention"><h2>Needs attention</h2>{said}</section>'


def _queues(data: dict[str, Any], read_only: bool) -> str:
    rows = []
    for q in data["queues"]:
        link = f"jobs?{e(urlencode({'queue': q['queue']}))}"
        rate = q["finished_per_s"]
        where = f"api/queues/{quote(q['queue'], safe='')}"
        if q["paused_since"] is not None:
            state = '<span class="bad">paused</span> ' + button(
                f"{where}/resume", "resume", read_only
            )
        else:
            ask = f"Pause {q['queue']}? No worker claims from it until it is resumed."
            state = "claimed " + button(f"{where}/pause", "pause", read_only, confirm=ask)
        rows.append(
            f'<tr data-queue="{e(q["queue"])}"><td><a href="{link}">{e(q["queue"])}</a></td>'
            f'<td class="state">{state}</td>'
            f'<td class="n">{q["ready"]}</td><td class="n">{q["running"]}</td>'
            f'<td class="n{" bad" if q["dead"] else ""}">{q["dead"]}</td>'
            f'<td class="n">{seconds(q["oldest_ready_s"])}</td>'
            f'<td class="n">{"" if rate is None else f"{rate:.2f}"}</td>'
            f'<td class="err">{e((q["latest_error"] or "")[:120])}</td></tr>'
        )
    estimate = data["finished_estimate"]
    finished = "unknown until the table is analyzed" if estimate is None else f"about {estimate:,}"
    return (
        '<section id="queues"><h2>Queues</h2>'
        + table(
            [
                "queue",
                "claims",
                "ready",
                "running",
                "dead",
                "oldest ready",
                "finished/s",
                "latest error",
            ],
            rows,
            "no job is ready, running or dead",
        )
        + f'<p class="muted">Finished (done and cancelled), all queues: {e(finished)} '
        '(the planner\'s estimate; <a href="api/queues?exact=1">count them exactly</a> reads '
        "the whole table). finished/s: over this dashboard's looks, the last "
        f"{_span(data['history'])}.</p></section>"
    )


def _span(history: list[dict[str, Any]]) -> str:
    return seconds(history[0]["ago"]) if history else "0 s"


def _history(data: dict[str, Any]) -> str:
    """Throughput and the oldest ready job's wait over the looks kept, per queue, as two
    small SVG lines each (drawn here: no chart library)."""
    history = data["history"]
    if len(history) < 2:
        return (
            '<section id="history"><h2>Throughput and wait</h2><p class="muted">'
            "from the second look on (one every few seconds while a page is open)</p></section>"
        )
    rows = []
    for q in data["queues"]:
        name = q["queue"]
        rates = [
            (h["ago"], h["finished"].get(name, 0) / h["seconds"] if h["seconds"] else 0.0)
            for h in history[1:]
        ]
        waits = [(h["ago"], h["oldest_ready_s"].get(name, 0.0)) for h in history]
        rows.append(
            f"<tr><td>{e(name)}</td><td>{_line(rates, 'jobs/s')}</td>"
            f"<td>{_line(waits, 's')}</td></tr>"
        )
    return (
        '<section id="history"><h2>Throughput and wait</h2>'
        + table(
            ["queue", f"finished per second, last {_span(history)}", "oldest ready job's wait"],
            rows,
            "no queue",
        )
        + "</section>"
    )


def _line(points: list[tuple[float, float]], unit: str) -> str:
    """A line of ``points`` (seconds ago, value), scaled to its largest value, with it and
    the latest value in words (no line for fewer than two points)."""
    width, height = 240, 36
    most = max(p[1] for p in points)
    words = f'<span class="muted"> max {most:.2f} {e(unit)}, now {points[-1][1]:.2f}</span>'
    if len(points) < 2:
        return words
    span = max(p[0] for p in points) or 1.0
    top = most or 1.0  # all zero: a flat line along the bottom
    xy = " ".join(
        f"{width * (1 - ago / span):.1f},{height - 2 - (height - 4) * v / top:.1f}"
        for ago, v in points
    )
    return (
        f'<svg class="spark" width="{width}" height="{height}" role="img" '
        f'aria-label="max {most:.2f} {e(unit)}"><polyline points="{xy}"/></svg>' + words
    )


def lease_bar(job_id: int, fence: int, left: float | None) -> str:
    """A lease bar: full width is the most lease left the page has seen for this claim;
    ``dashboard.js`` shrinks it from ``left`` (the database's clock) as time passes."""
    if left is None:
        return ""
    return (
        f'<div class="lease" data-claim="{job_id}:{fence}" data-left="{left:.3f}">'
        f'<div class="fill"></div><span class="left">{_left_words(left)}</span></div>'
    )


def _left_words(left: float) -> str:
    return f"{left:.1f} s left" if left >= 0 else f"ran out {-left:.1f} s ago"


def _running(data: dict[str, Any]) -> str:
    rows = []
    for r in data["running"]:
        seat = f"{e(r['group'])} seat {r['seat']}" if r["seat"] is not None else ""
        rows.append(
            f'<tr class="running" data-id="{r["id"]}"><td><a href="jobs/{r["id"]}">#{r["id"]}</a>'
            f"</td><td>{e(r['queue'])}</td>"
            f'<td class="fence">fence {r["fence"]}</td>'
            f'<td class="n">{r["attempts"]} of {r["max_attempts"]}</td>'
            f"<td>{lease_bar(r['id'], r['fence'], r['left_s'])}</td>"
            f'<td class="n">{seconds(r["running_s"])}</td>'
            f'<td class="n">{seconds(r["waited_s"])}</td><td>{seat}</td></tr>'
        )
    shown = data["running_shown"]
    return (
        '<section id="running"><h2>Running jobs and their leases</h2>'
        + table(
            ["job", "queue", "fence", "attempt", "lease", "running for", "waited", "limit seat"],
            rows,
            "no job is running",
        )
        + f'<p class="muted">The {shown} whose leases end first. A bar runs out at the '
        "lease's end by the database's clock; red: the lease ran out and the reaper may give "
        "the job to another worker under the next fence, which refuses this holder's writes. "
        "pgqueue records no holder name and no count of refused late writes in the table "
        "(the worker's metrics count those: pgqueue_late_writes_refused_total).</p></section>"
    )


def _schedules(data: dict[str, Any], read_only: bool) -> str:
    rows = []
    for s in data["schedules"]:
        late = s["late_s"]
        due = (
            ""
            if late is None
            else (f"in {seconds(-late)}" if late <= 0 else f"{seconds(late)} ago")
        )
        rows.append(
            f"<tr><td>{e(s['name'])}</td><td>{e(s['spec'])}</td><td>{e(s['queue'])}</td>"
            f'<td>{when(s["last_slot"])}</td><td>{when(s["next_slot"])} <span class="muted">'
            f"{due}</span></td><td>"
            + button(
                f"api/schedules/{quote(s['name'], safe='')}/run",
                "run now",
                read_only,
                f"Make a job of {s['name']} now (one job for this second's slot)?",
            )
            + "</td></tr>"
        )
    return (
        '<section id="schedules"><h2>Periodic schedules</h2>'
        + table(["schedule", "when", "queue", "last slot", "next slot", ""], rows, "none")
        + "</section>"
    )


def _limits(data: dict[str, Any]) -> str:
    rows = []
    for lim in data["limits"]:
        holders = ", ".join(
            f'{e(h["group"])} seat {h["seat"]}: <a href="jobs/{h["id"]}">#{h["id"]}</a> '
            f"fence {h['fence']}"
            for h in lim["holders"]
        )
        rows.append(
            f'<tr><td>{e(lim["queue"])}</td><td class="n">{lim["per_group"]}</td>'
            f'<td class="n">{lim["running"]}</td><td>{holders or "none"}</td></tr>'
        )
    return (
        '<section id="limits"><h2>Per-group limits</h2>'
        + table(["queue", "per group", "running under it", "seat holders"], rows, "none")
        + "</section>"
    )


# -- the jobs list -------------------------------------------------------------------------
def jobs_head(chosen: Filter, queues: list[str], read_only: bool) -> str:
    """The jobs page's filter form and bulk buttons (they stay while the list refreshes)."""
    options = "".join(
        f'<option value="{s}"{" selected" if chosen.status == s else ""}>{s}</option>'
        for s in ("", *STATUSES)
    )
    known = "".join(f'<option value="{e(q)}">' for q in queues)
    form = (
        '<form class="filter" method="get" action="jobs">'
        f'<label>queue <input name="queue" list="queues" value="{e(chosen.queue)}"></label>'
        f'<datalist id="queues">{known}</datalist>'
        f'<label>status <select name="status">{options}</select></label>'
        f'<label>key <input name="key" value="{e(chosen.key)}"></label>'
        f'<label>text <input name="q" value="{e(chosen.text)}" '
        'placeholder="in payload or error"></label>'
        '<button type="submit">filter</button> <a href="jobs">clear</a></form>'
    )
    query = urlencode(chosen.query())
    what = "every job" if chosen.empty else f"every job matching {query}"
    bulk = "".join(
        button(
            f"api/bulk/{name}?{query}",
            f"{name} all matching ({'/'.join(statuses)})",
            read_only,
            f"{name.capitalize()} {what} that is {' or '.join(statuses)}?",
        )
        for name, statuses in ACTIONS.items()
        if chosen.status is None or chosen.status in statuses
    )
    return "<h1>Jobs</h1>" + form + (f'<p class="bulk">{bulk}</p>' if bulk else "")


def jobs(chosen: Filter, found: list[dict[str, Any]], more: bool) -> str:
    """The jobs page's list: one page of jobs and the link to the next."""
    rows = [
        f'<tr data-id="{j["id"]}"><td><a href="jobs/{j["id"]}">#{j["id"]}</a></td>'
        f'<td>{e(j["queue"])}</td><td class="status {e(j["status"])}">{e(j["status"])}</td>'
        f'<td class="n">{j["attempts"]}/{j["max_attempts"]}</td><td class="n">{j["fence"]}</td>'
        f"<td>{e(j['key'])}</td><td>{when(j['finished_at'] or j['run_at'])}</td>"
        f'<td class="payload">{HIDDEN if j["payload"] is None else e(j["payload"])}</td>'
        f'<td class="err">{e(j["last_error"])}</td></tr>'
        for j in found
    ]
    older = ""
    if more and found:
        after = urlencode(chosen.query() | {"before": found[-1]["id"]})
        older = f'<p><a rel="next" href="jobs?{e(after)}">older jobs</a></p>'
    return (
        table(
            [
                "job",
                "queue",
                "status",
                "attempts",
                "fence",
                "key",
                "run at / finished",
                "payload",
                "last error",
            ],
            rows,
            "no job matches",
        )
        + older
    )


# -- one job -------------------------------------------------------------------------------
def job(j: dict[str, Any], read_only: bool, hidden: bool) -> str:
    """One job's fragment: its state, lease, payload, result, error, steps, actions."""
    actions = "".join(
        button(
            f"api/jobs/{j['id']}/{name}",
            name,
            read_only,
            f"Delete job {j['id']} for good?" if name == "delete" else None,
        )
        for name, statuses in ACTIONS.items()
        if j["status"] in statuses
    )
    fields = [
        ("status", f'<span class="status {e(j["status"])}">{e(j["status"])}</span>'),
        ("queue", e(j["queue"])),
        ("fence", f'<span class="fence">{j["fence"]}</span>'),
        ("attempts", f"{j['attempts']} of {j['max_attempts']}"),
        ("priority", e(j["priority"])),
        ("key", e(j["key"])),
        ("group", e(j["group_key"])),
        ("run at", when(j["run_at"])),
        ("started", when(j["started_at"])),
        ("finished", when(j["finished_at"])),
        ("lease until", when(j["lease_until"])),
    ]
    if "left_s" in j:
        fields.append(("lease", lease_bar(j["id"], j["fence"], j["left_s"])))
    rows = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in fields)
    steps = [
        f'<tr><td>{e(s["name"])}</td><td class="n">{s["fence"]}</td>'
        f"<td>{when(s['written_at'])}</td>"
        f"<td>{_block(s['output'], hidden)}</td></tr>"
        for s in j["steps"]
    ]
    return (
        f'<h1>Job #{j["id"]}</h1><p class="actions">{actions}</p>'
        f'<table class="fields">{rows}</table>'
        f"<h2>Payload</h2>{_block(j['payload'], hidden)}"
        f"<h2>Result</h2>{_result(j, hidden)}"
        f'<h2>Last error</h2><pre class="err">{e(j["last_error"] or "none")}</pre>'
        + (
            f'<h2>Traceback</h2><pre class="err">{e(j["traceback"])}</pre>'
            if j.get("traceback")
            else ""
        )
        + "<h2>Durable steps</h2>"
        + table(["step", "fence", "written", "output"], steps, "none stored")
    )


def _block(value: Any, hidden: bool) -> str:
    return HIDDEN if hidden else f"<pre>{e(_json(value))}</pre>"


def _result(j: dict[str, Any], hidden: bool) -> str:
    if j["status"] != "done":
        return '<p class="muted">none: the job is not done</p>'
    return _block(j["result"], hidden)


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def error(status: int, message: str) -> str:
    return f'<h1>{status}</h1><p class="err">{e(message)}</p><p><a href="./">overview</a></p>'
