"""``report.html``: one self-contained page per gate run (inline CSS, inline SVG plots, nothing loaded from the
network), rendered by Jinja2 from the plugin's per-check summaries; plots by matplotlib's SVG backend."""

from __future__ import annotations

import datetime
import io
import math
import os
from dataclasses import asdict

from markupsafe import Markup

from ..check.row import CheckRow, NodeRow
from .summary import row_verdict  # the one verdict, read as the job summary reads it

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>msprobe accuracy gate</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; color: #1b1f23; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f4f6; } .pass { color: #116329; } .fail { color: #b42318; font-weight: bold; } .skip { color: #b54708; }
.muted { color: #57606a; } code { background: #f3f4f6; padding: 0 0.2em; }
.plot svg { max-width: 100%; height: auto; }
</style></head><body>
<h1>msprobe accuracy gate</h1>
<p class="muted">{{ when }} &middot; {{ checks|length }} check(s), {{ failing }} failing &middot; artifacts:
<code>{{ out_dir }}</code>{% if junit %} &middot; JUnit XML: <a href="{{ junit.href }}">{{ junit.name }}</a>{% endif %}</p>
{% if no_checks %}<p class="fail">{{ no_checks }}</p>{% endif %}
<table><tr><th>test</th><th>check</th><th>verdict</th><th>bench &rarr; target</th><th>nodes</th><th>pass</th>
<th>warning</th><th>error</th><th>first divergence</th></tr>
{% for c in checks %}<tr><td><a href="#check{{ loop.index }}">{{ c.test }}</a></td><td>{{ c.index }}</td>
<td class="{{ 'fail' if c.failed else 'pass' }}">{{ c.verdict }}</td><td>{{ c.sides }}</td><td>{{ c.nodes }}</td>
<td>{{ c.counts.pass }}</td><td>{{ c.counts.warning }}</td><td>{{ c.counts.error }}</td>
<td>{{ c.first or "none" }}</td></tr>
{% endfor %}</table>
{% for g in groups %}
<h2>{{ g.test }} &middot; check {{ g.index }}: {{ g.title }}</h2>
{% if g.plot %}<div class="plot">{{ g.plot }}</div>{% endif %}
<table><tr>{% for h in g.head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in g.rows %}<tr>{% for cell in row.cells %}<td{% if loop.index == row.mark %} class="{{ row.cls }}"{% endif %}>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% if g.note %}<p class="muted">{{ g.note }}</p>{% endif %}
{% endfor %}
{% for c in checks %}
<h2 id="check{{ loop.index }}">{{ c.test }} &middot; check {{ c.index }}: <span class="{{ 'fail' if c.failed else 'pass' }}">{{ c.verdict }}</span></h2>
{% if c.note %}<p class="muted">{{ c.note }}</p>{% else %}
<p>{{ c.sides }}, {{ c.mode }}{% if c.isolated %}, isolated verdicts (each API on its own inputs; drift is context){% else %}, drift rule{% endif %}.
First divergence: <b>{{ c.first or "none" }}</b>{% if c.first_where %} ({{ c.first_where }}){% endif %}{% if c.first_node is not none %} &mdash; {{ c.first_node.message }}{% endif %}.
First overflow: {{ c.overflow or "none" }}.</p>
{% if c.plot %}<div class="plot">{{ c.plot }}</div>
<p class="muted">Each judged node's error as a share of the threshold it had to meet, in run order (forward, then
backward); above the line fails; the first divergence is marked.</p>{% elif c.plot_note %}<p class="muted">{{ c.plot_note }}</p>{% endif %}
{% if c.worst %}<table><tr><th>worst nodes</th><th>status</th><th>metric</th><th>value</th><th>threshold</th><th>standard</th><th>row</th></tr>
{% for n in c.worst %}<tr><td>{{ n.name }}</td><td class="{{ 'fail' if n.status == 'error' else '' }}">{{ n.status }}</td>
<td>{{ n.metric }}</td><td>{{ n.value }}</td><td>{{ n.threshold }}</td><td>{{ n.standard }}</td><td>{{ n.worst_row }}</td></tr>
{% endfor %}</table>{% endif %}
{% if c.model %}<table><tr><th>model-level</th><th>status</th><th>relative L2 error</th><th>tolerance</th></tr>
{% for m in c.model %}<tr><td>{{ m.name }}</td><td class="{{ {'error': 'fail', 'pass': 'pass', 'skip': 'skip'}.get(m.status, '') }}" title="{{ m.message }}">{{ m.status }}</td>
<td>{{ m.value }}</td><td>{{ m.threshold }}</td></tr>{% endfor %}</table>
{% for m in c.model if m.status == 'skip' %}<p class="skip">{{ m.name }}: {{ m.message }}</p>{% endfor %}{% endif %}
{% for note in c.notes %}<p class="muted">note: {{ note }}</p>{% endfor %}
<p>{% if c.csv %}<a href="{{ c.csv.href }}">compare CSV</a> &middot; {% endif %}artifacts <code>{{ c.dir }}</code>
{% if c.graph %} &middot; graph <code>{{ c.graph }}</code> (open: <code>msprobe-ci view {{ graphs_dir }}</code>){% endif %}</p>
{% if c.replay %}<p>replay the first divergence alone: <code>{{ c.replay }}</code></p>{% endif %}
{% endif %}
{% endfor %}
</body></html>
"""


def _ratio(n: NodeRow) -> float | None:
    try:
        v, t = float(n.value), float(n.threshold)
    except (TypeError, ValueError):
        return None
    if math.isnan(v) or math.isnan(t) or math.isinf(t) or t < 0:
        return None
    if t == 0:  # an exact standard (binary: no element may differ)
        return math.inf if v > 0 else 0.0
    return v / t if math.isfinite(v) else math.inf


def _plot(nodes: tuple[NodeRow, ...], first: str | None) -> str | None:
    """An inline SVG: each judged node's value/threshold in run order (log scale), the line at 1, failing nodes
    red and the first divergence named; None without matplotlib or without a judged node."""
    plt = _pyplot()
    if plt is None:
        return None
    points = [(i, r, n) for i, n in enumerate(nodes) if (r := _ratio(n)) is not None]
    if not points:
        return None
    top = max((r for _, r, _ in points if math.isfinite(r)), default=1.0)
    cap = max(top, 1.0) * 2
    fig, ax = plt.subplots(figsize=(9, 2.6))
    try:
        for status, color in (("pass", "#2da44e"), ("warning", "#bf8700"), ("error", "#cf222e")):
            mine = [(i, max(min(r, cap), 1e-3)) for i, r, n in points
                    if (n.status if n.status in ("warning", "error") else "pass") == status]
            if mine:
                ax.scatter([i for i, _ in mine], [y for _, y in mine], s=9, color=color, label=status)
        ax.axhline(1.0, color="#cf222e", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylim(top=cap * 6)  # room for the first divergence's name
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("node, in run order")
        ax.set_ylabel("error / threshold")
        for i, r, n in points:
            if n.name == first:
                ax.annotate(first, (i, max(min(r, cap), 1e-3)), xytext=(5, 5), textcoords="offset points",
                            fontsize=8, color="#cf222e")
        ax.legend(loc="lower right", fontsize=7)
    except BaseException:
        plt.close(fig)
        raise
    return _svg(fig)


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    finally:
        plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # the inline element, without the XML prolog and doctype


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("svg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _training_plot(steps: list[int], bench: list[float], target: list[float], cosine: list[float | None]) -> str | None:
    """Both sides' loss per step and the lowest gradient cosine per step (a second panel); None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 2.6))
    ax.plot(steps, bench, marker="o", color="#0969da", label="bench")
    ax.plot(steps, target, marker="x", color="#cf222e", linestyle="--", label="target")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    cs = [(s, c) for s, c in zip(steps, cosine) if c is not None]
    if cs:
        bx.plot([s for s, _ in cs], [c for _, c in cs], marker="o", color="#8250df")
    bx.set_xlabel("step")
    bx.set_ylabel("lowest gradient cosine")
    for a in (ax, bx):
        from matplotlib.ticker import MaxNLocator

        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(fig)


def _group_key(r: CheckRow) -> tuple[str, str] | None:
    """``(test, check index)`` of a loop step's or a rank's row (``index`` ``"0 step2"`` / ``"0 rank1"``); None for
    a single check."""
    index = str(r.index)
    head, _, tail = index.partition(" ")
    if not tail or r.skipped or r.recorded:
        return None
    if r.loss_bench is not None or r.token_agrees is not None or r.rank is not None:
        return r.test, head
    return None


def _groups(results: list[CheckRow]) -> list[dict]:
    """The loop and multi-rank views: per training check its loss curves and per-step gradient cosine, per
    generation check its token agreement per step, per multi-rank check each rank's first divergence."""
    by_key: dict[tuple[str, str], list[CheckRow]] = {}
    for r in results:
        key = _group_key(r)
        if key is not None:
            by_key.setdefault(key, []).append(r)
    out = []
    for (test, index), rows in by_key.items():
        shown = any(r.step_failed for r in rows)  # a row of this check shows why it failed
        if rows[0].loss_bench is not None:
            rows = sorted(rows, key=lambda r: r.step or 0)
            steps = [i if r.step is None else r.step for i, r in enumerate(rows)]
            lows = []
            for r in rows:
                grads = [g for g in r.grads or () if isinstance(g.get("cosine"), (int, float))]
                lows.append(min(grads, key=lambda g: g["cosine"]) if grads else None)
            plot = _training_plot(steps, [r.loss_bench for r in rows], [r.loss_target for r in rows],
                                  [g["cosine"] if g else None for g in lows])
            out.append({"test": test, "index": index, "title": "training loop",
                        "plot": Markup(plot) if plot else None,
                        "head": ["step", "loss bench", "loss target", "lowest gradient cosine (parameter)",
                                 "verdict", "first divergence"],
                        "rows": [{"cells": [s, _fmt(r.loss_bench), _fmt(r.loss_target),
                                            f"{g['cosine']:.6f} ({g.get('param', '')})" if g else "-",
                                            row_verdict(r, shown), r.first_divergence or "none"],
                                  "mark": 5, "cls": "pass" if row_verdict(r, shown) == "pass" else "fail"}
                                 for s, r, g in zip(steps, rows, lows)],
                        "note": "Losses and gradient cosines are context, never failed on: each step's verdict "
                                "is its isolated API verdicts."})
        elif rows[0].token_agrees is not None:
            rows = sorted(rows, key=lambda r: r.step or 0)
            agree = sum(bool(r.token_agrees) for r in rows)
            out.append({"test": test, "index": index, "title": f"generation, token agreement {agree}/{len(rows)}",
                        "plot": None, "head": ["step", "token agrees", "verdict", "first divergence"],
                        "rows": [{"cells": [f"{'' if r.step is None else r.step}" + (" (prefill)" if r.step == 0 else ""),
                                            "yes" if r.token_agrees else "no",
                                            row_verdict(r, shown), r.first_divergence or "none"],
                                  "mark": 3, "cls": "pass" if row_verdict(r, shown) == "pass" else "fail"} for r in rows],
                        "note": "The target is teacher-forced on the bench's tokens; whether its own greedy pick "
                                "agrees is context, never failed on."})
        else:
            rows = sorted(rows, key=lambda r: (r.step or 0, r.rank or 0))
            first = next((r for r in rows if r.rank_first), None)
            steps = sorted({r.step for r in rows if r.step is not None})  # a training check_parallel: steps x ranks

            def where(r):
                return (f"step{r.step} " if r.step is not None else "") + f"rank{r.rank}"
            ranks = len({r.rank for r in rows})
            out.append({"test": test, "index": index,
                        "title": f"{ranks} ranks" + (f" x {len(steps)} steps" if steps else "")
                                 + ", first divergence: " + (where(first) if first is not None else "none"),
                        "plot": None, "head": ["step, rank" if steps else "rank", "verdict",
                                               "first divergence over ranks", "own first node"],
                        "rows": [{"cells": [where(r) + (" (first)" if r.rank_first else ""),
                                            row_verdict(r, shown),
                                            r.rank_divergence or "none", r.first_divergence or "none"],
                                  "mark": 2, "cls": "pass" if row_verdict(r, shown) == "pass" else "fail"} for r in rows],
                        "note": "A rank that only received diverged data through a collective is said to have "
                                "received it, and from which rank; the first is the earliest own divergence."})
    return out


def _fmt(x) -> str:
    try:
        return f"{float(x):.4g}"
    except (TypeError, ValueError):
        return str(x)


def _link(path: str | None, base: str) -> dict | None:
    if not path:
        return None
    return {"href": os.path.relpath(os.path.abspath(path), base).replace(os.sep, "/"), "name": os.path.basename(path)}


def _view(r: CheckRow, base: str) -> dict:
    """What the templates show of one check summary (links relative to ``base``)."""
    c = {"test": r.test, "index": r.index, "dir": r.dir, "notes": list(r.notes)}
    if r.error:
        c.update(verdict="fail", failed=True, sides="", nodes="", counts={"pass": "", "warning": "", "error": ""},
                 first=None, note=f"the check raised before it concluded: {r.error}")
        return c
    if r.skipped or r.recorded:
        c.update(verdict="skipped" if r.skipped else "recorded", failed=False, sides=r.bench,
                 nodes="", counts={"pass": "", "warning": "", "error": ""}, first=None,
                 note=r.skipped or f"recorded the bench in {r.baseline or ''}")
        return c
    nodes = r.nodes
    first = r.first_divergence
    failed = r.failed
    judged = sorted((n for n in nodes if _ratio(n) is not None), key=_ratio, reverse=True)[:10]
    plot = _plot(nodes, first)
    c.update(verdict="fail" if failed else "pass", failed=failed, sides=f"{r.bench} → {r.target}",
             nodes=r.nodes_compared, counts=r.counts, first=first, mode=r.mode,
             first_node=next((n for n in nodes if n.name == first), None), isolated=r.isolated,
             overflow=r.overflow_first if r.overflow_failed else None,
             plot=Markup(plot) if plot else None,
             plot_note=None if plot else "no plot: matplotlib is not installed, or no node was judged",
             worst=[dict(asdict(n), value=_fmt(n.value), threshold=_fmt(n.threshold)) for n in judged],
             model=[dict(asdict(m), value=_fmt(m.value), threshold=_fmt(m.threshold)) for m in r.model],
             csv=_link(r.csv, base), graph=r.graph, replay=r.replay,
             first_where=r.first_where, note=None)
    return c


_EXTRA = """<div><p><b>msprobe check {{ c.index }}: <span style="color:{{ '#b42318' if c.failed else '#116329' }}">{{ c.verdict }}</span></b>
{% if c.note %}({{ c.note }}){% else %}&middot; {{ c.sides }} &middot; first divergence: <b>{{ c.first or "none" }}</b>
{% if c.first_node is not none %}&mdash; {{ c.first_node.message }}{% endif %}{% endif %}</p>
{% if c.plot %}<div style="max-width:900px">{{ c.plot }}</div>{% endif %}
{% if c.worst %}<table><tr><th>worst nodes</th><th>status</th><th>metric</th><th>value</th><th>threshold</th></tr>
{% for n in c.worst[:5] %}<tr><td>{{ n.name }}</td><td>{{ n.status }}</td><td>{{ n.metric }}</td><td>{{ n.value }}</td>
<td>{{ n.threshold }}</td></tr>{% endfor %}</table>{% endif %}
<p>artifacts: <code>{{ c.dir }}</code></p></div>
"""


def extra_html(result: CheckRow) -> str:
    """One check's verdict, first divergence, plot and worst nodes as an HTML fragment (pytest-html's extras on the
    test's row)."""
    import jinja2

    view = _view(result, os.getcwd())
    return jinja2.Environment(autoescape=True).from_string(_EXTRA).render(c=view)


def render(results: list[CheckRow], out_dir: str, report_path: str, junitxml: str | None = None,
           no_checks: str = "") -> str:
    """The report's HTML for a session's check summaries (``msprobe-result.json`` contents).

    Args:
        results: one :class:`~msprobe_ci.check.row.CheckRow` per check, as the plugin stores them.
        out_dir: ``--msprobe-out``. report_path: where the page goes (links are made relative to it).
        junitxml: the ``--msprobe-junitxml`` path, if any. no_checks: the "no msprobe check ran" line, if any.
    """
    import jinja2

    base = os.path.dirname(os.path.abspath(report_path))
    checks = [_view(r, base) for r in results]
    env = jinja2.Environment(autoescape=True)
    return env.from_string(_TEMPLATE).render(
        checks=checks, groups=_groups(results), failing=sum(c["failed"] for c in checks),
        out_dir=os.path.abspath(out_dir),
        junit=_link(junitxml, base), no_checks=no_checks, graphs_dir=os.path.join(os.path.abspath(out_dir), "graphs"),
        when=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"))


def write_report(path: str, results: list[CheckRow], out_dir: str, junitxml: str | None = None,
                 no_checks: str = "") -> str:
    """Write :func:`render`'s page to ``path`` (atomically; an existing file is replaced only when it is one of
    ours); returns the path.

    Raises:
        MsprobeError: ``path`` is a folder or a file msprobe-ci did not write.
    """
    from ..outputs import atomic_write, make_output_dir

    path = os.path.abspath(path)
    if os.path.isdir(path):
        from ..errors import MsprobeError

        raise MsprobeError(f"{path}: --msprobe-report is a folder, expected a file path")
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as fh:
            if "<title>msprobe accuracy gate</title>" not in fh.read(4096):
                from ..errors import MsprobeError

                raise MsprobeError(f"{path}: --msprobe-report exists and was not written by msprobe-ci")
    make_output_dir(os.path.dirname(path))
    with atomic_write(path, "w", encoding="utf-8") as fh:
        fh.write(render(results, out_dir, path, junitxml, no_checks))
    return path
