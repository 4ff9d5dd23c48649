"""pytest plugin ``msprobe``: options, ini keys, the ``msprobe`` fixture and marker, JUnit and terminal reports.

Thin by design: every option is read and validated once by :class:`~msprobe_ci.pytest_plugin.session.ProbeSession`
(kept in ``config.stash``); this module only wires pytest hooks to it. It imports neither torch nor numpy, so
``pytest --help`` stays fast in any environment where the plugin is installed.
"""

from __future__ import annotations

import os

import pytest

from .session import RESULT_PROPERTY, ProbeSession, session_key

# the option table (one declaration per option) lives in .options, which the session reads too
from .options import FLAGS, FREE_BENCHMARK, OPTIONS, RULE_INI, _choice  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("msprobe", "msprobe accuracy checks")
    # argparse formats help texts with %: a literal one ("coverage below 100%") must be doubled, or `pytest --help`
    # dies with "unsupported format character"
    for flag, ini, typ, default, metavar, help_text, _ in OPTIONS:
        group.addoption(flag, dest=ini, type=typ, default=None, metavar=metavar,
                        help=f"{help_text} Default: {default!r} (ini: {ini}).".replace("%", "%%"))
        parser.addini(ini, help=f"default for {flag}", default=default)
    for flag, ini, help_text, _ in FLAGS:
        group.addoption(flag, dest=ini, action="store_true", default=None,
                        help=f"{help_text} (ini: {ini}).".replace("%", "%%"))
        parser.addini(ini, help=f"default for {flag}", type="bool", default=False)
    group.addoption(FREE_BENCHMARK, dest="msprobe_free_benchmark", nargs="?", const="improve_precision", default=None,
                    type=_choice(("improve_precision", "to_cpu")), metavar="MODE",
                    help="no bench side: msprobe.check() runs only the target and re-runs every API call on copies of "
                         "its inputs in higher precision (improve_precision, the default MODE, on the target device; "
                         "to_cpu: fp64 on the CPU) and with bit-noised inputs, and fails naming the APIs whose output "
                         "errs beyond msprobe's free-benchmark threshold (fp16 0.002, bf16 0.004, fp32 0.0002) plus "
                         "what the bit noise moves it (ini: msprobe_free_benchmark).")
    parser.addini("msprobe_free_benchmark", help=f"default for {FREE_BENCHMARK} (a MODE; empty: off)", default="")
    for key, text in RULE_INI:
        parser.addini(f"msprobe_{key}", help=text, default="")
    parser.addini("msprobe_api_standards", type="linelist", default=[],
                  help="per-API pre-check: 'PATTERN = STANDARD' lines (fnmatch on the API name, e.g. 'lin* = legacy')")
    parser.addini("msprobe_api_thresholds", type="linelist", default=[],
                  help="per-API pre-check: 'STANDARD.THRESHOLD = VALUE' lines (e.g. 'absolute_threshold.rtol = 0.01')")


def pytest_configure(config: pytest.Config) -> None:
    from ..check.settings import CHECK_OPTIONS

    config.addinivalue_line("markers", f"msprobe(**options): per-test msprobe options ({', '.join(CHECK_OPTIONS)})")
    session = ProbeSession(config)
    config.stash[session_key] = session
    config.pluginmanager.register(session, "msprobe-session")


def pytest_collect_file(file_path, parent):
    session = parent.config.stash.get(session_key, None)
    if session is not None and session.api_files and str(file_path) in session.api_files:
        from .apicheck import ApiDumpFile

        # node ids relative to the --msprobe-api-check folder: stable for --lf, distinct per rank
        return ApiDumpFile.from_parent(parent, path=file_path,
                                       nodeid=os.path.relpath(str(file_path), session.api_root).replace(os.sep, "/"))
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With pytest-html active, each check's verdict, first divergence, plot and worst nodes go on the test's row
    (its ``extras``), read from the check summaries the fixture published."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not item.config.pluginmanager.hasplugin("html") or \
            not item.config.getoption("htmlpath", None):  # installed, but no --html page asked for
        return
    paths = [v for k, v in item.user_properties if k == RESULT_PROPERTY]
    if not paths:
        return
    import json

    import pytest_html

    from ..check.row import CheckRow
    from .report import extra_html

    extras = list(getattr(report, "extras", []))
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            extras.append(pytest_html.extras.html(extra_html(CheckRow.from_json(json.load(fh), path))))
    report.extras = extras


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(session_key, None)
    if session is not None:
        config.pluginmanager.unregister(session)
        del config.stash[session_key]


@pytest.fixture
def msprobe(request: pytest.FixtureRequest):
    """Run a model on the bench and the target backend under capture, compare, and fail on divergence.

    Usage::

        def test_model(msprobe):
            msprobe.check(model, input_ids, loss_fn=lambda out: out.logits.float().mean())
    """
    from .fixture import MsprobeFixture

    session = request.config.stash[session_key]
    fixture = MsprobeFixture(request, session)
    yield fixture
    fixture.finish()
