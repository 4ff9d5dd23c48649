"""JUnit XML for the plugin, written with the ``junit-xml`` package.

One ``<testsuite>`` per checked test (per ``msprobe.check`` call), one ``<testcase>`` per compared node (named by
the node, e.g. ``Functional.linear.0.forward``; its verdict is the isolated one, its whole-network drift a
property), one ``model.<output>`` testcase per final output and the loss (end-to-end tolerance) plus one
``overflow`` testcase. ``junit-xml`` has no per-testcase
properties, so the metrics are added to each ``<testcase>`` as ``<properties>`` after rendering, by the one writer
(:func:`msprobe_ci.junit.write_junit_xml`) the CLI's api-check uses too.
"""

from __future__ import annotations

from junit_xml import TestCase, TestSuite

from ..junit import api_case, write_junit_xml


def classname(test: str, index: int) -> str:
    """A JUnit ``classname`` CI viewers split well: Jenkins splits at the last dot into package and class, so
    ``tests/test_mine.py::test_x[1.5]`` becomes ``tests.test_mine.test_x[1_5] check 0`` (dots only between path
    parts; dots inside the test name become ``_``)."""
    path, _, name = test.partition("::")
    stem = path[:-3] if path.endswith(".py") else path
    package = ".".join(p.replace(".", "_") for p in stem.replace("\\", "/").split("/") if p)
    return f"{package}.{name.replace('.', '_').replace('::', '__')} check {index}" if name else \
        f"{package} check {index}"


def _body(n) -> str:
    """The failure body: the numbers of the verdict, one per line."""
    keys = (("metric", "metric"), ("value", "value"), ("threshold", "threshold"), ("standard", "standard"),
            ("worst_row", "worst row"), ("input_error", "input error"), ("drift", "drift RelativeErr"),
            ("drift_status", "drift status"))
    return "\n".join(f"{label:<18} {getattr(n, k)}" for k, label in keys if getattr(n, k, None) not in (None, ""))


def _budget_properties(budget: dict | None) -> dict[str, str]:
    """A check's budgeted isolation as suite properties: the calls judged on their own inputs out of all, the
    factor asked and the one measured (none without a budget)."""
    if not budget:
        return {}
    return {"msprobe.isolated_calls": f"{budget.get('judged')}/{budget.get('calls')}",
            "msprobe.isolation_budget": str(budget.get("factor")),
            "msprobe.isolation_cost": str(budget.get("measured_factor"))}


def write_junit(path: str, results: list) -> None:
    """Write ``results`` (the plugin's :class:`~msprobe_ci.check.row.CheckRow` summaries) to ``path`` atomically.

    Each node testcase carries the seconds its isolated verdict took (an API: running it, its oracle and bench,
    judging; a module: the calls inside it), a failure body with the verdict's numbers, and warnings in
    ``system-out`` (shown by Jenkins, GitLab and GitHub test reporters).
    """
    suites = []
    props: dict[tuple[str, str], dict[str, str]] = {}
    # checks (test, index before a step/rank suffix) whose failure some row's own cases already show
    shown = {(r.test, str(r.index).partition(" ")[0]) for r in results if r.step_failed}
    for r in results:
        if r.recorded:  # a recording run compares nothing
            continue
        suite_name = classname(r.test, r.index)
        if r.skipped:  # an absent device: said, as a skipped case
            case = TestCase("check", classname=suite_name)
            case.add_skipped_info(message=r.skipped)
            suites.append(TestSuite(suite_name, [case]))
            continue
        if r.error:  # the check raised before it concluded: it ran, and failed
            case = TestCase("check", classname=suite_name)
            case.add_failure_info(message=r.error, failure_type="check raised")
            suites.append(TestSuite(suite_name, [case]))
            continue
        cases = []
        for n in r.nodes:
            case = TestCase(n.name, classname=suite_name, elapsed_sec=n.seconds or None)
            if n.status == "error":
                case.add_failure_info(message=n.message, output=_body(n), failure_type="accuracy")
            elif n.status == "warning":
                case.stdout = f"msprobe warning: {n.message}\n{_body(n)}"
            elif n.status == "unmatched":
                case.add_skipped_info(message=n.message or "no bench data matched")
            elif n.status == "skip":  # not judgeable (free benchmark): said, never counted as a pass
                case.add_skipped_info(message=n.message)
            cases.append(case)
            props[(suite_name, n.name)] = {
                "msprobe.status": n.status, "msprobe.metric": n.metric, "msprobe.value": str(n.value),
                "msprobe.threshold": str(n.threshold), "msprobe.input_error": str(n.input_error),
                "msprobe.worst_row": n.worst_row, "msprobe.standard": n.standard,
                "msprobe.drift_RelativeErr": str("" if n.drift is None else n.drift),
                "msprobe.drift_status": n.drift_status}
        for m in r.model:
            case = TestCase(m.name, classname=suite_name)
            if m.status == "error":
                case.add_failure_info(message=m.message, output=_body(m), failure_type="end-to-end drift")
            elif m.status == "skip":  # not judged end to end (past a discrete choice): said, never a pass
                case.add_skipped_info(message=m.message)
            cases.append(case)
            props[(suite_name, m.name)] = {"msprobe.metric": m.metric, "msprobe.value": str(m.value),
                                              "msprobe.threshold": str(m.threshold)}
        if r.unapplied:  # an injected fault that never fired: the check proved nothing
            case = TestCase("injected-faults", classname=suite_name)
            case.add_failure_info(message="; ".join(r.unapplied), failure_type="fault never fired")
            cases.append(case)
        key = (r.test, str(r.index).partition(" ")[0])
        if r.failed and key not in shown:
            # the check failed for a reason no node shows (a loop's fault that never fired, coverage required):
            # one case says it, so JUnit agrees with the test
            case = TestCase("verdict", classname=suite_name)
            case.add_failure_info(message=r.failure or "the check failed", failure_type="check failed")
            cases.append(case)
            shown.add(key)
        ov = TestCase("overflow", classname=suite_name)
        if r.overflow_failed:
            ov.add_failure_info(message=r.overflow_message, failure_type="overflow")
        cases.append(ov)
        props[(suite_name, "overflow")] = {"msprobe.first_overflow": r.overflow_first or ""}
        if r.api_checks:
            api_cases = []
            for a in r.api_checks:
                api_cases.append(api_case(a.name, a.status, a.message, f"{suite_name}[api-check]"))
                props[(f"{suite_name}[api-check]", a.name)] = {"msprobe.status": a.status}
            suites.append(TestSuite(f"{suite_name}[api-check]", api_cases))
        suites.append(TestSuite(suite_name, cases, timestamp=r.started, properties={
            "msprobe.test": r.test,
            "msprobe.bench": r.bench, "msprobe.target": r.target, "msprobe.mode": r.mode,
            "msprobe.first_divergence": r.first_divergence or "", "msprobe.artifacts": r.dir,
            **_budget_properties(r.isolation_budget)}))
    write_junit_xml(path, suites, props)
