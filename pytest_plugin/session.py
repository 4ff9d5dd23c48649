"""Per-run state of the plugin: validated options, collected results, JUnit and terminal reports."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from ..check.conclude import RESULT as RESULT_PROPERTY
from ..check.row import CheckRow
from ..check.settings import check_keys
from ..errors import MsprobeError
from .options import FLAGS, OPTIONS, PARSERS, RULE_INI

#: the property of a check that raised before it concluded (its one-line error): it ran, and failed
ERROR_PROPERTY = "msprobe.check_error"
#: the folder under ``--msprobe-out`` holding the pre-check's reproductions
API_CHECK_DIR = "api-check"


def dump_files(path: str) -> list[str]:
    """The dump.json files named by ``--msprobe-api-check`` (a file, a rank folder or a step folder).

    Raises:
        pytest.UsageError: nothing readable there.
    """
    from ..dump.reader import rank_folders
    from ..errors import MsprobeError

    path = os.path.abspath(path)
    if os.path.isfile(path):
        return [path]
    try:
        return [os.path.join(f, "dump.json") for f in rank_folders(path)]
    except MsprobeError as exc:
        raise pytest.UsageError(f"msprobe: --msprobe-api-check: {exc}") from None


_BAD_MARKER = pytest.StashKey[str]()  # an item's unknown @pytest.mark.msprobe options, said at its setup

session_key: "pytest.StashKey[ProbeSession]" = pytest.StashKey()


def _opt(config: pytest.Config, ini: str, default: Any = None) -> Any:
    """The option's value, the command line over the ini file, else ``default``; an ini value is parsed by the same
    function as its flag (the option table, :data:`msprobe_ci.pytest_plugin.options.OPTIONS`: one declaration, one
    parse).

    Raises:
        pytest.UsageError: an ini value its parser refuses (``msprobe: ini <key>: <why>``).
    """
    import argparse

    value = config.getoption(ini, default=None)
    if value is None:
        value = config.getini(ini)
        if isinstance(value, str) and value != "" and ini in PARSERS:
            try:
                value = PARSERS[ini](value)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise pytest.UsageError(f"msprobe: ini {ini}: {exc}") from None
    return value if value not in ("", None) else default


class ProbeSession:
    """Reads every ``--msprobe-*`` option once (command line over ini), validates it, and collects results.

    Raises:
        pytest.UsageError: an invalid ini value, an unreadable fault file or config.json.
    """

    def __init__(self, config: pytest.Config):
        self.config = config
        self.results: list[CheckRow] = []
        # the run's layer of every check's options (call > marker > this): each row of the option table that sets a
        # check option, by its own parser (_opt), else the table's default; then the ini-only keys
        self.check_options: dict[str, Any] = {o.check: _opt(config, o.ini, o.default) for o in OPTIONS if o.check}
        self.check_options.update({f.check: bool(_opt(config, f.ini)) for f in FLAGS if f.check})
        free_benchmark = _opt(config, "msprobe_free_benchmark")
        if free_benchmark not in (None, "improve_precision", "to_cpu"):
            raise pytest.UsageError(f"msprobe: ini msprobe_free_benchmark: expected improve_precision or to_cpu, got "
                                    f"{free_benchmark!r}")
        self.check_options["free_benchmark"] = free_benchmark
        self.check_options["api_standards"], self.check_options["api_thresholds"] = _api_overrides(config)
        # the drift rule's factors where the ini sets them (its old name atol is read by check.settings.merge only)
        self.check_options.update({k: config.getini(f"msprobe_{k}") for k, _ in RULE_INI
                                   if config.getini(f"msprobe_{k}") not in ("", None)})
        # the session's own options
        self.out = os.path.abspath(_opt(config, "msprobe_out") or "msprobe-out")
        report = _opt(config, "msprobe_report")
        self.report = None if report == "off" else os.path.abspath(report or os.path.join(self.out, "report.html"))
        self.junitxml = _opt(config, "msprobe_junitxml")
        self._check_outputs(config)
        self.config_path = _opt(config, "msprobe_config")
        self.inject_path = _opt(config, "msprobe_inject")
        self.baseline = _opt(config, "msprobe_baseline")
        self.baseline = os.path.abspath(self.baseline) if self.baseline else None
        self.record = bool(_opt(config, "msprobe_record"))
        self.no_graph = bool(_opt(config, "msprobe_no_graph"))
        self.require_device = bool(_opt(config, "msprobe_require_device"))
        self.require_coverage = bool(_opt(config, "msprobe_require_coverage"))
        self.require_checks = bool(_opt(config, "msprobe_require_checks"))
        # the user asked for msprobe: an option on the command line (a session that then checks nothing says so)
        self.asked = self.require_checks or any(str(a).startswith("--msprobe") for a in config.invocation_params.args)
        self.api_counts = {"items": 0, "skipped": 0, "reason": ""}
        self._runs: dict[str, int] = {}  # test id -> this session's place in its budgeted rotation
        self.api_live = bool(_opt(config, "msprobe_api_live"))
        self.fuzz = int(_opt(config, "msprobe_fuzz") or 0)
        if self.fuzz < 0:
            raise pytest.UsageError(f"msprobe: --msprobe-fuzz: expected 0 or more examples per API, got {self.fuzz}")
        self.api_files: list[str] = []
        self.api_warnings: list[tuple[str, str]] = []
        api_check = _opt(config, "msprobe_api_check")
        if api_check:
            self.api_files = dump_files(api_check)
            self.api_root = os.path.dirname(os.path.commonpath([os.path.dirname(f) for f in self.api_files]))
            explicit = config.args_source == pytest.Config.ArgsSource.ARGS
            # the dump files are the test files: collected even from an empty directory
            config.args[:] = (list(config.args) if explicit else []) + self.api_files
            if not hasattr(config, "workerinput"):  # the controller, once per run (xdist workers write into it)
                from ..outputs import owned_dir

                try:  # a previous run's reproductions replaced: none is left to mislead
                    owned_dir(os.path.join(self.out, API_CHECK_DIR), "--msprobe-api-check reproductions")
                except MsprobeError as exc:
                    raise pytest.UsageError(f"msprobe: {exc}") from None
        args = [str(a) for a in config.invocation_params.args]
        if "--msprobe-baseline" in args[:-1] and os.path.exists(args[args.index("--msprobe-baseline") + 1]):
            # pytest takes an existing path after a space for a test path when it picks the rootdir, which
            # changes node ids (and so baseline folders) between runs
            raise pytest.UsageError(f"msprobe: write --msprobe-baseline={self.baseline} (with '='): pytest reads "
                                    "an existing path given after a space as a test path when it picks the rootdir")
        if self.record and not self.baseline:
            raise pytest.UsageError("msprobe: --msprobe-record needs --msprobe-baseline=DIR (where to store the bench)")
        self._validated = False
        self._locks: dict = {}

    def _check_outputs(self, config: pytest.Config) -> None:
        """Output paths fail at start-up with one line, never at the end of a run (see msprobe_ci.outputs)."""
        from ..errors import MsprobeError
        from ..outputs import check_output_dir, check_output_file, is_junit

        try:
            check_output_dir(self.out, "--msprobe-out")
            if self.junitxml:
                self.junitxml = check_output_file(self.junitxml, "--msprobe-junitxml", replaceable=is_junit)
        except MsprobeError as exc:
            raise pytest.UsageError(f"msprobe: {exc}") from None

    def validate_files(self) -> None:
        """Load the fault file and config.json once, lazily (they need yaml/torch-free parsing only)."""
        if self._validated:
            return
        from ..capture.inject import load_faults
        from ..check.settings import merge, thresholds
        from ..config import load_config
        from ..errors import MsprobeError

        try:
            self.faults = load_faults(self.inject_path) if self.inject_path else ()
            self.dump_config = load_config(self.config_path) if self.config_path else None
            thresholds(merge([self.check_options]))  # the ini's rule factors, refused at start-up if bad
        except MsprobeError as exc:
            raise pytest.UsageError(f"msprobe: {exc}") from None
        self._validated = True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.validate_files()

    def test_dir(self, nodeid: str) -> str:
        """``{out}/{sanitised test id}``, owned by msprobe-ci (see :mod:`msprobe_ci.outputs`): a previous run's
        folder (marked ``.msprobe-ci``) is replaced, anything else there is refused. Another process running the
        same test into the same ``--msprobe-out`` holds the folder's lock until its test ends; this one waits.

        Raises:
            MsprobeError: the folder exists and is not ours, or cannot be created.
        """
        from ..baseline import folder_for_test
        from ..outputs import folder_lock, owned_dir

        name = folder_for_test(nodeid)
        if nodeid not in self._locks:
            lock = folder_lock(self.out, name)
            lock.acquire()
            self._locks[nodeid] = lock
        return owned_dir(os.path.join(self.out, name), nodeid)

    def release(self, nodeid: str) -> None:
        """Release the folder lock :meth:`test_dir` took for ``nodeid`` (fixture teardown)."""
        lock = self._locks.pop(nodeid, None)
        if lock is not None:
            lock.release()

    def graph_dir(self, nodeid: str, index: int) -> str:
        """``{out}/graphs/{test}.check{index}``: one TensorBoard run per check (tb-graph-ascend names a run by its
        folder and reads one ``.vis.db`` per folder, two levels below the logdir). Replaced when a previous run
        of ours made it (marker), refused otherwise (under the test folder's lock)."""
        from ..baseline import folder_for_test
        from ..outputs import owned_dir

        return owned_dir(os.path.join(self.out, "graphs", f"{folder_for_test(nodeid)}.check{index}"), nodeid)

    # ------------------------------------------------------------------ collection of results (xdist-safe)
    def pytest_collection_modifyitems(self, items: list) -> None:
        """``@pytest.mark.msprobe(...)`` keys are checked at collection: a typo is that test's error, one line at
        its setup, before it runs anything; the other tests run (a usage error would stop the whole session, and
        under xdist end it in an internal error)."""
        for item in items:
            for mark in item.iter_markers("msprobe"):
                try:
                    check_keys(mark.kwargs, f"{item.nodeid}: @pytest.mark.msprobe")
                except MsprobeError as exc:
                    item.stash[_BAD_MARKER] = f"msprobe: {exc}"
                    break

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        message = item.stash.get(_BAD_MARKER, None)
        if message:
            raise pytest.fail.Exception(message, pytrace=False)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        props = dict(report.user_properties)
        if "msprobe.status" in props:  # a per-API pre-check item
            self.api_counts["items"] += 1
            if report.skipped:
                self.api_counts["skipped"] += 1
                if not self.api_counts["reason"] and isinstance(report.longrepr, tuple):
                    self.api_counts["reason"] = str(report.longrepr[2]).replace("Skipped: ", "")
        if props.get("msprobe.status") == "warning":
            detail = next((v for k, v in report.user_properties if k.startswith("msprobe.") and "warning" in str(v)),
                          "")
            self.api_warnings.append((report.nodeid, str(detail)))
        for name, value in report.user_properties:
            if name == RESULT_PROPERTY:  # the path of the check's msprobe-result.json (see fixture._publish)
                with open(value, encoding="utf-8") as fh:
                    self.results.append(CheckRow.from_json(json.load(fh), value))
            elif name == ERROR_PROPERTY and report.when == "call":
                self.results.append(CheckRow(test=report.nodeid, index="-", error=value, verdict="fail", failure=value))

    api_nothing = ""
    no_checks = ""
    step_summary = None  # where the GitHub job summary went ($GITHUB_STEP_SUMMARY), or why it did not
    report_written = None  # the HTML report's path, or why it was not written

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        if self.api_nothing:
            terminalreporter.write_line(self.api_nothing, red=True)
        if self.no_checks:
            terminalreporter.write_line(self.no_checks, red=self.require_checks, yellow=not self.require_checks)
        if self.api_warnings:
            terminalreporter.section("msprobe api-check warnings")
            for nodeid, detail in self.api_warnings:
                terminalreporter.write_line(f"{nodeid}: {detail}")
        if not self.results:
            return
        tr = terminalreporter
        tr.section("msprobe")
        for r in self.results:
            head = f"{r.test} [check {r.index}]"
            if r.skipped:
                tr.write_line(f"{head}: SKIPPED, nothing compared: {r.skipped} "
                              "(--msprobe-require-device makes this a failure)")
                continue
            if r.error:
                tr.write_line(f"{head}: verdict: fail: the check raised before it concluded: {r.error}")
                continue
            if r.recorded:
                tr.write_line(f"{head}: recorded the bench ({r.bench}, {r.mode}, {r.level}): "
                              f"{_size(r.baseline_bytes)} in {r.baseline}")
                continue
            c = r.counts
            first = r.first_divergence or "none"
            overflow = r.overflow_first or "none"
            tr.write_line(f"{head}: {r.nodes_compared} nodes compared "
                          f"({r.bench} vs {r.target}, {r.mode}, {r.level}): pass {c.get('pass', 0)}, "
                          f"warning {c.get('warning', 0)}, error {c.get('error', 0)}, unmatched {c.get('unmatched', 0)}; "
                          f"first divergence: {first}; first overflow: {overflow}; verdict: "
                          f"{'fail' if r.failed else 'pass'}")
            if r.failure:
                tr.write_line(f"    failure: {r.failure}")
            if r.isolated:
                n_iso = sum(1 for n in r.nodes if n.standard)
                n_skip = sum(1 for n in r.nodes if n.metric == "isolation")
                kernel = f" (bench kernel: {r.bench_kernel})" if r.bench_kernel else ""
                tr.write_line(f"    isolation: {n_iso} API calls judged on their own inputs{kernel}, {n_skip} not "
                              "judgeable (named in the CSV/JUnit); verdicts above are isolated, drift is context")
            for m in r.model:
                tr.write_line(f"    {m.name}: {m.status} (relative L2 error {float(m.value):.3g}, "
                              f"tolerance {m.threshold:.3g})" + (f": {m.message}" if m.status == "skip" else ""))
            if r.api_checks:
                ac = r.api_checks
                counts = {s: sum(a.status == s for a in ac) for s in ("pass", "warning", "error", "skip")}
                tr.write_line(f"    per-API pre-check: {len(ac)} API calls: pass {counts['pass']}, warning "
                              f"{counts['warning']}, error {counts['error']}, skip {counts['skip']}")
            if r.baseline:
                tr.write_line(f"    bench from baseline {r.baseline} ({_size(r.baseline_bytes)})")
            for note in r.notes:
                tr.write_line(f"    note: {note}")
            if r.graph:
                tr.write_line(f"    graph: {r.graph}")
            tr.write_line(f"    artifacts: {r.dir}")
        if any(r.graph for r in self.results):
            tr.write_line(f"msprobe graphs: msprobe-ci view {os.path.join(self.out, 'graphs')} "
                          "(TensorBoard with tb-graph-ascend's plugin; red boxes lead to the first divergence)")
        if self.junitxml:
            tr.write_line(f"msprobe JUnit XML: {os.path.abspath(self.junitxml)}")
        if self.report_written:
            tr.write_line(f"msprobe report: {self.report_written}")
        if self.step_summary:
            tr.write_line(f"msprobe job summary ($GITHUB_STEP_SUMMARY): {self.step_summary}")

    def rotation_run(self, nodeid: str) -> int:
        """How many earlier sessions ran test ``nodeid`` with budgeted isolation (pytest's cache, where it is on:
        ``.pytest_cache``, kept between CI runs by caching that folder), counted once per session: budgeted
        isolation moves its rotation on by it, so consecutive runs judge other calls. 0 without a cache."""
        if nodeid not in self._runs:
            cache = getattr(self.config, "cache", None)
            key = "msprobe/rotation/" + nodeid.replace("/", "|")
            runs = cache.get(key, 0) if cache is not None else 0
            runs = runs if isinstance(runs, int) and not isinstance(runs, bool) and runs >= 0 else 0
            if cache is not None:
                cache.set(key, runs + 1)
            self._runs[nodeid] = runs
        return self._runs[nodeid]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        c = self.api_counts
        controller = not hasattr(session.config, "workerinput")
        if controller and self.asked and not self.results and not c["items"] and \
                exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
            # a gate that checked nothing must say so (and, asked to, not end green)
            self.no_checks = (f"msprobe: no msprobe check ran in this session ({session.testscollected} test(s) "
                              "collected, none called msprobe.check/check_* or compare_dumps): the gate proved "
                              "nothing" + (" [--msprobe-require-checks]" if self.require_checks else
                                           "; --msprobe-require-checks makes this a failure"))
            if self.require_checks:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.api_files and c["items"] and c["skipped"] == c["items"] and \
                not hasattr(session.config, "workerinput"):
            # a gate that judged nothing must not end green
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            self.api_nothing = (f"msprobe: --msprobe-api-check judged nothing: all {c['items']} API calls were "
                                f"skipped ({c['reason']}); add --msprobe-api-live (re-runs the target on "
                                "--msprobe-target) or check a dump recorded with --msprobe-task=tensor")
        if controller and self.results and self.report:
            from ..errors import MsprobeError
            from .report import write_report

            try:
                self.report_written = write_report(self.report, self.results, self.out, self.junitxml)
            except (MsprobeError, OSError) as exc:
                self.report_written = f"not written ({exc})"
        if controller and (self.results or self.no_checks):
            from .summary import append_to_step_summary, markdown

            try:
                written = self.report_written if self.report_written == self.report else None
                self.step_summary = append_to_step_summary(markdown(self.results, self.out, self.junitxml,
                                                                    self.no_checks, written))
            except OSError as exc:
                self.step_summary = f"not written ({exc})"
        if not self.junitxml or hasattr(session.config, "workerinput"):
            return
        from .junit import write_junit

        write_junit(self.junitxml, self.results)


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


def _api_overrides(config: pytest.Config) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """ini ``msprobe_api_standards`` / ``msprobe_api_thresholds`` lines, validated.

    Raises:
        pytest.UsageError: a line that is not ``KEY = VALUE``, an unknown standard, a non-number threshold.
    """
    from ..checkers import STANDARDS

    standards: dict[str, str] = {}
    for line in config.getini("msprobe_api_standards"):
        pattern, sep, name = (x.strip() for x in line.partition("="))
        if not sep or name not in STANDARDS:
            raise pytest.UsageError(f"msprobe: ini msprobe_api_standards: {line!r}: expected 'PATTERN = STANDARD' "
                                    f"with STANDARD one of {sorted(STANDARDS)}")
        standards[pattern] = name
    thresholds: dict[str, dict[str, float]] = {}
    for line in config.getini("msprobe_api_thresholds"):
        key, sep, value = (x.strip() for x in line.partition("="))
        std, dot, name = key.partition(".")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not dot or std not in STANDARDS or number is None:
            raise pytest.UsageError(f"msprobe: ini msprobe_api_thresholds: {line!r}: expected "
                                    f"'STANDARD.THRESHOLD = NUMBER' with STANDARD one of {sorted(STANDARDS)}")
        thresholds.setdefault(std, {})[name] = number
    return standards, thresholds
