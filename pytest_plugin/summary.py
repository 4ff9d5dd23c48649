"""The Markdown summary a CI job page shows (GitHub Actions' ``$GITHUB_STEP_SUMMARY``): one table row per check
with its verdict, the first divergence and overflow, then where the artifacts are."""

from __future__ import annotations

import os

from ..check.row import CheckRow


def row_verdict(r: CheckRow, shown: bool = False) -> str:
    """A loop step's or a rank's verdict cell: its own evidence; where the check failed for a reason no row of it
    shows (``shown`` False: a fault that never fired, coverage), said so: ``pass (check failed)``."""
    if r.step_failed:
        return "fail"
    return "pass (check failed)" if r.failed and not shown else "pass"


def _cell(value) -> str:
    """A table cell: pipes escaped, newlines flattened (Markdown tables are one line a row)."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(results: list[CheckRow], out_dir: str, junitxml: str | None = None, no_checks: str = "",
             report: str | None = None) -> str:
    """The summary of a session's check results (the plugin's serialisable summaries).

    Args:
        results: one :class:`~msprobe_ci.check.row.CheckRow` per check (``msprobe-result.json``'s content).
        out_dir: ``--msprobe-out`` (artifacts, graphs).
        junitxml: the ``--msprobe-junitxml`` path, if any.
        no_checks: the "no msprobe check ran" line, when the session checked nothing.
        report: the HTML report's path, when one was written.

    Returns:
        Markdown text ending in a newline; a heading and the no-checks line when there are no results.
    """
    lines = ["## msprobe accuracy gate", ""]
    if no_checks:
        lines += [f"**{no_checks}**", ""]
    if results:
        lines += ["| test | check | verdict | bench → target | nodes | pass | warning | error | first divergence "
                  "| first overflow |", "|---|---|---|---|---|---|---|---|---|---|"]
    failed = 0
    for r in results:
        head = f"| {_cell(r.test)} | {r.index} "
        if r.skipped:
            lines.append(head + f"| skipped: {_cell(r.skipped)} | | | | | | | |")
            continue
        if r.recorded:
            lines.append(head + f"| recorded the bench ({_cell(r.baseline or '')}) | | | | | | | |")
            continue
        if r.error:
            failed += 1
            lines.append(head + f"| ❌ fail: the check raised: {_cell(r.error)} | | | | | | | |")
            continue
        c = r.counts
        bad = r.failed
        failed += bad
        lines.append(head + f"| {'❌ fail' if bad else '✅ pass'} | {_cell(r.bench)} → {_cell(r.target)} "
                     f"| {r.nodes_compared} | {c.get('pass', 0)} | {c.get('warning', 0)} | {c.get('error', 0)} "
                     f"| {_cell(r.first_divergence or 'none')} "
                     f"| {_cell(r.overflow_first or 'none') if r.overflow_failed else 'none'} |")
    budgets = [(r, r.isolation_budget) for r in results if r.isolation_budget]
    if budgets:
        from ..compare.isolation_file import describe_budget

        lines += [""] + [f"- {_cell(r.test)} {r.index}: {describe_budget(b)}" for r, b in budgets]
    if results:
        lines += ["", f"{len(results)} check(s), {failed} failing."]
        lines.append(f"Artifacts (CSV, dumps, graphs): `{os.path.abspath(out_dir)}`")
        if any(r.graph for r in results):
            lines.append(f"Open the graphs: `msprobe-ci view {os.path.join(os.path.abspath(out_dir), 'graphs')}`")
        if junitxml:
            lines.append(f"JUnit XML: `{os.path.abspath(junitxml)}`")
        if report:
            lines.append(f"Report (one HTML page; upload it as an artifact): `{report}`")
    return "\n".join(lines) + "\n"


def append_to_step_summary(text: str) -> str | None:
    """Append ``text`` to the file ``$GITHUB_STEP_SUMMARY`` names; returns its path, or None where it is unset.
    An unwritable path is reported by the caller's terminal, never raised (a summary never fails a gate)."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return None
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)
    return path
