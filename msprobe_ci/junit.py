"""JUnit XML: the one writer of the pytest plugin and of ``msprobe-ci api-check`` (``junit-xml`` renders the suites;
it has no per-testcase properties, so they are added to each ``<testcase>`` after rendering).

Torch-free and pytest-free: the plugin (:mod:`msprobe_ci.pytest_plugin.junit`) builds its suites from its check
summaries, the CLI from its :class:`~msprobe_ci.replay.result.ApiResult` list; both write here.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

from junit_xml import TestCase, TestSuite, to_xml_report_string


def api_case(name: str, status: str, message: str, classname: str) -> TestCase:
    """The testcase of one per-API check (api-check, the plugin's pre-check): ``error`` a failure of type
    ``api-accuracy``, ``warning`` passed with the message in ``system-out``, ``skip`` skipped with its reason."""
    case = TestCase(name, classname=classname)
    if status == "error":
        case.add_failure_info(message=message, failure_type="api-accuracy")
    elif status == "warning":
        case.stdout = f"msprobe warning: {message}"
    elif status == "skip":
        case.add_skipped_info(message=message)
    return case


def write_junit_xml(path: str, suites: list[TestSuite], props: dict[tuple[str, str], dict[str, str]] | None = None,
                    ) -> str:
    """Render ``suites`` and write them to ``path`` atomically (never over a file that is not a JUnit report).

    Args:
        path: the report's path; its folder is created.
        suites: ``junit_xml.TestSuite`` objects, in order.
        props: ``{(classname, testcase name): {property: value}}``, added as ``<properties>`` to those testcases.

    Returns:
        The absolute path written.

    Raises:
        MsprobeError: ``path`` is a folder, not writable, or an existing file that is not a JUnit report.
    """
    from .outputs import atomic_write, check_output_file, is_junit, make_output_dir

    root = ET.fromstring(to_xml_report_string(suites, encoding="utf-8"))
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            values = (props or {}).get((case.get("classname"), case.get("name")))
            if not values:
                continue
            el = ET.Element("properties")
            for k, v in values.items():
                ET.SubElement(el, "property", name=k, value=v)
            case.insert(0, el)
    path = check_output_file(path, "JUnit XML", replaceable=is_junit)
    make_output_dir(os.path.dirname(path))
    with atomic_write(path, "wb") as fh:
        ET.ElementTree(root).write(fh, encoding="utf-8", xml_declaration=True)
    return path
