"""Every way a `check` fails, through the plugin: the one-line message and the failing JUnit testcase.

The API path (an injected fault named), the unapplied fault and the baseline mismatch are covered in
test_plugin.py and test_baseline.py; here the model-level testcases (drift beyond the end-to-end tolerance, and
NaN/Inf on one side only, which used to crash the fixture with a format error) and the overflow check.
"""

import re
import textwrap
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("junitparser")

MODELS = textwrap.dedent('''
    import torch

    class Exp(torch.nn.Module):
        """exp of a Linear's output: values to ~300 overflow in fp32 above 88.7 and in fp16 above 11.1, so both
        sides hold Inf, in different elements."""

        def __init__(self, gain):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.gain = gain

        def forward(self, x):
            return torch.exp(self.fc(x) * self.gain)

    class Clamped(Exp):
        def forward(self, x):
            return torch.exp(self.fc(x) * self.gain).clamp(max=1e4)

    def _x():
        return torch.randn(16, 8, generator=torch.Generator().manual_seed(0))

    def test_both_overflow(msprobe):
        torch.manual_seed(0)
        msprobe.check(Exp(300.0), _x())

    def test_drift(msprobe):
        torch.manual_seed(0)
        msprobe.check(Exp(1.0), _x(), output_rtol=1e-9)

    def test_target_only_overflow(msprobe):
        torch.manual_seed(0)
        msprobe.check(Clamped(12.0), _x())
''')


def _cases(path) -> dict:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        failure = case.find("failure")
        test = case.get("classname").split(" check ")[0].rsplit(".", 1)[-1]  # "test_models.test_drift check 0"
        out[(test, case.get("name"))] = None if failure is None else failure.get("message")
    return out


def test_model_level_and_overflow_failures_say_why_in_one_line_and_in_junit(pytester):
    pytester.makepyfile(test_models=MODELS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=fp16",
                                           "--msprobe-junitxml=gate.xml", "--msprobe-no-graph")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "ValueError" not in out and "Traceback" not in out
    result.stdout.fnmatch_lines([
        "*msprobe: model output model.output: * element(s) NaN/Inf on one side only (target *, bench * of 128 "
        "non-finite); every isolated API passes its own standard. Artifacts: *",
        "*msprobe: model output model.output drifts beyond the end-to-end tolerance: relative L2 error * > 1e-09 "
        "(every isolated API passes its own standard; set output_rtol to accept this drift). Artifacts: *",
        "*msprobe: overflow on the target at Torch.exp.0.forward (critical: NaN/Inf in output.0); the bench has none "
        "there. Artifacts: *",
    ], consecutive=False)
    cases = _cases(pytester.path / "gate.xml")
    assert "NaN/Inf on one side only" in cases[("test_both_overflow", "model.output")]
    assert "relative L2 error" in cases[("test_drift", "model.output")]
    assert cases[("test_drift", "overflow")] is None
    assert cases[("test_target_only_overflow", "overflow")] is not None
    assert cases[("test_target_only_overflow", "model.output")] is None
    # the overflow is the check's only failure: every API passes on its own inputs
    assert not [k for k, v in cases.items() if k[0] == "test_target_only_overflow" and v is not None and
                k[1] != "overflow"]


PLAIN = textwrap.dedent('''
    def test_one():
        assert 1 + 1 == 2

    def test_two():
        assert "msprobe" not in "a refactor dropped the fixture"
''')


@pytest.mark.parametrize("xdist", [False, True])
def test_a_gate_that_checks_nothing_says_so(pytester, xdist):
    """An msprobe option on a session where no test calls a check: the summary says the gate proved nothing;
    --msprobe-require-checks makes it exit 1 (also under xdist, where only the controller knows); without any
    msprobe option nothing is said."""
    pytester.makepyfile(test_plain=PLAIN)
    extra = ["-n", "2"] if xdist else []
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target=npu", *extra)
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["msprobe: no msprobe check ran in this session (2 test(s) collected, none called "
                                 "msprobe.check/check_* or compare_dumps): the gate proved nothing; "
                                 "--msprobe-require-checks makes this a failure"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target=npu",
                                           "--msprobe-require-checks", *extra)
    result.assert_outcomes(passed=2)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["msprobe: no msprobe check ran in this session*the gate proved nothing "
                                 "[[]--msprobe-require-checks[]]"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *extra)
    assert result.ret == 0 and "no msprobe check ran" not in result.stdout.str()


def test_require_checks_is_quiet_when_a_check_ran(pytester):
    from _suites import MODEL_TEST

    pytester.makepyfile(test_model=MODEL_TEST, test_plain=PLAIN)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-require-checks",
                                           "--msprobe-no-graph")
    result.assert_outcomes(passed=3)
    assert result.ret == 0 and "no msprobe check ran" not in result.stdout.str()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-require-checks", "-k", "plain")
    assert result.ret == 1  # -k deselected the only check
    result.stdout.fnmatch_lines(["msprobe: no msprobe check ran in this session (2 test(s) collected*"])


SUMMARY_TESTS = textwrap.dedent('''
    import pytest
    import torch

    def _x():
        return torch.randn(16, 8, generator=torch.Generator().manual_seed(0))

    def test_clean(msprobe):
        torch.manual_seed(0)
        msprobe.check(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), _x())

    @pytest.mark.msprobe(inject="faults.yaml")
    def test_faulty(msprobe):
        torch.manual_seed(0)
        msprobe.check(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), _x())
''')


def test_github_job_summary_is_appended_when_asked(pytester, monkeypatch):
    """With $GITHUB_STEP_SUMMARY set (GitHub Actions), a Markdown table of the checks is appended to that file:
    one row per check with its verdict and first divergence, then where the artifacts are; without it, nothing."""
    pytester.makepyfile(test_gate=SUMMARY_TESTS)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.relu, call: 0, perturb: scale, value: 1.5}\n")
    summary = pytester.path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"msprobe job summary ($GITHUB_STEP_SUMMARY): {summary}"])
    text = summary.read_text()
    assert text.startswith("earlier step\n## msprobe accuracy gate\n")  # appended, never overwritten
    rows = [line for line in text.splitlines() if line.startswith("| test_gate.py::")]
    assert len(rows) == 2
    assert "| ✅ pass |" in rows[0] and "| none | none |" in rows[0]
    assert "| ❌ fail |" in rows[1] and "| Functional.relu.0.forward |" in rows[1]
    assert "2 check(s), 1 failing." in text and f"JUnit XML: `{pytester.path / 'j.xml'}`" in text
    assert f"Artifacts (CSV, dumps, graphs): `{pytester.path / 'msprobe-out'}`" in text
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    summary.unlink()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16", "-k", "clean")
    result.assert_outcomes(passed=1)
    assert not summary.exists() and "job summary" not in result.stdout.str()


def test_github_job_summary_says_when_no_check_ran(pytester, monkeypatch):
    pytester.makepyfile(test_plain="def test_nothing():\n    assert True\n")
    summary = pytester.path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target=npu")
    result.assert_outcomes(passed=1)
    assert "**msprobe: no msprobe check ran in this session" in summary.read_text()


def test_html_report_of_a_failing_gate(pytester):
    """Every session that ran checks writes <msprobe-out>/report.html: one self-contained page (no script, no
    stylesheet or image fetched from anywhere) with each check's verdict, the first divergence with its message,
    a plot of the judged nodes, the worst nodes and links; --msprobe-report moves it, =off skips it."""
    import html.parser

    pytester.makepyfile(test_gate=SUMMARY_TESTS)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.relu, call: 0, perturb: scale, value: 1.5}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=1, failed=1)
    report = pytester.path / "msprobe-out" / "report.html"
    result.stdout.fnmatch_lines([f"msprobe report: {report}"])
    text = report.read_text(encoding="utf-8")

    class Tags(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.hrefs = [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self.hrefs += [v for k, v in attrs if k in ("href", "src")]

    tags = Tags()
    tags.feed(text)
    assert "script" not in tags.tags and "link" not in tags.tags and "img" not in tags.tags
    assert not [h for h in tags.hrefs if "://" in h]  # every link is a relative path into the artifacts
    assert tags.tags.count("svg") == 2 and tags.tags.count("h2") == 2
    assert "2 check(s), 1 failing" in text and "Functional.relu.0.forward" in text
    where = re.search(r"First divergence: <b>Functional.relu.0.forward</b> \((.*?)\) &mdash; Functional.relu.0.forward: ",
                      text).group(1)  # its module and the line that called it (torch's own ReLU module: its forward)
    assert where.startswith("in Module.1.ReLU.forward.0; at ") and re.search(
        r"torch/nn/modules/activation.py, line \d+, in forward$", where), where
    assert "../j.xml" in tags.hrefs and any(h.endswith(".csv") and (report.parent / h).is_file() for h in tags.hrefs)
    replay = re.search(r"replay the first divergence alone: <code>(.*?)</code>", text).group(1)
    assert replay.startswith("pytest --msprobe-api-check=") and "--msprobe-api-live" in replay
    assert replay.endswith(" -k &#39;Functional.relu.0.forward&#39;") and text.count("replay the first") == 1
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16", "-k", "clean",
                                           "--msprobe-report=elsewhere/r.html")
    assert (pytester.path / "elsewhere" / "r.html").is_file()
    report.unlink()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "clean", "--msprobe-report=off")
    result.assert_outcomes(passed=1)
    assert not report.exists() and "msprobe report" not in result.stdout.str()


@pytest.mark.skipif(not (__import__("shutil").which("chromium") or __import__("shutil").which("chromium-browser")),
                    reason="needs chromium (the Debian package) for a headless screenshot; not installed here")
def test_html_report_renders_in_headless_chromium(pytester):
    import shutil
    import subprocess

    pytester.makepyfile(test_gate=SUMMARY_TESTS)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.relu, call: 0, perturb: scale, value: 1.5}\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = pytester.path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,900", (pytester.path / "msprobe-out" / "report.html").as_uri()], check=True,
                   capture_output=True, timeout=120)
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(str(shot))[..., :3]  # a rendered page, not a blank one: text, table, plot
    inked = (pixels.min(axis=-1) < 0.9).mean()
    colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert inked > 0.01 and colours > 50, (inked, colours)
    red = ((pixels[..., 0] > 0.6) & (pixels[..., 1] < 0.35) & (pixels[..., 2] < 0.35)).sum()
    assert red > 50  # the failing verdict and the plot's failing point, in red


def test_pytest_html_rows_carry_each_checks_verdict_and_plot(pytester):
    """With pytest-html active (--html), the failing test's row carries its check's verdict, first divergence and
    plot as extras; the page still loads nothing from the network for them."""
    pytest.importorskip("pytest_html")
    pytester.makepyfile(test_gate=SUMMARY_TESTS)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.relu, call: 0, perturb: scale, value: 1.5}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--html=page.html", "--self-contained-html")
    result.assert_outcomes(passed=1, failed=1)
    import html as html_module
    import json
    import re

    page = (pytester.path / "page.html").read_text(encoding="utf-8")
    blob = json.loads(html_module.unescape(re.search(r'data-jsonblob="([^"]*)"', page).group(1)))
    extras = {test: [e["content"] for run in runs for e in run.get("extras", [])]
              for test, runs in blob["tests"].items()}
    (clean,), (faulty,) = extras["test_gate.py::test_clean"], extras["test_gate.py::test_faulty"]
    assert "msprobe check 0: <span style=\"color:#116329\">pass</span>" in clean and "<svg" in clean
    assert "msprobe check 0: <span style=\"color:#b42318\">fail</span>" in faulty and "<svg" in faulty
    assert "first divergence: <b>Functional.relu.0.forward</b>" in faulty
