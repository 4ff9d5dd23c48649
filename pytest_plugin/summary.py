"""The Markdown summary a CI job page shows (GitHub Actions' ``$GITHUB_STEP_SUMMARY``): one table row per check
with its verdict, the first divergence and overflow, then where the artifacts are."""

from __future__ import annotations

import os


def check_failed(r: dict) -> bool:
    """Whether the check a summary row belongs to failed its test: the verdict its
    :class:`~msprobe_ci.check.conclude.Conclusion` decided, stamped on every row it published (``verdict``), so
    every artifact says what the test said (a fault that never fired, coverage short under
    ``--msprobe-require-coverage``, a check that raised included). A row without the stamp (written by an older
    version) falls back to its own evidence (:func:`step_failed`)."""
    if r.get("verdict") in ("pass", "fail"):
        return r["verdict"] == "fail"
    return step_failed(r)


def step_failed(r: dict) -> bool:
    """Whether one row's own evidence fails (one step or rank of a loop or multi-rank check): a first divergence, a
    new overflow, a fault that never fired, a failing model-level case or per-API pre-check."""
    return bool(r.get("first_divergence") or r.get("overflow_failed") or r.get("unapplied") or
                any(m["status"] == "error" for m in r.get("model") or ()) or
                any(a["status"] == "error" for a in r.get("api_checks") or ()))


def row_verdict(r: dict, shown: bool = False) -> str:
    """A loop step's or a rank's verdict cell: its own evidence; where the check failed for a reason no row of it
    shows (``shown`` False: a fault that never fired, coverage), said so: ``pass (check failed)``."""
    if step_failed(r):
        return "fail"
    return "pass (check failed)" if check_failed(r) and not shown else "pass"


def _cell(value) -> str:
    """A table cell: pipes escaped, newlines flattened (Markdown tables are one line a row)."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(results: list[dict], out_dir: str, junitxml: str | None = None, no_checks: str = "",
             report: str | None = None) -> str:
    """The summary of a session's check results (the plugin's serialisable summaries).

    Args:
        results: one dict per check (``msprobe-result.json``'s content).
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
        head = f"| {_cell(r['test'])} | {r['index']} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {_cell(r['skipped'])} | | | | | | | |")
            continue
        if r.get("recorded"):
            lines.append(head + f"| recorded the bench ({_cell(r.get('baseline', ''))}) | | | | | | | |")
            continue
        if r.get("error"):
            failed += 1
            lines.append(head + f"| ❌ fail: the check raised: {_cell(r['error'])} | | | | | | | |")
            continue
        c = r["counts"]
        bad = check_failed(r)
        failed += bad
        lines.append(head + f"| {'❌ fail' if bad else '✅ pass'} | {_cell(r['bench'])} → {_cell(r['target'])} "
                     f"| {r['nodes_compared']} | {c['pass']} | {c['warning']} | {c['error']} "
                     f"| {_cell(r.get('first_divergence') or 'none')} "
                     f"| {_cell(r.get('overflow_first') or 'none') if r.get('overflow_failed') else 'none'} |")
    budgets = [(r, r["isolation_budget"]) for r in results if r.get("isolation_budget")]
    if budgets:
        from ..compare.isolation_file import describe_budget

        lines += [""] + [f"- {_cell(r['test'])} {r['index']}: {describe_budget(b)}" for r, b in budgets]
    if results:
        lines += ["", f"{len(results)} check(s), {failed} failing."]
        lines.append(f"Artifacts (CSV, dumps, graphs): `{os.path.abspath(out_dir)}`")
        if any(r.get("graph") for r in results):
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
