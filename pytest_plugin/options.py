"""The plugin's options, declared once: each ``--msprobe-*`` flag with its ini key, parser, default and help
(:data:`OPTIONS`, :data:`FLAGS`, :data:`RULE_INI`). :mod:`.plugin` registers them with pytest,
:class:`~msprobe_ci.pytest_plugin.session.ProbeSession` reads every row in one loop. Torch-free, like the plugin."""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

from ..config import BENCH_KERNELS as _KERNELS  # torch-free
from ..dtypes import OPTION_NAMES as _DTYPES  # torch-free

# flag spellings, reused by the tests
BENCH, TARGET = "--msprobe-bench", "--msprobe-target"
BENCH_DTYPE, TARGET_DTYPE = "--msprobe-bench-dtype", "--msprobe-target-dtype"
BENCH_AUTOCAST, TARGET_AUTOCAST = "--msprobe-bench-autocast", "--msprobe-target-autocast"
LEVEL, TASK, CONFIG = "--msprobe-level", "--msprobe-task", "--msprobe-config"
OUT, JUNIT, INJECT = "--msprobe-out", "--msprobe-junitxml", "--msprobe-inject"
BASELINE, RECORD, COMPILE = "--msprobe-baseline", "--msprobe-record", "--msprobe-target-compile"
TARGET_FP8 = "--msprobe-target-fp8"
NO_GRAPH, ISOLATE, OUTPUT_RTOL = "--msprobe-no-graph", "--msprobe-isolate", "--msprobe-output-rtol"
REQUIRE_DEVICE, BENCH_KERNEL = "--msprobe-require-device", "--msprobe-bench-kernel"
REQUIRE_COVERAGE, REQUIRE_CHECKS = "--msprobe-require-coverage", "--msprobe-require-checks"
API_CHECK, API_LIVE, FUZZ = "--msprobe-api-check", "--msprobe-api-live", "--msprobe-fuzz"
FREE_BENCHMARK, MONITOR = "--msprobe-free-benchmark", "--msprobe-monitor"
REPORT = "--msprobe-report"



def _device(value: str) -> str:
    from ..backends import parse_device
    from ..errors import MsprobeError

    try:
        return parse_device(value)
    except MsprobeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return v


def _factor(value: str) -> float:
    from ..config import check_factor
    from ..errors import MsprobeError

    try:
        return check_factor(value, "expected")
    except MsprobeError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def _choice(allowed):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return value
    return check


class Option(NamedTuple):
    """One ``--msprobe-*`` option taking a value: its flag, ini key, parser (flag and ini alike), default, metavar,
    help, and ``check``: the :data:`~msprobe_ci.check.settings.CHECK_OPTIONS` key whose run-wide value it sets
    (``None``: a session option). Declared here once: the session reads every row in one loop, the fixture passes
    the ``check`` rows on as the run's layer of each check's options."""

    flag: str
    ini: str
    parse: Callable[[str], Any]
    default: Any
    metavar: str
    help: str
    check: str | None = None


class Flag(NamedTuple):
    """One boolean ``--msprobe-*`` flag (``store_true``, ini ``bool``), as :class:`Option`."""

    flag: str
    ini: str
    help: str
    check: str | None = None


OPTIONS = [
    Option(BENCH, "msprobe_bench", _device, "cpu", "DEVICE", "device of the bench (reference) side: cpu, gpu, cuda[:N], npu[:N].", check="bench"),
    Option(TARGET, "msprobe_target", _device, "cpu", "DEVICE", "device of the target side under test.", check="target"),
    Option(BENCH_DTYPE, "msprobe_bench_dtype", _choice(_DTYPES), None, "DTYPE", "cast the bench model and floating inputs to fp64/fp32/fp16/bf16 (default: the model's own).", check="bench_dtype"),
    Option(TARGET_DTYPE, "msprobe_target_dtype", _choice(_DTYPES), None, "DTYPE", "cast the target model and floating inputs (default: the model's own).", check="target_dtype"),
    Option(BENCH_AUTOCAST, "msprobe_bench_autocast", _choice(("fp16", "bf16")), None, "DTYPE", "automatic mixed precision on the bench: its forward and loss run under torch.autocast in fp16 or bf16 on the model's own weights (fp16 training with a GradScaler); default none.", check="bench_autocast"),
    Option(TARGET_AUTOCAST, "msprobe_target_autocast", _choice(("fp16", "bf16")), None, "DTYPE", "automatic mixed precision on the target (as --msprobe-bench-autocast): the question an AMP user asks first, an AMP target against an fp32 bench. Each call made under autocast is judged on its inputs as its kernel saw them.", check="target_autocast"),
    Option(LEVEL, "msprobe_level", _choice(("L0", "L1", "mix")), "mix", "LEVEL", "capture level: L0 modules, L1 torch APIs, mix both.", check="level"),
    Option(TASK, "msprobe_task", _choice(("statistics", "tensor", "md5")), "statistics", "TASK", "statistics, tensor (also saves .pt files, real-data metrics) or md5.", check="task"),
    Option(CONFIG, "msprobe_config", str, None, "PATH", "an msprobe config.json (task, level, scope, list, data_mode, summary_mode)."),
    Option(OUT, "msprobe_out", str, "msprobe-out", "DIR", "folder for all artifacts, one sub-folder per test."),
    Option(JUNIT, "msprobe_junitxml", str, None, "PATH", "write a JUnit XML file: one testsuite per test, one testcase per compared node."),
    Option(INJECT, "msprobe_inject", str, None, "FAULTS.yaml", "perturb chosen target-side API outputs (docs/gate-your-model.md) to prove the gate catches a regression."),
    Option(API_CHECK, "msprobe_api_check", str, None, "PATH", "per-API pre-check: collect every API call of this dump (dump.json, rank or step folder) as a test item judged by its own accuracy standard; a failing item writes a standalone reproduction (<msprobe-out>/api-check/<dump folder>/repro/<node>.py, safetensors inputs) and names it."),
    Option(FUZZ, "msprobe_fuzz", int, None, "N", "with --msprobe-api-check: N further hypothesis input sets per API forward within the dumped dtypes, shapes and ranges; a failure is shrunk and its minimal inputs written as the item's reproduction (<msprobe-out>/api-check/<dump folder>/repro/<node>.py)."),
    Option(ISOLATE, "msprobe_isolate", _choice(("on", "off")), "on", "on|off", "judge every target API call on its own inputs (fp64 CPU oracle, per-API standard) while the target runs; 'off' falls back to the whole-network drift rule.", check="isolate"),
    Option("--msprobe-isolate-budget", "msprobe_isolate_budget", _factor, None, "FACTOR", "budgeted isolation for large jobs: the first call of every API kind is judged on its own inputs each step, the other calls rotate across steps (seeded by the test id) as far as keeps the isolated target step within FACTOR times its capture alone (e.g. 1.5); the judged share is stated in the terminal, JUnit, report.html and the job summary, and a call not judged in a step is judged by the drift rule. Default: every call isolated.", check="isolate_budget"),
    Option(BENCH_KERNEL, "msprobe_bench_kernel", _choice(_KERNELS), None, "KERNEL", "the same-dtype bench the benchmark standard compares each isolated API with: 'device' (the bench device's kernels), 'upcast' (one precision up, rounded once: a GPU-like kernel), 'rounded' (fp64, correctly rounded), 'decomposed' (core-ATen decompositions with oneDNN off: other real CPU kernels). Default: 'device', or 'upcast' where the target runs on the bench device's own kernels while named as an accelerator (the stand-in npu).", check="bench_kernel"),
    Option("--msprobe-oracle-device", "msprobe_oracle_device", _choice(("cpu", "target")), None, "cpu|target", "where each isolated API's oracle runs: 'cpu' (float64, or float32 for half-precision calls) or 'target' (the target's device in the highest precision it offers: float64 on CUDA, float32 on an NPU as msprobe's own bench upcast; per API on the CPU where the device lacks that precision or the op, said in the report). Default: 'target' on CUDA, 'cpu' elsewhere (unmeasured on an accelerator here).", check="oracle_device"),
    Option(OUTPUT_RTOL, "msprobe_output_rtol", _float, None, "RTOL", "model-level testcase: the relative L2 error of the final outputs (and loss) that fails a check (default: 16 x the coarser dtype's unit roundoff, at least 1e-5).", check="output_rtol"),
    Option(REPORT, "msprobe_report", str, None, "PATH|off", "the session's HTML report (one self-contained page: every check's verdict, first divergence, a plot of each node's error against its threshold, worst nodes, model-level cases, links). Default: <msprobe-out>/report.html; 'off' writes none."),
    Option(BASELINE, "msprobe_baseline", str, None, "DIR", "bench baselines: with --msprobe-record store the bench side there (one folder per test); without it read the bench side from there instead of running it."),
]
#: ini key -> the parser of its flag: the session parses an ini value with it too (one declaration, one parse)
PARSERS = {o.ini: o.parse for o in OPTIONS if o.parse is not str}
FLAGS = [
    Flag(RECORD, "msprobe_record", "run only the bench side of each check and store it under --msprobe-baseline."),
    Flag(API_LIVE, "msprobe_api_live", "with --msprobe-api-check: re-run the target side on --msprobe-target (default cpu) in the dumped dtypes instead of reading recorded outputs (statistics dumps, fuzzing)."),
    Flag(NO_GRAPH, "msprobe_no_graph", "do not write the compare_<ts>.vis.db graph of each check (written by default under <msprobe-out>/graphs/, one TensorBoard run per check)."),
    Flag(REQUIRE_DEVICE, "msprobe_require_device", "an absent bench or target device fails the check instead of skipping it (a CI gate must not end green on nothing)."),
    Flag(REQUIRE_CHECKS, "msprobe_require_checks", "a session in which no msprobe check ran (no selected test used the fixture or the marker: a refactor dropped it, -k deselected it) fails with exit code 1; without it the summary says so whenever an msprobe option was given."),
    Flag(REQUIRE_COVERAGE, "msprobe_require_coverage", "fail a check whose target ran floating-point work outside every captured API (coverage below 100%, the uncaptured ATen ops named); without it that is a warning."),
    Flag(MONITOR, "msprobe_monitor", "msprobe.check_training also runs the training monitor on both sides (activation, gradient and optimizer-state statistics per step; NaN/Inf and 10x-median jump alerts): a target anomaly the bench does not share fails the test; monitor.db, CSVs and monitor.png in the artifacts.", check="monitor"),
    Flag(COMPILE, "msprobe_target_compile", "run the target through torch.compile (regional: each block of a ModuleList); capture is then at module level (L0) on both sides. msprobe.check, check_training and check_generate; check_parallel runs the target eagerly and warns.", check="compile"),
    Flag(TARGET_FP8, "msprobe_target_fp8", "the target's linear layers compute through FP8 GEMMs (torchao's float8 training linears: per-tensor dynamic scaling, e4m3 forward, e5m2 gradients; every nn.Linear whose features are multiples of 16); each cast into FP8 is judged by the quantization standard (underflow, saturation, error against its own amax scale) and each FP8 GEMM on its own inputs. Needs torchao.", check="target_fp8"),
]

#: the drift rule's factors, ini only (``msprobe_<key>``; each is also a check option of the same name); unset, the
#: rule's own default (:class:`~msprobe_ci.compare.verdict.Thresholds`)
RULE_INI = (("round_factor", "verdict rule: multiples of the dtype's unit roundoff (default 2)"),
            ("propagation", "verdict rule: allowed amplification of input error (default 1)"),
            ("error_factor", "verdict rule: error threshold as a multiple of the pass budget (default 1.5)"),
            ("rel_floor", "drift rule: floor of the relative-error budget (default 1e-6)"),
            ("atol", "old name of msprobe_rel_floor"))
