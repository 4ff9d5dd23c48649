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
    "check": ([f"msprobe_ci/check/{m}.py" for m in ("outcome", "sides", "training", "generation", "settings")],
              ["tests/test_rules.py"]),
    "junit": (["msprobe_ci/pytest_plugin/junit.py", "msprobe_ci/junit.py"], ["tests/test_rules.py"]),
    "checkers": ([f"msprobe_ci/checkers/{m}.py" for m in (
        "__init__", "absolute", "accumulative", "benchmark", "binary", "common", "dropout", "legacy", "result",
        "quantization", "thousandth", "ulp")], _STANDARD_TESTS),
    "judge": (["msprobe_ci/judge/pair.py", "msprobe_ci/judge/allowances.py"], ["tests/test_standards.py"]),
    "status": (["msprobe_ci/status.py"], ["tests/test_rules.py::test_one_status_vocabulary"]),
    "budget": (["msprobe_ci/isolate/budget.py"], [f"tests/test_isolation_budget.py::{t}" for t in (
        "test_every_kind_each_step_the_rest_rotating_deterministically",
        "test_the_factor_holds_within_a_step_and_the_share_follows_what_was_spent",
        "test_a_factor_that_is_not_above_one_is_refused_in_one_line", "test_the_budgets_figures_and_rules_exactly")]),
    "isolated": (["msprobe_ci/compare/isolated.py", "msprobe_ci/compare/isolation_file.py"], [
        "tests/test_rules.py",
        "tests/test_isolation.py::test_scalar_sources_match_constants_by_role_and_clamps_at_the_top_of_the_range",
        "tests/test_isolation_budget.py::test_a_left_out_call_keeps_the_drift_verdict_and_rolls_up",
        "tests/test_isolation_budget.py::test_isolation_json_holds_the_budget_and_the_compare_reads_it"]),
}


_PIPELINE = ("pipeline, not a rule: it runs models and writes dumps, and the rules it calls are mutated where they "
             "live; pinned end to end by tests/test_failure_paths.py, test_plugin.py and test_training.py (each "
             "mutant would cost minutes)")
#: functions not mutated, with the reason (the work folder's copy gets mutmut's ``no mutate`` pragmas around them)
OUT_OF_SCOPE: dict[str, dict[str, str]] = {
    "msprobe_ci/check/outcome.py": {f: _PIPELINE for f in ("judge", "evaluate")},
    "msprobe_ci/check/sides.py": {f: _PIPELINE for f in ("run_side", "unapplied_faults")},
    "msprobe_ci/check/training.py": {f: _PIPELINE for f in ("run_training", "check_training", "_require_module")},
    "msprobe_ci/check/generation.py": {f: _PIPELINE for f in ("run_decode", "check_generate")},
    "msprobe_ci/compare/isolated.py": {"replay": "pipeline, not a rule: it builds an ApiReplayer and runs every call "
                                                 "(the judge it uses is mutated as 'judge'); pinned end to end by "
                                                 "tests/test_isolation.py and test_msprobe_interop.py"},
}

#: mutant name -> why it cannot change what the program does (left out of the score)
_DEFAULT_DTYPE = "the constructor's default dtype key: any key the table lacks takes fp32's thresholds, the default's own"
_L0 = "the API name that picks the benchmark level: '' and 'XXXX' are both on no list, level L0"
_SENTINEL = "the marker of a non-normal element (-1 or -2): every negative value is dropped before the mean and max"
_F64 = "a tensor divided by the float64 scale is float64 whatever its own dtype (the scale comes in float64)"
_BINARY = "the binary standard takes and ignores the oracle: both branches call it alike"
_ULP_BENCH = "the ULP standard measures against the oracle when there is one: the bench argument is unused"
_OUT = "out=: the squared call writes the same values into it, and returns them"
_UNREACHED_EMPTY = "an empty output never reaches the share: its max abs error (0) passes first"
_FIRST_LINE = "the first line of a frame string: the same for maxsplit 1, 2 or none"
_HOPS = ("the hop bound on construct.json cycles (1000 / 10,000): shifting it by one or two hops changes nothing "
         "but how far a cycle is followed; test_roll_up_is_bounded_on_a_construct_cycle pins that it ends")
_UTF8 = "the encoding: the same where the locale is UTF-8 (this machine, CI); 'UTF-8' is 'utf-8'"
_XML = ("the junit-xml report's encoding: ElementTree parses the str or the bytes alike, and the declaration is "
        "written again below")
EQUIVALENT: dict[str, str] = {
    "msprobe_ci.isolate.budget.xǁIsolationBudgetǁ__init____mutmut_10":
        "'UTF-8' for 'utf-8': Python's codec names are case-insensitive",
    "msprobe_ci.isolate.budget.xǁIsolationBudgetǁpriority__mutmut_9":
        "'UTF-8' for 'utf-8': Python's codec names are case-insensitive",
    "msprobe_ci.isolate.budget.xǁIsolationBudgetǁpriority__mutmut_15":
        "step / GOLDEN for step * GOLDEN: 1 / 0.618... = 1 + 0.618..., so the two differ by the whole number "
        "step, which mod 1 removes (up to float rounding)",
    "msprobe_ci.isolate.budget.xǁIsolationBudgetǁ__init____mutmut_27":
        "_started = None for False: both are falsy, and start() reads it only for truth",
    "msprobe_ci.overflow.x_check_entry__mutmut_39":
        "bad_out = None instead of [] for ignored outputs: both are falsy and bad_out is only read for truth "
        "or when truthy",
    "msprobe_ci.check.outcome.x__l2_in_chunks__mutmut_20":
        "tc.to(None) keeps the target's dtype: every use meets the float64 bench (promoted) or isfinite (the same)",
    "msprobe_ci.check.outcome.x_read_coverage__mutmut_15": _UTF8,
    "msprobe_ci.check.outcome.x_read_coverage__mutmut_17": _UTF8,
    "msprobe_ci.check.outcome.x_read_coverage__mutmut_19": _UTF8,
    "msprobe_ci.check.outcome.x_read_coverage__mutmut_61":
        "the first line of the message: no exception that reaches it (OSError, JSON, ours) has a second one",
    **{f"msprobe_ci.check.outcome.xǁSideRunǁfinal_outputs__mutmut_{i}": "torch.load's own default is weights_only=True "
       "since torch 2.6 (the project pins 2.13): the same load" for i in (4, 6)},
    "msprobe_ci.check.outcome.xǁSideRunǁfinal_outputs__mutmut_11":
        "the first line of a message-less loader error: torch.load raises none without a message",
    "msprobe_ci.check.outcome.x_read_coverage__mutmut_63":
        "repr(exc) of a message-less exception: none reaches it (each has a message)",
    "msprobe_ci.junit.x_write_junit_xml__mutmut_4": _XML,
    "msprobe_ci.junit.x_write_junit_xml__mutmut_6": _XML,
    "msprobe_ci.junit.x_write_junit_xml__mutmut_8": _XML,
    # checkers/
    **{f"msprobe_ci.checkers.{m}.xǁ{cls}ǁ__init____mutmut_{i}": _DEFAULT_DTYPE
       for m, cls in (("absolute", "AbsoluteThresholdStandard"), ("accumulative", "AccumulativeStandard"),
                      ("benchmark", "BenchmarkStandard"), ("binary", "BinaryStandard"), ("dropout", "DropoutStandard"),
                      ("thousandth", "ThousandthStandard"), ("ulp", "UlpStandard")) for i in (1, 2)},
    "msprobe_ci.checkers.x_make_standard__mutmut_1": _L0,
    "msprobe_ci.checkers.benchmark.xǁBenchmarkStandardǁ__init____mutmut_3": _L0,
    "msprobe_ci.checkers.accumulative.xǁAccumulativeStandardǁ__call____mutmut_32":
        "count_nonzero of an empty array is 0 with or without the size test",
    "msprobe_ci.checkers.accumulative.xǁAccumulativeStandardǁ__call____mutmut_51":
        "the name given to judge_absolute: the result is rebuilt under this standard's own name",
    "msprobe_ci.checkers.benchmark.xǁ_Referenceǁ__init____mutmut_14":
        "without a scale, den is |ref|: the same finite and small masks as ref's",
    "msprobe_ci.checkers.benchmark.xǁ_Referenceǁ__init____mutmut_27":
        "+ eps on a denominator of at least the row floor: moves a relative error by 2^-52 of itself",
    "msprobe_ci.checkers.benchmark.x__partial__mutmut_23": _SENTINEL,
    "msprobe_ci.checkers.benchmark.x__partial__mutmut_36": _SENTINEL,
    "msprobe_ci.checkers.benchmark.x__partial__mutmut_25":
        "recomputing re_max where it is re: the same array",
    "msprobe_ci.checkers.benchmark.x__partial__mutmut_71":
        "zeros left out of the max: the max of non-negative values is the same, 0 when none remain",
    "msprobe_ci.checkers.benchmark.xǁBenchmarkStandardǁ__call____mutmut_1":
        "a tensor converted to float64 whole before it is sliced: the same values (the slices bound memory only)",
    **{f"msprobe_ci.checkers.benchmark.xǁBenchmarkStandardǁ__call____mutmut_{i}":
       "where the bench, reference and scale are judged: observable with a second real device only (a CPU one is "
       "where the CPU target is); test_elementwise_standards_judge_on_the_device_as_on_the_cpu holds it on CUDA"
       for i in (35, 37, 39, 41, 53, 55, 57)},
    "msprobe_ci.checkers.benchmark.xǁ_Referenceǁ__init____mutmut_1":
        "the default of atol: its one caller (BenchmarkStandard) always passes it",
    "msprobe_ci.checkers.benchmark.xǁ_Referenceǁ__init____mutmut_15":
        "without an error scale the denominator is |ref|: keyed by it or by ref, the same finite mask and |key|",
    "msprobe_ci.checkers.benchmark.xǁ_Referenceǁ__init____mutmut_28":
        "the max's denominator divides normal elements only, each above small_value: +-2.2e-16 moves a relative "
        "error by at most 1e-16 of itself, below any threshold's resolution",
    "msprobe_ci.checkers.legacy.x__share_within__mutmut_2": _UNREACHED_EMPTY,
    "msprobe_ci.checkers.legacy.x__share_within__mutmut_6": _UNREACHED_EMPTY,
    "msprobe_ci.checkers.ulp.xǁUlpStandardǁ__call____mutmut_29":
        "the exponent at non-finite positions (0 or 1): those positions are dropped from the ULP errors",
    **{f"msprobe_ci.checkers.common.x_to_f64__mutmut_{i}": "to_f64 of a tensor already on the CPU: on the CPU "
       "either way; observable with a second real device only, held on CUDA by "
       "test_elementwise_standards_judge_on_the_device_as_on_the_cpu" for i in (2, 4)},
    **{m: "where the reference is judged: observable with a second real device only (a CPU one is where the CPU "
          "target is); test_elementwise_standards_judge_on_the_device_as_on_the_cpu holds it on CUDA"
       for m in ("msprobe_ci.checkers.absolute.x_judge_absolute__mutmut_9",
                 "msprobe_ci.checkers.absolute.x_judge_absolute__mutmut_11",
                 "msprobe_ci.checkers.binary.xǁBinaryStandardǁ__call____mutmut_14")},
    # judge/: the per-API judge
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_108": _L0,
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_183":
        "an error scale of another shape: the benchmark standard drops it itself",
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_201":
        "an all-zero gradient divided by 0: every element turns NaN or inf on all three sides alike",
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_230": "dividing by a unit of 1: the same values",
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_231": "_own_scale never returns more than 1",
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_234":
        "the unit is a power of two: dividing in the target's dtype is exact",
    **{f"msprobe_ci.judge.pair.x_judge_pair__mutmut_{i}": _F64 for i in (253, 255, 285, 287, 292)},
    **{f"msprobe_ci.judge.pair.x_judge_pair__mutmut_{i}": "where the terms' scale is judged: observable with a "
       "second real device only; the CUDA isolation test holds it" for i in (252, 254)},
    **{f"msprobe_ci.judge.pair.x_judge_pair__mutmut_{i}":
       "the judge's errstate: the standards suppress their own masked inf - inf, and nothing else in them warns "
       "(test_judge_pair_units_and_references_exactly runs every standard on inf/NaN with warnings as errors)"
       for i in (303, 304, 306, 307)},
    **{f"msprobe_ci.judge.pair.x_judge_rows__mutmut_{i}":
       "an empty string for 'no scale'/'no allowance': judge_pair uses only tensors there, so it is None to it"
       for i in (2, 16, 61)},
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_315": _BINARY,
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_316": _BINARY,
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_327": _ULP_BENCH,
    "msprobe_ci.judge.pair.x_judge_pair__mutmut_331": _ULP_BENCH,
    "msprobe_ci.judge.pair.x__own_scale__mutmut_6": "a top of exactly 1 gives 2^0 = 1 either way",
    "msprobe_ci.judge.pair.x__own_scale__mutmut_7": "a top in [1, 2) gives 2^0 = 1 either way",
    "msprobe_ci.judge.pair.x__own_scale__mutmut_24":
        "min with 1 or 2: 2^floor(log2(max(top, lowest))) is under 1 for every top under 1 (lowest < 1)",
    "msprobe_ci.judge.pair.x_judged_as__mutmut_19": "checker_key reads dtype names case-insensitively",
    "msprobe_ci.judge.pair.x_saturate__mutmut_6":
        "a peak exactly at the dtype's max: rounding overflows nothing, the oracle comes back unchanged",
    "msprobe_ci.judge.pair.x_saturate__mutmut_22":
        "torch.where promotes the rounded values back to the oracle's float64",
    "msprobe_ci.judge.allowances.x_accumulation_floor__mutmut_36": _OUT,
    "msprobe_ci.judge.allowances.x_accumulation_floor__mutmut_37": _OUT,
    "msprobe_ci.judge.allowances.x_accumulation_scale__mutmut_24": "sum/mean/cumsum always return a tensor",
    # compare/isolated.py, compare/isolation_file.py
    **{f"msprobe_ci.compare.isolation_file.x_load_isolation__mutmut_{i}": _UTF8 for i in (9, 11, 13)},
    "msprobe_ci.compare.isolated.x__call_site__mutmut_10": _FIRST_LINE,
    "msprobe_ci.compare.isolated.x__call_site__mutmut_14": _FIRST_LINE,
    "msprobe_ci.compare.isolated.x__call_site__mutmut_16": "rstrip of a set of characters that holds ','",
    "msprobe_ci.compare.isolated.x_apply_isolation__mutmut_95":
        "getattr without a default: every compare report has target_stack",
    "msprobe_ci.compare.isolated.x_apply_isolation__mutmut_87":
        "a record without sources on the twin path: no scalar to compare, the source verdict stays None",
    **{f"msprobe_ci.compare.isolated.x_apply_isolation__mutmut_{i}": _HOPS for i in (323, 325, 326, 332)},
    **{f"msprobe_ci.compare.isolated.x_apply_isolation__mutmut_{i}":
       "a skip record's threshold, budget and passing threshold: the dataclass defaults are the same (inf, inf, 0)"
       for i in (226, 227, 228, 231)},
    "msprobe_ci.compare.isolated.x__site_twin__mutmut_35": "k = -1 or -2: any negative index finds no twin",
    "msprobe_ci.junit.x_write_junit_xml__mutmut_12":
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
    for name, status in survivors:
        print(f"  {status}: {name}: {_diff(args.workdir, name)}")
    return 0 if worst >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
