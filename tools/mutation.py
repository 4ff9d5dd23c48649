"""Mutation testing of the rule modules with mutmut: one command, a score per module, survivors listed.

    python tools/mutation.py                       # every rule module (see MODULES), 2 workers
    python tools/mutation.py --modules verdict overflow --jobs 1

mutmut (``pip install -e ".[mutation]"``) changes one operator, constant or argument at a time (a *mutant*) and
runs the tests that reach the changed function; a mutant is *killed* when a test fails. A survivor is either a
rule no test pins (write the test) or an equivalent mutant (the program means the same: listed in
``EQUIVALENT`` below with the reason, and left out of the score).

mutmut copies the sources into ``mutants/`` and imports them from there, by file path. The package maps
``pytest_plugin/`` and ``checkers/`` into ``msprobe_ci`` (``pyproject.toml``'s package-dir), which mutmut's
copy cannot follow, so the run happens in a work folder (``--workdir``, default ``.mutation/``, recreated each
run) holding one plain ``msprobe_ci`` package, ``tests/`` and a ``pyproject.toml`` with the ``[tool.mutmut]``
section this script writes. Exit status 1 when a module scores under ``--goal`` (default 90%).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: module key -> (files in the work folder's package, the tests that pin them)
_STANDARD_TESTS = ["tests/test_standards.py", *(f"tests/test_api_check.py::{t}" for t in (
    "test_standard_passes_rounding_and_fails_a_one_percent_error", "test_result_reports_the_loosest_passing_threshold",
    "test_binary_dropout_and_registry"))]
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "verdict": (["msprobe_ci/compare/verdict.py"], ["tests/test_rules.py"]),
    "overflow": (["msprobe_ci/overflow.py"], ["tests/test_rules.py"]),
    "check": (["msprobe_ci/check.py"], ["tests/test_rules.py"]),
    "junit": (["msprobe_ci/pytest_plugin/junit.py"], ["tests/test_rules.py"]),
    "checkers": ([f"msprobe_ci/checkers/{m}.py" for m in (
        "__init__", "absolute", "accumulative", "benchmark", "binary", "common", "dropout", "legacy", "result",
        "thousandth", "ulp")], _STANDARD_TESTS),
    "judge": (["msprobe_ci/replay/runner.py"], ["tests/test_standards.py"]),
    "isolated": (["msprobe_ci/compare/isolated.py"], [
        "tests/test_rules.py",
        "tests/test_isolation.py::test_scalar_sources_match_constants_by_role_and_clamps_at_the_top_of_the_range"]),
}

#: for a file that holds more than rules: the only module-level functions mutated (the others are fenced off)
ONLY: dict[str, tuple[str, ...]] = {
    "msprobe_ci/replay/runner.py": ("judge_pair", "_own_scale", "judged_as", "saturate", "accumulation_floor",
                                    "accumulation_scale"),
}

_PIPELINE = ("pipeline, not a rule: it runs models and writes dumps, and the rules it calls are mutated where they "
             "live; pinned end to end by tests/test_failure_paths.py, test_plugin.py and test_training.py (each "
             "mutant would cost minutes)")
#: functions not mutated, with the reason (the work folder's copy gets mutmut's ``no mutate`` pragmas around them)
OUT_OF_SCOPE: dict[str, dict[str, str]] = {
    "msprobe_ci/check.py": {f: _PIPELINE for f in ("run_side", "judge", "evaluate", "run_training", "run_decode",
                                                   "unapplied_faults")},
    "msprobe_ci/compare/isolated.py": {"replay": "pipeline, not a rule: it builds an ApiReplayer and runs every call "
                                                 "(the judge it uses is mutated as 'judge'); pinned end to end by "
                                                 "tests/test_isolation.py and test_msprobe_interop.py"},
}

#: mutant name -> why it cannot change what the program does (left out of the score)
_UTF8 = "the encoding: the same where the locale is UTF-8 (this machine, CI); 'UTF-8' is 'utf-8'"
_XML = ("the junit-xml report's encoding: ElementTree parses the str or the bytes alike, and the declaration is "
        "written again below")
EQUIVALENT: dict[str, str] = {
    "msprobe_ci.overflow.x_check_entry__mutmut_39":
        "bad_out = None instead of [] for ignored outputs: both are falsy and bad_out is only read for truth "
        "or when truthy",
    "msprobe_ci.check.x_model_cases__mutmut_38":
        "t.to(None) keeps the target's dtype: every use meets the float64 bench (promoted) or isfinite (the same)",
    "msprobe_ci.check.x_read_coverage__mutmut_15": _UTF8,
    "msprobe_ci.check.x_read_coverage__mutmut_17": _UTF8,
    "msprobe_ci.check.x_read_coverage__mutmut_19": _UTF8,
    "msprobe_ci.check.x_read_coverage__mutmut_61":
        "the first line of the message: no exception that reaches it (OSError, JSON, ours) has a second one",
    "msprobe_ci.check.x_read_coverage__mutmut_63":
        "repr(exc) of a message-less exception: none reaches it (each has a message)",
    "msprobe_ci.pytest_plugin.junit.x_write_junit__mutmut_347": _XML,
    "msprobe_ci.pytest_plugin.junit.x_write_junit__mutmut_349": _XML,
    "msprobe_ci.pytest_plugin.junit.x_write_junit__mutmut_351": _XML,
    "msprobe_ci.pytest_plugin.junit.x_write_junit__mutmut_355":
        "iter(None) walks every element: the others (suites, properties, failures) carry no classname, so the "
        "property lookup misses them as before",
}


def _workspace(workdir: str, files: list[str], tests: list[str]) -> None:
    """A fresh work folder: the package as one tree, the tests, and pyproject.toml with [tool.mutmut]."""
    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    os.makedirs(workdir)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(ROOT, "msprobe_ci"), os.path.join(workdir, "msprobe_ci"), ignore=ignore)
    for sub in ("pytest_plugin", "checkers"):
        shutil.copytree(os.path.join(ROOT, sub), os.path.join(workdir, "msprobe_ci", sub), ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(workdir, "tests"), ignore=ignore)
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        project = fh.read()
    start = project.index("[tool.pytest.ini_options]")
    end = project.find("\n[", start + 1)
    pytest_section = project[start:] if end < 0 else project[start:end + 1]
    mutmut = ("\n[tool.mutmut]\n"
              'source_paths = ["msprobe_ci"]\n'
              f"only_mutate = {json.dumps(files)}\n"
              f"pytest_add_cli_args_test_selection = {json.dumps(sorted(set(tests)))}\n"
              'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n')
    with open(os.path.join(workdir, "pyproject.toml"), "w", encoding="utf-8") as fh:
        fh.write(pytest_section + mutmut)
    for f in files:
        fenced = dict(OUT_OF_SCOPE.get(f, {}))
        if f in ONLY:
            import ast

            with open(os.path.join(workdir, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            fenced.update({n.name: "not a rule of this module's judge" for n in tree.body
                           if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in ONLY[f]})
        if fenced:
            _fence(os.path.join(workdir, f), fenced)


def _fence(path: str, functions: dict[str, str]) -> None:
    """Put ``# pragma: no mutate start`` / ``end`` around the module-level ``functions`` of ``path`` (decorators
    included)."""
    import ast

    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines(keepends=True)
    spans = []
    for node in ast.parse("".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in functions:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno))
    missing = set(functions) - {n.name for n in ast.parse("".join(lines)).body if hasattr(n, "name")}
    if missing:
        raise SystemExit(f"mutation: OUT_OF_SCOPE names {sorted(missing)}, not in {path}")
    for first, last in sorted(spans, reverse=True):
        lines.insert(last, "# pragma: no mutate end\n")
        lines.insert(first - 1, "# pragma: no mutate start\n")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("".join(lines))


def _results(workdir: str, files: list[str]) -> dict[str, dict[str, str]]:
    """``{file: {mutant name: status}}`` from mutmut's per-file ``.meta`` records (its own status names)."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for f in files:
        with open(os.path.join(workdir, "mutants", f + ".meta"), encoding="utf-8") as fh:
            meta = json.load(fh)
        out[f] = {name: status_by_exit_code[code] for name, code in meta["exit_code_by_key"].items()}
    return out


#: mutmut statuses that mean the tests noticed the mutant (a timeout: the mutant made them hang)
_DETECTED = ("killed", "caught by type check", "timeout")


def _diff(workdir: str, name: str) -> str:
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=workdir, capture_output=True,
                           text=True).stdout
    return "; ".join(line[1:].strip() for line in shown.splitlines()
                     if line[:1] in "+-" and not line.startswith(("+++", "---")))[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", choices=sorted(MODULES), default=sorted(MODULES))
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--workdir", default=os.path.join(ROOT, ".mutation"))
    parser.add_argument("--goal", type=float, default=0.9, help="least killed share per module (default 0.9)")
    parser.add_argument("--report", action="store_true",
                        help="score the work folder's last run again (after editing EQUIVALENT), without running")
    args = parser.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print('mutation: mutmut is not installed: pip install -e ".[mutation]"', file=sys.stderr)
        return 2
    files = [f for m in args.modules for f in MODULES[m][0]]
    tests = [t for m in args.modules for t in MODULES[m][1]]
    took = 0.0
    if not args.report:
        _workspace(args.workdir, files, tests)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)],
                             cwd=args.workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        took = time.perf_counter() - start
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            print(f"mutation: mutmut run failed (exit {run.returncode})", file=sys.stderr)
            return 2
    results = _results(args.workdir, files)
    worst = 1.0
    print(f"{'module':42} {'mutants':>8} {'killed':>7} {'equiv.':>7} {'survived':>9} {'score':>7}")
    survivors = []
    for f in files:
        statuses = results[f]
        equivalent = [n for n in statuses if n in EQUIVALENT]
        counted = {n: s for n, s in statuses.items() if n not in EQUIVALENT}
        killed = sum(s in _DETECTED for s in counted.values())
        left = [n for n, s in counted.items() if s not in _DETECTED]
        score = killed / len(counted) if counted else 1.0
        worst = min(worst, score)
        print(f"{f:42} {len(statuses):8d} {killed:7d} {len(equivalent):7d} {len(left):9d} {score:7.1%}")
        survivors += [(n, counted[n]) for n in left]
    print(f"({took:.0f} s, {args.jobs} workers; equivalent mutants are listed in tools/mutation.py EQUIVALENT)")
    for f in files:
        for fn, why in OUT_OF_SCOPE.get(f, {}).items():
            print(f"  not mutated: {f}: {fn}: {why}")
        if f in ONLY:
            print(f"  mutated in {f}: only {', '.join(ONLY[f])} (the per-API judge; the replayer is a pipeline)")
    for name, status in survivors:
        print(f"  {status}: {name}: {_diff(args.workdir, name)}")
    return 0 if worst >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
