"""HTML for ``cas ui``'s views: each page renders the dict ``cas.ui.views`` built for it.

Everything from the store (ref names, metadata, metric names, history events) is untrusted and
goes through ``escape`` on its way into markup or into a link's query string; pages carry no
script, and the server forbids scripts by policy besides.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

from cas.ui.charts import metric_charts
from cas.units import format_size

NAV = (("/", "Runs"), ("/storage", "Storage"), ("/retention", "Retention"), ("/pools", "Pools"))


def link(path: str, text: str, **params: Any) -> str:
    """An escaped ``<a>`` to ``path`` with query ``params``."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    href = f"{path}?{query}" if query else path
    return f'<a href="{escape(href)}">{escape(text)}</a>'


def ref_link(ref: str) -> str:
    """A link to a checkpoint's page."""
    return link("/checkpoint", ref, ref=ref)


def when(seconds: float | None) -> str:
    """A UTC time, or an em dash."""
    if not seconds:
        return "\u2014"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def size(n: int | None) -> str:
    """Bytes for a person (``1.2 GiB``)."""
    return "\u2014" if n is None else format_size(int(n))


def metrics_text(metrics: Any) -> str:
    """``loss=0.31, acc=0.9``."""
    if not isinstance(metrics, dict):
        return ""
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table whose cells are already markup (escape what goes in)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def pager(path: str, data: dict[str, Any], **params: Any) -> str:
    """Previous / next links when a listing has more than one page."""
    page, pages = data.get("page", 1), data.get("pages", 1)
    if pages <= 1:
        return ""
    parts = [f"page {page} of {pages} ({data.get('total', 0)} in all)"]
    if page > 1:
        parts.insert(0, link(path, "\u2190 previous", page=page - 1, **params))
    if page < pages:
        parts.append(link(path, "next \u2192", page=page + 1, **params))
    return f'<nav class="pager">{" ".join(parts)}</nav>'


def document(title: str, store: str, body: str, active: str = "") -> str:
    """The whole page: head, the navigation bar, the body."""
    nav = "".join(
        f'<a href="{path}"{" class=active" if path == active else ""}>{name}</a>'
        for path, name in NAV
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)} \u2014 cas ui</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/style.css"><link rel="icon" href="data:,">'
        f'</head><body><header><span class="brand">cas</span>{nav}'
        f'<span class="store">{escape(store)} \u00b7 read-only</span></header>'
        f"<main><h1>{escape(title)}</h1>{body}</main></body></html>"
    )


def runs_page(data: dict[str, Any]) -> str:
    """The list of runs."""
    rows = []
    remotes = data.get("remotes", {})
    for run in data["runs"]:
        latest = run.get("latest") or {}
        tiers = [
            f'<span class="tier {escape(state)}">{escape(state)}</span>'
            for state in (run["tiers"].get(name, "") for name in remotes)
        ]
        rows.append(
            [
                link("/run", run["run"], name=run["run"]),
                f'<span class="state {escape(run["status"])}">{escape(run["status"])}</span>',
                escape(str(latest.get("step", "\u2014"))),
                escape(metrics_text(latest.get("metrics"))),
                str(run["checkpoints"]),
                str(run["gates"]),
                escape(when(latest.get("created_at"))),
                *tiers,
            ]
        )
    if not rows:
        return '<p class="empty">No runs: no <code>.../latest</code> or <code>.../history</code> ref.</p>'
    return (
        f"<p>{data['total']} runs, {data['refs']} refs.</p>"
        + _remotes_line(remotes)
        + table(
            ["run", "status", "step", "latest metrics", "checkpoints", "gates", "latest saved"]
            + [f"latest on {name}" for name in remotes],
            rows,
            "runs",
        )
        + pager("/", data)
    )


def _remotes_line(remotes: dict[str, Any]) -> str:
    """The remote tiers the store names, and any that could not be read."""
    if not remotes:
        return ""
    parts = []
    for name, tier in remotes.items():
        text = f"{escape(name)} ({escape(tier['url'])})"
        if tier.get("error"):
            text += f' <span class="bad">cannot be read: {escape(tier["error"])}</span>'
        parts.append(text)
    return "<p>Remote tiers: " + "; ".join(parts) + _as_of(next(iter(remotes.values()))) + "</p>"


def run_page(data: dict[str, Any]) -> str:
    """One run: the chart, its pointers, its checkpoints and restarts."""
    parts = [
        f'<p>Status: <span class="state {escape(data["status"])}">{escape(data["status"])}</span></p>',
        '<section class="card">' + metric_charts(data["series"], data["events"]) + "</section>",
    ]
    if data["pointers"]:
        parts.append("<h2>Pointers and gates</h2>")
        parts.append(
            table(
                ["ref", "kind", "manifest"],
                (
                    [
                        ref_link(p["ref"]),
                        escape(p["kind"]),
                        f"<code>{escape(p['target'][:16])}</code>",
                    ]
                    for p in data["pointers"]
                ),
                "pointers",
            )
        )
    restarts = [e for e in data["events"] if e["event"] != "save"]
    if restarts:
        parts.append("<h2>Restarts</h2>")
        parts.append(
            table(
                ["step", "event", "from"],
                ([str(e["step"]), escape(e["event"]), escape(e["ref"] or "")] for e in restarts),
                "events",
            )
        )
    parts.append("<h2>Checkpoints</h2>")
    rows = []
    for c in data["checkpoints"]:
        if "error" in c:
            rows.append(
                [escape(c["ref"]), "", "", "", f'<span class="bad">{escape(c["error"])}</span>', ""]
            )
            continue
        rows.append(
            [
                ref_link(c["ref"]),
                escape(str(c.get("step", ""))),
                escape(str(c.get("trigger") or "")),
                escape(metrics_text(c.get("metrics"))),
                " ".join(f'<span class="tag">{escape(m)}</span>' for m in c["marks"]),
                escape(when(c.get("created_at"))),
            ]
        )
    parts.append(
        table(
            ["checkpoint", "step", "trigger", "metrics", "pointed at by", "saved"],
            rows,
            "checkpoints",
        )
    )
    parts.append(pager("/run", data, name=data["run"]))
    for pool in data["pools"]:
        parts.append(f"<p>Opponent pool: {link('/pools', pool)}</p>")
    parts.extend(_damaged(d["ref"] + ": " + d["error"] for d in data["damaged"]))
    return "".join(parts)


def _damaged(lines: Iterable[str]) -> list[str]:
    return [f'<p class="bad">Cannot read {escape(line)}</p>' for line in lines]


def checkpoint_page(data: dict[str, Any]) -> str:
    """One checkpoint: sizes, lineage, metadata and tensors."""
    lineage = data["lineage"]
    facts = [
        ["manifest", f"<code>{escape(data['manifest'])}</code>"],
        ["kind", escape(data["kind"])],
        ["run", link("/run", data["run"], name=data["run"]) if data["run"] else "\u2014"],
        ["created", escape(when(data.get("created_at")))],
        ["logical bytes", escape(size(data.get("logical_bytes")))],
        ["stored bytes", escape(size(data.get("stored_bytes")))],
        ["exclusive bytes", escape(size(data.get("exclusive_bytes")))],
        ["chunks", escape(str(data.get("chunks")))],
        ["parent", f"<code>{escape(str(lineage['parent'] or chr(0x2014)))}</code> "
         + " ".join(ref_link(r) for r in lineage["parent_refs"])],
        ["shared with parent", escape(size(lineage["shared_with_parent_bytes"]))],
        ["delta bases", escape(str(lineage["delta_bases"]))],
        ["same manifest as", " ".join(ref_link(r) for r in lineage["copies"]) or "\u2014"],
    ]  # fmt: skip
    parts = [table(["", ""], facts, "facts")]
    parts.append("<h2>Metadata</h2>")
    parts.append(f"<pre>{escape(json.dumps(data['meta'], indent=2, default=str))}</pre>")
    if data["tensors"]:
        parts.append("<h2>Tensors</h2>")
        parts.append(
            table(
                ["name", "dtype", "shape", "codec", "bytes", "chunks"],
                (
                    [
                        escape(t["path"]),
                        escape(t["dtype"]),
                        escape("\u00d7".join(map(str, t["shape"])) or "scalar"),
                        escape(t["codec"]),
                        escape(size(t["nbytes"])),
                        str(t["chunks"]),
                    ]
                    for t in data["tensors"]
                ),
                "tensors",
            )
        )
        parts.append(pager("/checkpoint", data["tensor_page"], ref=data["ref"]))
    if data["files"]:
        parts.append("<h2>Files</h2>")
        parts.append(
            table(
                ["path", "format", "bytes", "chunks"],
                (
                    [escape(p), escape(f["format"]), escape(size(f["size"])), str(f["chunks"])]
                    for p, f in data["files"].items()
                ),
                "files",
            )
        )
    return "".join(parts)


def storage_page(data: dict[str, Any]) -> str:
    """Usage against the budget, dedup savings, per-run bytes, what GC would free."""
    pct, gc = data["usage_pct"], data["gc"]
    bar = (
        '<svg class="bar" viewBox="0 0 100 4" preserveAspectRatio="none">'
        f'<rect class="used" width="{min(100.0, pct):.2f}" height="4"/></svg>'
        f"<p>{size(data['referenced_bytes'])} referenced of a {size(data['budget'])} budget "
        f"({pct:.1f}%).</p>"
        if pct is not None
        else f"<p>{size(data['referenced_bytes'])} referenced; no budget in the stored policy.</p>"
    )
    facts = [
        ["stored (everything)", size(data["stored_bytes"])],
        ["logical (every checkpoint as its own copy)", size(data["logical_bytes"])],
        ["stored for what refs reach", size(data["reachable_stored_bytes"])],
        ["saved by dedup and compression", size(data["saved_bytes"])],
        ["dedup ratio", f"{data['dedup_ratio']:.2f}\u00d7"],
        ["gc would free now", size(gc["collectable_bytes"]) if gc else "\u2014 (no GC plan)"],
        ["waiting for the grace period", size(gc["waiting_bytes"]) if gc else "\u2014"],
        ["quarantined", f"{data['quarantine']['objects']} objects, {size(data['quarantine']['bytes'])}"],
    ]  # fmt: skip
    rows = (
        [
            link("/run", u["group"], name=u["group"]),
            str(u["refs"]),
            size(u["logical_bytes"]),
            size(u["stored_bytes"]),
            size(u["exclusive_bytes"]),
        ]
        for u in data["runs"]
    )
    problem = (
        f'<p class="bad">GC cannot plan: {escape(data["error"])}</p>' if "error" in data else ""
    )
    return (
        bar
        + _as_of(data)
        + problem
        + table(["", ""], ([escape(a), escape(b)] for a, b in facts), "facts")
        + "<h2>Per run</h2>"
        + table(["run", "refs", "logical", "stored", "only this run holds"], rows, "per-run")
        + "".join(_damaged(data["damaged_refs"]))
    )


def retention_page(data: dict[str, Any]) -> str:
    """The stored policy's plan: every ref kept, protected or to be forgotten, in time order."""
    if data["policy"] is None:
        return (
            '<p class="empty">No stored retention policy (<code>cas policy set ...</code> '
            "stores one).</p>"
        )
    summary = (
        f"<p>{data['kept']} kept, {data['forgotten']} to be forgotten; "
        f"{size(data['bytes_before'])} before, {size(data['bytes_after'])} after "
        f"({size(data['freed_bytes'])} freed by the next <code>cas forget --prune</code>). "
        "Nothing is deleted here.</p>"
    )
    rows = []
    for d in data["decisions"]:
        fate = "protected" if d["protected"] else "kept" if d["keep"] else "forget"
        rows.append(
            [
                escape(when(d.get("time"))),
                ref_link(d["ref"]),
                f'<span class="fate {fate}">{fate}</span>',
                escape(d.get("rule") or ""),
                escape("; ".join(d.get("reasons", []))),
                escape(size(d.get("bytes"))),
            ]
        )
    warnings = "".join(f'<p class="bad">{escape(w)}</p>' for w in data["warnings"]) + _as_of(data)
    policy = f"<details><summary>Policy</summary><pre>{escape(json.dumps(data['policy'], indent=2))}</pre></details>"
    return (
        summary
        + warnings
        + policy
        + table(["time", "ref", "fate", "rule", "why", "bytes"], rows, "plan")
        + pager("/retention", data)
    )


def pools_page(data: dict[str, Any]) -> str:
    """Every opponent pool: versions with ratings, anchors, and the eviction log."""
    if not data["pools"]:
        return '<p class="empty">No opponent pools in this store.</p>'
    parts = []
    for pool in data["pools"]:
        parts.append(f"<h2>{escape(pool['prefix'])}</h2>")
        if pool["error"]:
            parts.extend(_damaged([pool["error"]]))
        parts.append(
            table(
                [
                    "version",
                    "model",
                    "step",
                    "mu",
                    "sigma",
                    "mu - 3 sigma",
                    "games",
                    "win rate",
                    "anchor",
                ],
                (
                    [
                        str(e["version"]),
                        ref_link(e["ref"]),
                        escape(str(e["step"])),
                        escape(_num(e.get("mu"))),
                        escape(_num(e.get("sigma"))),
                        escape(_num(e.get("rating"))),
                        escape(str(e.get("games", 0))),
                        escape(_num(e.get("win_rate"))),
                        "anchor" if e.get("anchor") else "",
                    ]
                    for e in pool["entries"]
                ),
                "pool",
            )
        )
        if pool["evictions"]:
            parts.append("<h3>Evicted</h3>")
            parts.append(
                table(
                    ["version", "ref", "step", "mu", "evicted"],
                    (
                        [
                            escape(str(e.get("version", ""))),
                            escape(str(e.get("ref", ""))),
                            escape(str(e.get("step", ""))),
                            escape(_num(e.get("mu"))),
                            escape(when(e.get("evicted_at"))),
                        ]
                        for e in pool["evictions"]
                    ),
                    "evictions",
                )
            )
    return "".join(parts)


def _as_of(data: dict[str, Any]) -> str:
    """When the whole-store snapshot a page shows was computed."""
    if not data.get("as_of"):
        return ""
    age = max(0.0, time.time() - data["as_of"])
    return f'<p class="as-of">As of {escape(when(data["as_of"]))} ({age:.0f} s ago; refreshed every 30 s).</p>'


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "\u2014" if value is None else str(value)


def error_page(status: int, message: str, store: str) -> str:
    """A one-line error as a page."""
    return document(f"{status}", store, f'<p class="bad">{escape(message)}</p>')
