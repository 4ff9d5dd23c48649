"""``msprobe-ci`` command line with msprobe's flag spellings.

    msprobe-ci compare -tp TARGET -gp GOLDEN -o OUT [-fm] [-n N] [--scheduler ADDRESS|local]
    msprobe-ci overflow -i STEP_OR_RANK_DIR_OR_ROOT [-o OUT]
    msprobe-ci graph -tp TARGET [-gp GOLDEN] -o OUT [-oc] [-fm] [-n N] [--scheduler ADDRESS|local]
    msprobe-ci view LOGDIR [--port 6006] [--host 127.0.0.1]
    msprobe-ci api-check -api_info DUMP [-o OUT] [--junitxml PATH] [-n N] [--scheduler ADDRESS|local] [--live]
                         [--bench-kernel K]

Paths are dump.json files, rank folders, step folders or dump roots (``step<N>`` folders); compare pairs folders
by (step, rank). Exit status: 0 when no node is an error (compare, api-check) / no NaN-Inf (overflow), 1
otherwise, 2 for bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._perf import gc_paused
from .config import BENCH_KERNELS
from .errors import MsprobeError


_EXAMPLES = {
    "compare": "examples: msprobe-ci compare -tp out/target/step0 -gp out/bench/step0 -o out/compare\n"
               "          msprobe-ci compare -tp out/target -gp out/bench -o out/compare -n 4    (4 processes)\n"
               "          msprobe-ci compare -tp ms_dump/step0 -gp torch_dump/step0 -o out    (MindSpore vs PyTorch)",
    "overflow": "example: msprobe-ci overflow -i out/target/step0 -o out/overflow",
    "graph": "examples: msprobe-ci graph -tp out/target -o out/graphs/run1    (build)\n"
             "          msprobe-ci graph -tp out/target -gp out/bench -o out/graphs/run1    (compare)\n"
             "          msprobe-ci graph -tp /shared/target -gp /shared/bench -o /shared/graphs --scheduler "
             "tcp://head:8786",
    "view": "example: msprobe-ci view msprobe-out/graphs    (then open http://127.0.0.1:6006)",
    "api-check": "examples: msprobe-ci api-check -api_info out/target/step0/rank0/dump.json -o out/api\n"
                 "          msprobe-ci api-check -api_info out/target --live -n 2    (statistics dump: re-run on CPU)",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("msprobe-ci")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked (importlib.metadata costs 30 ms at every
    start otherwise)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show program's version number and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")  # stdout, where argparse's own version action prints it
        parser.exit()


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 worker, got {n}")
    return n


def _worker_args(p: argparse.ArgumentParser, unit: str) -> None:
    """``-n/--num_workers`` and ``--scheduler`` (see :mod:`msprobe_ci.workers`)."""
    p.add_argument("-n", "--num_workers", type=_workers, default=1, metavar="N",
                   help=f"worker processes, one {unit} a task (default 1: serial); results identical to serial")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run each task on a dask.distributed cluster: a scheduler address (tcp://host:8786; dumps "
                        "and the output folder on shared storage) or 'local' (a LocalCluster of -n one-thread "
                        "workers); needs msprobe-ci[dask]")


def _mapping_args(p: argparse.ArgumentParser) -> None:
    """msprobe's cross-framework mapping flags (MindSpore against PyTorch is matched without them)."""
    p.add_argument("-dm", "--data_mapping", default=None, metavar="YAML",
                   help="{MindSpore row: PyTorch compare key}; wins over every other rule")
    p.add_argument("-lm", "--layer_mapping", default=None, metavar="YAML",
                   help="{class: {target child: bench child}} renames in the layer tree (MindSpore against "
                        "PyTorch, or two PyTorch suites whose modules are named differently)")
    p.add_argument("-cm", "--cell_mapping", default=None, metavar="YAML", nargs="?", const="",
                   help="{Cell name part: Module name part} (bare -cm: the automatic Cell<->Module pairing)")
    p.add_argument("-am", "--api_mapping", default=None, metavar="YAML", nargs="?", const="",
                   help="{MindSpore API: PyTorch API} on top of the packaged table (bare -am: the table only)")


def _mappings(args):
    from .compare.crossframe import Mappings

    return Mappings.load(data=args.data_mapping, layer=args.layer_mapping, cell=args.cell_mapping or None,
                         api=args.api_mapping or None)


def _parallel_args(p: argparse.ArgumentParser) -> None:
    """msprobe's parallel-merge flags: one value for both sides, or target then bench."""
    p.add_argument("--rank_size", type=int, nargs="+", default=None, metavar="N",
                   help="ranks per side (default: the rank folders found); with --tp/--pp merges TP/PP ranks into "
                        "one model per data-parallel group before comparing")
    p.add_argument("--tp", type=int, nargs="+", default=None, metavar="N", help="tensor-parallel size per side")
    p.add_argument("--pp", type=int, nargs="+", default=None, metavar="N", help="pipeline-parallel size per side")
    p.add_argument("--vpp", type=int, nargs="+", default=None, metavar="N",
                   help="virtual pipeline size per side (only 1: interleaved stages are not merged)")
    p.add_argument("--order", nargs="+", default=None, metavar="ORDER",
                   help="rank order of the parallel dimensions, fastest first (default tp-dp-pp; Megatron's "
                        "tp-cp-ep-dp-pp is accepted)")


def _parallel(args, paths: tuple[str, ...]):
    """One :class:`~msprobe_ci.compare.merge.Parallel` per path (target, then bench) from the merge flags
    (``None`` in a slot: inferred from that side's collectives), or ``None`` when no flag was given (per-rank
    compare). Raises MsprobeError for more than two values or an unsupported ``--vpp``."""
    from .compare.merge import Parallel
    from .dump.reader import layout

    given = {k: getattr(args, k, None) for k in ("rank_size", "tp", "pp", "vpp", "order")}
    if not any(v is not None for v in given.values()):
        return None
    for k, v in given.items():
        if v is not None and not 1 <= len(v) <= 2:
            raise MsprobeError(f"--{k}: expected one value (both sides) or two (target, bench), got {len(v)}")
    if given["vpp"] is not None and any(v != 1 for v in given["vpp"]):
        raise MsprobeError(f"--vpp {' '.join(map(str, given['vpp']))}: virtual pipeline stages are not merged; "
                           "only --vpp 1 is supported")

    def pick(k, side, default):
        v = given[k]
        return default if v is None else v[side] if len(v) == 2 else v[0]

    out = []
    for side, path in enumerate(paths):
        if given["rank_size"] is None:
            lay = layout(path)
            first = min(s for s, _ in lay)
            size = sum(1 for s, _ in lay if s == first)
        else:
            size = pick("rank_size", side, 1)
        if given["tp"] is None and given["pp"] is None:
            out.append(None)  # inferred from the side's collectives
            continue
        tp = pick("tp", side, None)
        pp = pick("pp", side, None)
        tp = tp if tp is not None else max(1, size // (pp or 1))
        pp = pp if pp is not None else max(1, size // tp)
        out.append(Parallel(size, tp, pp, pick("order", side, "tp-dp-pp")))
    return tuple(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msprobe-ci", description="msprobe-compatible accuracy tools: compare dumps, "
                                "find overflow, build graphs for tb-graph-ascend, replay APIs alone.",
                                epilog="Exit status: 0 clean, 1 accuracy error / overflow / nothing judged, 2 bad "
                                "input. Run 'msprobe-ci <command> -h' for a command's options and an example.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    p.commands = {}  # name -> (summary, parser): what the generated CLI reference (docs/reference/cli.md) reads

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        p.commands[name] = (summary, sub.add_parser(name, help=summary, description=description,
                                                    epilog=_EXAMPLES[name],
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
        return p.commands[name][1]

    c = command("compare", "compare a target dump against a golden (bench) dump",
                "Match every node of the target dump with the bench's by name and write msprobe's compare CSV "
                "(compare_result_<ts>.csv). Dumps captured by msprobe-ci with isolation are judged by their "
                "isolated verdicts; others by the drift rule. Prints the first divergence.")
    c.add_argument("-tp", "--target_path", required=True, help="target dump.json, rank folder, step folder or root")
    c.add_argument("-gp", "--golden_path", required=True, help="bench dump.json, rank folder, step folder or root")
    c.add_argument("-o", "--output_path", default="./output", help="output folder (default ./output)")
    c.add_argument("-fm", "--fuzzy_match", action="store_true", help="ignore call indices when matching")
    _mapping_args(c)
    _parallel_args(c)
    _worker_args(c, "(step, rank) pair")
    o = command("overflow", "find NaN/Inf (overflow) and the first node where it appears",
                "Scan every tensor record for NaN/Inf (statistics or tensor dumps) and name the first node in "
                "execution order where it appears: the same rule the pytest plugin reports.")
    o.add_argument("-i", "--input_path", required=True, help="step folder, rank folder or dump.json")
    o.add_argument("-o", "--output_path", default=None,
                   help="also write anomaly_analyze_<ts>.json into this folder (default: print only)")
    g = command("graph", "build (or with -gp compare) model graphs into a .vis.db for tb-graph-ascend",
                "Build the model graph of a dump (construct.json) into build_<ts>.vis.db, or with -gp compare "
                "target and bench node by node into compare_<ts>.vis.db; open it with 'msprobe-ci view'.")
    g.add_argument("-tp", "--target_path", required=True, help="target rank folder, step folder or dump root")
    g.add_argument("-gp", "--golden_path", default=None, help="bench dump (same layout): compare instead of build")
    g.add_argument("-o", "--output_path", required=True, help="output folder for build_/compare_<ts>.vis.db")
    g.add_argument("-oc", "--overflow_check", action="store_true", help="mark NaN/Inf overflow levels on nodes")
    g.add_argument("-fm", "--fuzzy_match", action="store_true", help="match nodes ignoring call indices")
    _mapping_args(g)
    _parallel_args(g)
    _worker_args(g, "(step, rank) pair")
    a = command("api-check", "replay every API of a dump alone on CPU and judge it by its own standard",
                "msprobe's api_accuracy_checker: rebuild each API call's inputs from the dump, run it alone in "
                "higher precision and at the target's dtype, and judge the dumped (or, with --live, re-run) "
                "output by the API's accuracy standard. Writes accuracy_checking_result/_details CSVs.")
    a.add_argument("-api_info", "--api_info_file", required=True,
                   help="dump.json, rank folder, step folder or dump root")
    a.add_argument("-o", "--out_path", default="./output", help="output folder for the two CSVs (default ./output)")
    a.add_argument("--junitxml", default=None, help="also write a JUnit XML file (one testcase per API call)")
    _worker_args(a, "share of each folder's API calls")
    a.add_argument("--live", action="store_true", help="re-run the target side on CPU (statistics dumps)")
    a.add_argument("--bench-kernel", choices=BENCH_KERNELS, default="device",
                   help="the same-dtype bench of the benchmark standard: device (the API on CPU in the dumped "
                        "dtypes, default), upcast (one precision up, rounded once), rounded (fp64, correctly "
                        "rounded), decomposed (core-ATen decompositions, oneDNN off)")
    v = command("view", "start TensorBoard with tb-graph-ascend's plugin only, on a folder of .vis.db",
                "Start TensorBoard with only tb-graph-ascend's graph plugin (plain 'tensorboard' refuses to start "
                "when mindstudio-probe is also installed: both register 'graph_ascend'). Stop it with Ctrl-C.")
    v.add_argument("logdir", help="folder whose sub-folders hold .vis.db files (e.g. msprobe-out/graphs)")
    v.add_argument("--port", type=int, default=6006, help="TCP port to listen on (default 6006)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    return p


def _pairs(target: str, golden: str) -> list[tuple[str, str, str, tuple[int, int]]]:
    """(target, golden, output suffix, (step, rank)) per shared (step, rank); dump.json files are taken as they
    are."""
    from .dump.reader import layout

    for path in (target, golden):
        if not os.path.exists(path):
            raise MsprobeError(f"{path}: no such dump file or folder")
    if os.path.isfile(target) or os.path.isfile(golden):
        return [(target, golden, "", (0, 0))]
    t, g = layout(target), layout(golden)
    common = sorted(set(t) & set(g))
    if not common or set(t) != set(g):
        raise MsprobeError(f"{target} has step/rank folders {sorted(t)} but {golden} has {sorted(g)}; differently "
                           "partitioned runs are compared by merging their ranks: add --rank_size T B --tp T B "
                           "[--pp T B]")
    if len(common) == 1:
        return [(t[common[0]], g[common[0]], "", common[0])]
    return [(t[k], g[k], f"step{k[0]}_rank{k[1]}", k) for k in common]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "view":  # a long-running server keeps the collector
        return _run(args)
    with gc_paused():  # a bulk run over whole dumps: see gc_paused
        return _run(args)


def _run(args) -> int:
    try:
        if args.command == "compare":
            return _compare(args)
        if args.command == "graph":
            return _graph(args)
        if args.command == "view":
            return _view(args)
        if args.command == "api-check":
            return _api_check(args)
        return _overflow(args)
    except MsprobeError as exc:
        print(f"msprobe-ci: {exc}", file=sys.stderr)
        return 2


def _compare(args) -> int:
    from . import workers
    from .compare.ranks import first_divergence_across_ranks

    mappings = _mappings(args)
    parallel = _parallel(args, (args.target_path, args.golden_path))
    if parallel is not None:
        return _compare_merged(args, parallel)
    pairs = _pairs(args.target_path, args.golden_path)
    if len(pairs) == 1 and not args.fuzzy_match and not any((mappings.data, mappings.layer, mappings.cell,
                                                              mappings.api)):
        streamed = _stream(pairs[0], args)
        if streamed is not None:
            return streamed
    # one task per (step, rank): serial, a process pool (-n) or dask (--scheduler); the same lines either way
    jobs = [(t, g, rank, key, args.output_path, args.fuzzy_match, mappings) for t, g, rank, key in pairs]
    done = workers.run(_compare_pair, jobs, [f"step{k[0]} rank{k[1]}" for _, _, _, k in pairs],
                       workers=args.num_workers, scheduler=args.scheduler)
    if len(done) > 1:  # many ranks or steps: one summary first, naming the rank whose own computation diverged
        result = first_divergence_across_ranks([summary for _, summary in done])
        print(result.headline)
        for d in result.ranks:
            if d is not result.first:
                print(f"  also: {d.message}")
    for line, _ in done:
        print(line)
    return 1 if any(summary.first is not None for _, summary in done) else 0


def _compare_pair(job: tuple) -> tuple:
    """One (step, rank) pair of ``compare``: its CSV written, ``(summary line, RankSummary)`` returned (a task of
    :func:`msprobe_ci.workers.run`)."""
    from .check import judge
    from .check.outcome import sources_rule
    from .judge.settings import JudgeSettings
    from .compare.ranks import summarize

    t, g, rank, key, out, fuzzy, mappings = job
    # a later step of a multi-step dump: its weights and optimizer state trained apart by rounding (context)
    factor, rule = sources_rule(key[0])
    # isolated verdicts where the target has them (isolation.json) or they can be had (a tensor dump: replay)
    from .replay.repro import write_replayed

    report, target, _ = judge(g, t, JudgeSettings(fuzzy=fuzzy, mappings=mappings, source_factor=factor))
    path = report.write_csv(out, prefix=f"compare_result_{rank}" if rank else "compare_result")
    # calls replayed from a tensor dump that fail: their reproductions beside the CSV, named as it is
    write_replayed(report, path[: -len(".csv")].replace("compare_result", "compare_repro", 1))
    line = _summary_line(path, len(report.nodes), report.counts(), report.first_divergence, report.isolated)
    if report.isolated:
        line += f" [{rule}]"
    summary = summarize(*key, report, target)
    if summary.repro:
        line += f"\n  reproduce {summary.first.name} alone, without the model: {summary.repro}"
    return line, summary


def _compare_merged(args, parallel) -> int:
    """compare with TP/PP merging: one CSV and summary line per (step, data-parallel group), first the earliest
    divergence over them, naming the rank whose isolated verdict failed."""
    from .check.parallel import evaluate_merged, merged_where

    if args.fuzzy_match or args.data_mapping or args.api_mapping:
        raise MsprobeError("compare: --rank_size/--tp/--pp merging combines with -lm/-cm, not with -fm, -dm or -am")
    _serial_only(args, "compare")
    from .judge.settings import JudgeSettings

    par_t, par_b = parallel
    results = evaluate_merged(args.golden_path, args.target_path, args.output_path,
                              JudgeSettings(mappings=_mappings(args)), par_b, par_t)
    lines, firsts = [], []
    for step, i, merged, outcome in results:
        report = outcome.report
        first = report.first_divergence
        lines.append(f"step{step} group{i} (target ranks {merged.ranks}): " + _summary_line(
            outcome.csv, len(report.nodes), report.counts(), first, report.isolated))
        if first is not None:
            firsts.append(f"step{step} {merged_where(first, merged.ranks)} {first.name}")
    print(f"first divergence: {firsts[0]}" if firsts else "first divergence: none")
    for line in lines:
        print(line)
    return 1 if firsts else 0


def _serial_only(args, command: str) -> None:
    if args.num_workers > 1 or args.scheduler:
        raise MsprobeError(f"{command}: --rank_size/--tp/--pp merging runs in one process (each group needs every "
                           "rank of its step at once); drop -n/--scheduler")


def _stream(pair, args) -> int | None:
    """One pair of PyTorch dumps (files or rank folders, as ``_pairs`` gives them): the streaming compare, memory
    bounded by the unmatched window; ``None`` when the in-memory compare must run (MindSpore, NaN tokens,
    isolation records of an msprobe-ci capture, a tensor dump whose calls are replayed)."""
    from .compare.stream import NotStreamable, stream_compare

    t, g, rank, _ = pair
    folder = os.path.dirname(t) if os.path.isfile(t) else t
    if os.path.isfile(os.path.join(folder, "isolation.json")):
        return None
    tensors = os.path.join(folder, "dump_tensor_data")
    if os.path.isdir(tensors) and any(os.scandir(tensors)):  # judged by its calls replayed, not by drift
        return None
    try:
        r = stream_compare(t, g, args.output_path, prefix=f"compare_result_{rank}" if rank else "compare_result")
    except NotStreamable:
        return None
    print(_summary_line(r.csv, r.nodes, r.counts, r.first_divergence, isolated=False))
    return 0 if r.first_divergence is None else 1


def _summary_line(path: str, nodes: int, c: dict, first, isolated: bool) -> str:
    how = "isolated verdicts" if isolated else (
        "drift rule: verdicts inferred from drift, later errors on diverged inputs reported as propagated; for "
        "isolated ones dump the target with msprobe_ci.PrecisionDebugger, or with task tensor")
    return (f"{path}: {nodes} nodes, pass {c['pass']}, warning {c['warning']}, error {c['error']}, unmatched "
            f"{c['unmatched']} ({how}); first divergence: {first.message if first is not None else 'none'}")


def _overflow(args) -> int:
    from .dump.reader import layout, load_dump
    from .outputs import atomic_write, make_output_dir, reserve
    from .overflow import check_overflow

    out_dir = make_output_dir(args.output_path, "-o output folder") if args.output_path else None
    result = {}
    found = False
    for (step, rank), folder in sorted(layout(args.input_path).items()):
        rep = check_overflow(load_dump(folder))
        result[f"step_{step}_rank_{rank}"] = [{"op_name": a.name, "level": a.level, "rows": list(a.rows),
                                               "kind": "overflow" if a.is_overflow else "norm_jump"}
                                              for a in rep.anomalies]
        first = rep.first
        found |= rep.has_overflow
        jumps = f" ({len(rep.jumps)} norm jump(s), finite: not overflow)" if rep.jumps else ""
        print(f"{folder}: {len(rep.overflows)} overflow nodes; first overflow: "
              f"{first.message if first else 'none'}{jumps}")
    if out_dir is not None:
        out = reserve(out_dir, "anomaly_analyze", ".json")
        with atomic_write(out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(out)
    return 1 if found else 0


def _graph(args) -> int:
    from .graph import build_vis_db, compare_vis_db

    spread = {"workers": args.num_workers, "scheduler": args.scheduler}
    if args.golden_path:
        par = _parallel(args, (args.target_path, args.golden_path))
        if par is not None:
            _serial_only(args, "graph")
        path = compare_vis_db(args.target_path, args.golden_path, args.output_path, overflow=args.overflow_check,
                              fuzzy=args.fuzzy_match, mappings=_mappings(args), parallel=par, **spread)
    else:
        par = _parallel(args, (args.target_path,))
        if par is not None:
            _serial_only(args, "graph")
        path = build_vis_db(args.target_path, args.output_path, overflow=args.overflow_check, merge=par is not None,
                            parallel=par[0] if par else None, **spread)
    print(path)
    print(f"open it with: msprobe-ci view {os.path.dirname(os.path.dirname(os.path.abspath(path)))}")
    return 0


def _api_check(args) -> int:
    from .dump.reader import layout
    from .outputs import check_output_file, is_junit
    from .replay.batch import check_folders, write_api_junit

    folders = [f for _, f in sorted(layout(args.api_info_file).items())] \
        if os.path.isdir(args.api_info_file) else [args.api_info_file]
    if args.junitxml:
        inputs = [os.path.join(d if os.path.isdir(d) else os.path.dirname(d) or ".", f)
                  for d in folders for f in ("dump.json", "stack.json", "construct.json")]
        args.junitxml = check_output_file(args.junitxml, "--junitxml", inputs=inputs, replaceable=is_junit)
    results = check_folders(folders, workers=args.num_workers, scheduler=args.scheduler, live=args.live,
                            bench_kernel=args.bench_kernel, out_path=args.out_path)
    if args.junitxml:
        write_api_junit(results, args.junitxml)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "warning", "error", "skip")}
    print(f"{len(results)} API calls: pass {counts['pass']}, warning {counts['warning']}, error {counts['error']}, "
          f"skip {counts['skip']}")
    if results and counts["skip"] == len(results):
        print(f"msprobe-ci: api-check judged nothing: all {len(results)} API calls were skipped "
              f"({results[0].reason}); run with --live (re-runs the target on CPU), or dump with task 'tensor'",
              file=sys.stderr)
        return 1
    return 1 if counts["error"] else 0


def _view(args) -> int:
    """TensorBoard with only tb-graph-ascend's ``graph_ascend`` plugin: mindstudio-probe registers a plugin of the
    same name, and plain ``tensorboard`` refuses to start when both are installed."""
    try:
        from server.plugin import GraphsPlugin
        from tensorboard import default, program
    except ImportError:
        raise MsprobeError("msprobe-ci view needs tensorboard and tb-graph-ascend (pip install tb-graph-ascend)") \
            from None
    if not os.path.isdir(args.logdir):
        raise MsprobeError(f"{args.logdir}: no such folder")
    tb = program.TensorBoard(plugins=default.get_static_plugins() + [GraphsPlugin])
    tb.configure(argv=[None, "--logdir", args.logdir, "--port", str(args.port), "--host", args.host])
    return tb.main()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
