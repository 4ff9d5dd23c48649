"""Streaming compare and graph (msprobe-ci compare/graph on PyTorch dumps): the same CSV, verdicts and .vis.db as
the in-memory paths, entry by entry, on a captured GPT-2 with a forward and a backward fault and on msprobe's own
dumps; bad input mid-stream is one line; dumps they do not take (NaN tokens) go to the in-memory path and leave no
stray file."""

import csv
import json
import math
import os
import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from msprobe_ci.capture import CaptureSession
from msprobe_ci.capture.inject import Fault
from msprobe_ci.cli import main
from msprobe_ci.compare import compare_dumps
from msprobe_ci.compare.stream import NotStreamable, stream_compare
from msprobe_ci.config import DumpConfig
from msprobe_ci.dump import load_dump
from msprobe_ci.errors import MsprobeError

from _files import vis_db_content

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    faults = (Fault("Functional.layer_norm", call=3, value=1.02),
              Fault("Torch.addmm", call=5, direction="backward", value=1.05))
    for side, dtype, side_faults in (("bench", torch.float32, ()), ("target", torch.bfloat16, faults)):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg).to(dtype)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        cs = CaptureSession(DumpConfig(dump_path=str(root / side), level="mix", task="statistics"),
                            faults=side_faults)
        cs.start(model)
        model(input_ids=ids, labels=ids).loss.backward()
        cs.stop()
        cs.close()
    return root / "target" / "step0" / "rank", root / "bench" / "step0" / "rank"


def _rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_streaming_gives_the_in_memory_csv_and_verdicts(gpt2_pair, tmp_path):
    target, bench = gpt2_pair
    streamed = stream_compare(str(target), str(bench), str(tmp_path), prefix="s", progress=False)
    report = compare_dumps(bench=load_dump(bench), target=load_dump(target))
    assert streamed.counts == report.counts() and streamed.counts["error"] >= 1
    assert streamed.first_divergence.name == report.first_divergence.name == "Functional.layer_norm.3.forward"
    assert _rows(streamed.csv) == _rows(report.write_csv(str(tmp_path), prefix="m"))
    # parameters_grad entries come before their module's backward entry and are judged with it
    data = json.loads((target / "dump.json").read_text())["data"]
    names = list(data)
    pg = next(n for n in names if n.endswith(".parameters_grad.0") or ".parameters_grad" in n)
    assert any(n.startswith(pg.split(".parameters_grad")[0]) and ".backward" in n for n in names[names.index(pg):])


def test_streamed_node_verdicts_are_the_in_memory_ones_metric_for_metric(gpt2_pair):
    """Each node's verdict, its metrics included (a gradient's cancellation allowance reads its forward twin's
    shapes and norms, which the stream keeps in a compact form until the backward call is judged), is the
    in-memory compare's."""
    from msprobe_ci.compare.stream import NodeStream, stream_files

    target, bench = gpt2_pair
    files, heads = stream_files(str(target), str(bench))
    streamed = {name: node for name, _, node in NodeStream(files, heads)}
    loaded = {n.name: n for n in compare_dumps(bench=load_dump(bench), target=load_dump(target)).nodes}
    assert streamed.keys() == loaded.keys() and len(streamed) > 100
    conditioned = 0
    for name, node in streamed.items():
        assert (node.status, node.message, node.metrics) == (loaded[name].status, loaded[name].message,
                                                           loaded[name].metrics), name
        conditioned += "cancellation" in node.message  # verdict.judge words a condition above 1
    assert conditioned, "some gradient's allowance comes from its twin's shapes"


def test_cli_compare_streams_and_fails_naming_the_first_divergence(gpt2_pair, tmp_path, capsys):
    target, bench = gpt2_pair
    rc = main(["compare", "-tp", str(target.parent), "-gp", str(bench.parent), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 1 and "first divergence: Functional.layer_norm.3.forward" in out
    assert len(os.listdir(tmp_path / "out")) == 1


def _copy(pair, tmp_path):
    target, bench = pair
    t = tmp_path / "t"
    shutil.copytree(target, t)
    return t, bench


def test_bad_entries_mid_stream_are_one_line_errors(gpt2_pair, tmp_path):
    t, bench = _copy(gpt2_pair, tmp_path)
    raw = (t / "dump.json").read_text()
    data = json.loads(raw)["data"]
    late = list(data)[-5]
    broken = json.loads(raw)
    broken["data"][late]["output"] = "oops"
    (t / "dump.json").write_text(json.dumps(broken))
    with pytest.raises(MsprobeError, match=r"dump.json: data\[.*\]\.output: 'oops' must be array or object"):
        stream_compare(str(t), str(bench), str(tmp_path / "o1"), progress=False)
    assert not os.listdir(tmp_path / "o1")  # the reserved CSV name is released
    first = list(data)[0]
    dup = raw.replace(json.dumps(first), json.dumps(list(data)[1]), 1)
    (t / "dump.json").write_text(dup)
    with pytest.raises(MsprobeError, match="duplicate key"):
        stream_compare(str(t), str(bench), str(tmp_path / "o2"), progress=False)


def test_nan_tokens_stream_as_the_in_memory_compare_reads_them(fixtures_dir, tmp_path, capsys):
    """msprobe's own overflow dump (NaN, Infinity and -Infinity statistics, as every dump of a masked model holds)
    streams, and gives the in-memory compare's CSV and verdicts."""
    tiny = fixtures_dir
    overflow = os.path.join(tiny, "fp16_overflow_statistics", "step0", "proc0")
    bench = os.path.join(tiny, "fp32_statistics", "step0", "proc0")
    with open(os.path.join(overflow, "dump.json"), encoding="utf-8") as fh:
        text = fh.read()
    assert "NaN" in text and "Infinity" in text
    streamed = stream_compare(overflow, bench, str(tmp_path / "o"), prefix="s", progress=False)
    report = compare_dumps(bench=load_dump(bench), target=load_dump(overflow))
    assert streamed.counts == report.counts()
    assert _rows(streamed.csv) == _rows(report.write_csv(str(tmp_path / "o"), prefix="m"))
    rc = main(["compare", "-tp", os.path.dirname(overflow), "-gp", os.path.join(tiny, "fp32_statistics", "step0"),
               "-o", str(tmp_path / "cli")])
    assert rc in (0, 1) and len(os.listdir(tmp_path / "cli")) == 1
    assert "36 nodes" in capsys.readouterr().out


def _both_graphs(tmp_path, target, bench=None, **kw):
    from msprobe_ci.graph import build_vis_db, compare_vis_db

    out = []
    for stream in (True, False):
        folder = str(tmp_path / f"g{stream}{len(list(tmp_path.iterdir()))}")
        if bench is None:
            out.append(vis_db_content(build_vis_db(str(target), folder, stream=stream, **kw)))
        else:
            out.append(vis_db_content(compare_vis_db(str(target), str(bench), folder, stream=stream, **kw)))
    return out


@pytest.mark.parametrize("overflow", [False, True])
def test_streamed_graph_is_the_in_memory_graph(gpt2_pair, tmp_path, overflow):
    """Node for node: data rows with metrics, verdict colours (the faulty layer_norm red, its containers red up
    to the top), matched links, stacks, micro-steps; build graphs too."""
    target, bench = gpt2_pair
    streamed, loaded = _both_graphs(tmp_path, target, bench, overflow=overflow)
    assert streamed == loaded
    nodes = streamed[0]
    assert nodes["NPU_0_0_Functional.layer_norm.3.forward"]["precision_index"] == 1
    red = [n for n in nodes.values() if n["precision_index"] == 1 and n["node_type"] == "0"]
    assert red, "containers of the failing API are coloured"
    assert len({n["step"] for n in nodes.values()}) == 1 and len(nodes) > 400
    built = _both_graphs(tmp_path, target)
    assert built[0] == built[1]


@pytest.mark.parametrize("kind", ["md5", "tensor", "statistics_2steps"])
def test_streamed_graph_of_msprobe_dumps(fixtures_dir, tmp_path, kind):
    tiny = fixtures_dir
    streamed, loaded = _both_graphs(tmp_path, os.path.join(tiny, f"bf16_{kind}"), os.path.join(tiny, f"fp32_{kind}"))
    assert streamed == loaded and streamed[0]


def test_graph_of_nan_tokens_streams_as_the_in_memory_graph(fixtures_dir, tmp_path):
    overflow, bench = os.path.join(fixtures_dir, "fp16_overflow_statistics"), os.path.join(fixtures_dir,
                                                                                          "fp32_statistics")
    streamed, loaded = _both_graphs(tmp_path, overflow, bench, overflow=True)
    assert streamed == loaded and streamed[0]


def test_bad_entry_mid_stream_leaves_no_graph(gpt2_pair, tmp_path):
    from msprobe_ci.graph import compare_vis_db

    t, bench = _copy(gpt2_pair, tmp_path)
    broken = json.loads((t / "dump.json").read_text())
    broken["data"][list(broken["data"])[-3]]["input_args"] = [{"type": "torch.Tensor", "Max": "x"}]
    (t / "dump.json").write_text(json.dumps(broken))
    with pytest.raises(MsprobeError, match=r"^\S*dump.json: data\[.*\]\.input_args\[0\]"):
        compare_vis_db(str(t), str(bench), str(tmp_path / "o"))
    assert not os.listdir(tmp_path / "o")


class _MaskedAttention(torch.nn.Module):
    """Causal attention whose mask is filled with the dtype's lowest value, as transformers' models do."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return torch.softmax(torch.where(mask, s, torch.finfo(s.dtype).min), -1)


@pytest.mark.parametrize("fault", [None, Fault("Functional.linear", call=1, value=1.02)], ids=["benign", "fault"])
def test_bench_values_beyond_the_target_range_are_not_an_error(tmp_path, fault):
    """fp16 target vs fp32 bench: the mask holds -65504 against -3.4e38, whose Mean and Norm overflow on the
    bench. The compare (drift rule) passes every node; a 2% fault in the second linear is still the first error."""
    for side, dtype, faults in (("bench", torch.float32, ()), ("target", torch.float16, (fault,) if fault else ())):
        torch.manual_seed(0)
        model = _MaskedAttention().to(dtype)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        cs = CaptureSession(DumpConfig(dump_path=str(tmp_path / side), level="mix", task="statistics"),
                            faults=faults)
        cs.start(model)
        model(x)
        cs.stop()
        cs.close()
    report = compare_dumps(bench=load_dump(str(tmp_path / "bench" / "step0" / "rank")),
                           target=load_dump(str(tmp_path / "target" / "step0" / "rank")))
    where = next(n for n in report.nodes if n.name == "Torch.where.0.forward")
    assert where.status == "pass", where.message
    if fault is None:
        assert report.first_divergence is None, report.first_divergence.message
    else:
        assert report.first_divergence.name == "Functional.linear.1.forward", report.first_divergence.message


_stat = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64), st.none(), st.integers(-5, 5))


@settings(max_examples=300, deadline=None)
@given(t=st.tuples(_stat, _stat, _stat, _stat), b=st.tuples(_stat, _stat, _stat, _stat), numel=st.integers(1, 10**6))
def test_statistics_fast_paths_match_the_general_rules(t, b, numel):
    """The float fast paths of stat_diff and relative_error_stats give what the general (string-classifying) rules
    give: the same values written as JSON text take the general path."""
    from msprobe_ci.compare import metrics as M

    def text(v):
        return v if v is None else repr(float(v)) if isinstance(v, float) else str(v)

    slow_t, slow_b = tuple(map(text, t)), tuple(map(text, b))
    fast, slow = M.relative_error_stats(t, b, numel), M.relative_error_stats(slow_t, slow_b, numel)
    assert fast == slow or (math.isnan(fast) and math.isnan(slow))
    for x, y, sx, sy in zip(t, b, slow_t, slow_b):
        assert M.stat_diff(x, y) == M.stat_diff(sx, sy)


@settings(max_examples=300, deadline=None)
@given(t=st.tuples(_stat, _stat, _stat, _stat), b=st.tuples(_stat, _stat, _stat, _stat), numel=st.integers(1, 10**6),
       near=st.booleans(), t_max=st.sampled_from([None, 65504.0, 448.0]))
def test_range_rule_is_the_same_on_both_paths(t, b, numel, near, t_max):
    """With the target dtype's range (``t_max``), the float fast path of relative_error_stats gives what the
    general rules give on the same values as JSON text; ``near`` makes the bench a float rounding of the target,
    the common case. The columns do not depend on the range."""
    from msprobe_ci.compare import metrics as M

    if near:
        b = tuple(float(torch.tensor(float(v), dtype=torch.bfloat16)) if isinstance(v, float) and math.isfinite(v)
                  else v for v in t)

    def text(v):
        return v if v is None else repr(float(v)) if isinstance(v, float) else str(v)

    fast = M.relative_error_stats(t, b, numel, t_max)
    slow = M.relative_error_stats(tuple(map(text, t)), tuple(map(text, b)), numel, t_max)
    assert fast == slow or (math.isnan(fast) and math.isnan(slow))
    if t_max is not None and all(isinstance(v, float) and abs(v) <= t_max for v in (b[0], b[1])):
        assert fast == M.relative_error_stats(t, b, numel) or math.isnan(fast)  # within range: the plain rule


_cell = st.one_of(st.text(), st.text(alphabet=',"\r\n ab\x00\u2028'), st.floats(), st.integers(), st.booleans(),
                  st.none(), st.builds(lambda s: type("S", (str,), {"__str__": lambda self: "x"})(s), st.text(',"x')),
                  st.builds(lambda v: type("F", (float,), {"__str__": lambda self: "a,b"})(v), st.floats()),
                  st.builds(lambda v: type("I", (int,), {"__str__": lambda self: '"'})(v), st.integers()))


@settings(max_examples=500, deadline=None)
@given(row=st.lists(_cell, min_size=1, max_size=8))
def test_csv_record_is_what_the_csv_writer_writes(row):
    """The compare CSV's record builder gives csv.writer's bytes for every kind of cell (quoting, floats by repr,
    None empty, a lone empty cell quoted, str subclasses)."""
    import io

    from msprobe_ci.compare.csvout import csv_record

    fh = io.StringIO()
    csv.writer(fh).writerow(row)
    assert csv_record(row) == fh.getvalue()


@settings(max_examples=400, deadline=None)
@given(t=st.tuples(_stat, _stat, _stat, _stat), b=st.tuples(_stat, _stat, _stat, _stat), numel=st.integers(0, 10**6),
       near=st.booleans(), t_max=st.sampled_from([math.inf, 65504.0, 448.0, 1.0]),
       tiny=st.sampled_from([0.0, 2.0 ** -14, 1.1754943508222875e-38, 1.0]))
@example(t=(1.0, 1.0, 1.0, 0.5), b=(1.0, 1.0, 1.0, 0.25), numel=100, near=False, t_max=math.inf, tiny=1.0)  # Norm floor
@example(t=(0.0, -0.0, 1e308, 1.0), b=(-0.0, 0.0, -1e308, 1.0), numel=4, near=False, t_max=math.inf, tiny=0.0)
@example(t=(1e30, 1.0000123e-3, 2.5, 1.0), b=(1e-300, 1e-3, 2.5 + 2.5e-9, 1.0 + 1e-7), numel=4, near=False,
         t_max=math.inf, tiny=0.0)  # a ratio overflowing to inf; percentages in 1e-5..1e-4 and below 1e-5
def test_stats_pair_is_the_two_rules(t, b, numel, near, t_max, tiny):
    """The one-pass statistics row (columns and relative error together) gives what stats_metrics and
    relative_error_stats give, column by column and in the same order (``near``: the bench a bf16 rounding of the
    target, the common row; -0.0, subnormals, overflowing differences and values beyond the range included)."""
    from msprobe_ci.compare import metrics as M

    if near:
        b = tuple(float(torch.tensor(float(v), dtype=torch.bfloat16)) if isinstance(v, float) and math.isfinite(v)
                  else v for v in t)
    cols, err = M.stats_pair(t, b, numel, t_max, tiny)
    want = M.relative_error_stats(t, b, numel, t_max, tiny)
    assert repr(list(cols.items())) == repr(list(M.stats_metrics(t, b).items()))
    assert err == want or (math.isnan(err) and math.isnan(want))


_finite = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64), st.integers(-2**63, 2**64 - 1),
                    st.sampled_from([0.0, -0.0, 1e-05, 0.0001, 1e16, 1e-7, 5e-324, 2.5e-07, -0.00012, 123456789.0,
                                     -1.23e-05, 9.999999999999999e-05, 10.00001, -1e-06, 1.5e-10, 1e-100]),
                    st.floats(min_value=-1e-3, max_value=1e-3))


@settings(max_examples=500, deadline=None)
@given(values=st.lists(st.one_of(_finite, st.none(), st.booleans(), st.floats(), st.integers(-2**80, 2**80),
                                 st.text(max_size=3)), min_size=1, max_size=16))
def test_number_cells_are_what_str_writes(values):
    """The CSV's numeric cells formatted at once give ``str`` of each value (a float's repr: ``1e-05`` and
    ``2.5e-07``, not orjson's ``0.00001`` and ``2.5e-7``), or None where a value is not a finite number."""
    from msprobe_ci.compare.metrics import number_cells

    got = number_cells(tuple(values))
    finite = all(type(v) in (int, float) and (type(v) is int or math.isfinite(v)) for v in values)
    if finite and all(-2**63 <= v < 2**64 for v in values if type(v) is int):
        assert got == ",".join(map(str, values))
    else:
        assert got is None or got == ",".join(map(str, values))


def test_csv_line_is_the_csv_row(gpt2_pair, fixtures_dir):
    """The compare CSV's one-line record of a statistics row is the cell-by-cell record, on every row of real
    compares (bf16 against fp32 with a forward and a backward fault: error and propagated rows; msprobe's own
    dumps; md5 and tensor modes) and on rows whose cells need quoting or are not numbers."""
    from msprobe_ci.compare.csvout import csv_line, csv_record, csv_row

    pairs = [gpt2_pair] + [(os.path.join(fixtures_dir, f"bf16_{m}", "step0", "proc0"),
                            os.path.join(fixtures_dir, f"fp32_{m}", "step0", "proc0"))
                           for m in ("statistics", "md5", "tensor")]
    pairs.append((os.path.join(fixtures_dir, "fp16_overflow_statistics", "step0", "proc0"), pairs[1][1]))
    checked = 0
    for target, bench in pairs:
        t_dump, b_dump = load_dump(str(target)), load_dump(str(bench))
        odd = [r for e in t_dump.data.values() if isinstance(e, dict) for r in e.get("output") or []
               if isinstance(r, dict) and "Max" in r][:6]
        for rec, (key, value) in zip(odd, [("Max", "1,5"), ("Min", 'a"b'), ("Mean", math.nan), ("Norm", True),
                                           ("requires_grad", 'x"y'), ("Max", 10**30)]):
            rec[key] = value
        report = compare_dumps(bench=b_dump, target=t_dump)
        verdicts = {n.name: n for n in report.nodes}
        fast_done, slow_done = set(), set()
        for rr in report.rows:
            node = verdicts.get(rr.target.entry)
            assert csv_line(report, rr, node, fast_done) == csv_record(csv_row(report, rr, node, slow_done))
            checked += 1
        assert fast_done == slow_done
    assert checked > 500


_json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | \
    st.text(alphabet='ab,:{}[]"\\\n ', max_size=8) | \
    st.sampled_from(["NaN", ": NaN,", "[Infinity]", ", -Infinity}", "@msprobe-ci-nonfinite:NaN"])
_json_value = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=3) |
                           st.dictionaries(st.text(alphabet='ab "\n', max_size=3), kids, max_size=3), max_leaves=12)


def _layouts(head: dict, items: list, after: dict) -> dict[str, str]:
    """One dump.json as msprobe (indent=1), msprobe-ci (one entry a line), compact and indent=2 write it;
    ``items`` may repeat a name (written twice, as a hostile file would), ``after`` adds keys after data."""
    from msprobe_ci.dump.writer import dump_json_text

    class Pairs(dict):  # the encoders write what items() gives, repeated names included
        def items(self):
            return iter(list(items))

    data = Pairs(items)
    out = {"line": dump_json_text(head, data) if items else dump_json_text(head, {})}
    for kind, indent in (("indent1", 1), ("compact", None), ("indent2", 2)):
        out[kind] = json.dumps({**head, "data": data}, indent=indent)
    if after:
        out = {k: v.rstrip()[:-1] + ", " + json.dumps(after)[1:] for k, v in out.items()}
    # a header object whose keys sit where entries would; an entry line whose comma is missing (invalid JSON)
    out["nested"] = out["compact"].replace('"level": ', '"meta": {\n  "k": 1,\n  "j": 2}, "level": ', 1)
    out["nocomma"] = out["line"].replace(',\n  "', '\n  "', 1)
    return out


class _Obj(list):
    """A JSON object as its (key, value) pairs."""


def _plain(v):
    if isinstance(v, _Obj):
        return {k: _plain(x) for k, x in v}
    return [_plain(x) for x in v] if isinstance(v, list) else v


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.sampled_from(["A.x.0.forward", "B.y.1.backward", 'C."q".0', "D\n", "E.z"]), max_size=7),
       values=st.lists(_json_value, min_size=7, max_size=7), after=st.sampled_from([{}, {"extra": 1}]),
       sizes=st.sampled_from([(8, 16), (64, 64), (1 << 16, 1 << 20)]))
def test_chunked_reading_gives_what_ijson_gives(tmp_path_factory, names, values, after, sizes):
    """dump.json's data read in orjson chunks (cut before lines that look like entries) gives the (name, entry) pairs
    in order, whatever the layout, chunk size or content: strings holding braces, quotes and newlines, repeated
    names, integers past 64 bits, keys after data, NaN and infinities (bare tokens and inside strings, the marker
    text itself among them). Where yajl refuses the file (an integer past int64, NaN), it is NotStreamable or the
    values Python's json reads."""
    from unittest import mock

    import ijson

    from msprobe_ci.dump import scan as stream

    folder = tmp_path_factory.mktemp("chunks")
    items = list(zip(names, values))
    for kind, text in _layouts({"task": "statistics", "level": "mix"}, items, after).items():
        path = folder / f"{kind}.json"
        path.write_text(text)
        try:
            doc = json.loads(text, object_pairs_hook=_Obj)
            want = [(k, _plain(v)) for k, v in dict(doc)["data"]]  # data's pairs as written, repeats kept
        except json.JSONDecodeError:
            want = None
        try:
            with open(path, "rb") as fh:
                yajl = list(ijson.kvitems(fh, "data", use_float=True))
        except ijson.JSONError:
            yajl = None
        with mock.patch.object(stream, "_CHUNK", sizes[0]), mock.patch.object(stream, "_BLOCK", sizes[1]):
            try:
                got = list(stream.iter_items(str(path)))
            except stream.NotStreamable:
                got = None
        same = lambda a, b: json.dumps(a) == json.dumps(b)  # noqa: E731 (NaN is not NaN; its JSON text is)
        with mock.patch.object(stream, "_BLOCK", sizes[1]):
            claimed = stream.scan_names(str(path))
        if claimed is not None and got is not None and claimed != [k for k, _ in got]:
            check = stream.NameCheck(str(path), claimed)  # a wrong claim is caught as the entries stream
            with pytest.raises(stream.NotStreamable):
                for k, _ in got:
                    check.see(k)
                check.done()
        if want is None:
            assert got is None, kind
        elif yajl is not None:
            assert same(got, yajl) and same(got, want), kind
        else:
            assert got is None or same(got, want), kind


def test_chunked_reading_takes_both_layouts(tmp_path):
    """msprobe's indent=1 dump.json and msprobe-ci's one-entry-a-line one are read by orjson chunks to the end (the
    fast path is taken, not only correct)."""
    from msprobe_ci.dump.scan import _chunked_items, iter_items

    items = [(f"Functional.relu.{i}.forward", {"input_args": [{"type": "int", "value": i}], "output": [None]})
             for i in range(3000)]
    from unittest import mock

    from msprobe_ci.dump import scan

    for kind in ("line", "indent1"):
        path = tmp_path / f"{kind}.json"
        path.write_text(_layouts({"task": "statistics"}, items, {})[kind])
        with open(path, "rb") as fh:
            assert list(_chunked_items(fh)) == items, kind
        for block in (41, 64, 1 << 20):  # names straddling the blocks: the names, without parsing a value
            with mock.patch.object(scan, "_BLOCK", block):
                assert scan.scan_names(str(path)) == [k for k, _ in items], (kind, block)
    escaped = tmp_path / "escaped.json"
    escaped.write_text(_layouts({"task": "statistics"}, [('C."q".0', 1)], {})["indent1"])
    assert scan.scan_names(str(escaped)) is None  # an escape in a name: parsed instead
    # a missing comma between two entries is a syntax error, even where the first entry would parse alone
    bad = tmp_path / "nocomma.json"
    bad.write_text(_layouts({"task": "statistics"}, [("A.x.0.forward", 12), ("B.y.0.forward", 3)], {})["nocomma"])
    with pytest.raises(NotStreamable):
        list(iter_items(str(bad)))


def test_a_wrong_claim_of_names_falls_back_to_the_in_memory_graph(gpt2_pair, tmp_path):
    """The streamed graph's skeleton comes from names read off the entries' first lines; where that claim is wrong
    (here: forced, one name changed), the stream says so and the graph is the in-memory one, not a wrong one."""
    from unittest import mock

    from msprobe_ci.dump import scan
    from msprobe_ci.graph import stream as graph_stream

    target, bench = gpt2_pair
    real = scan.scan_names
    calls = []

    def wrong(path):
        names = real(path)
        calls.append(path)
        return names[:-1] + ["Functional.relu.999.forward"]
    with mock.patch.object(graph_stream, "scan_names", wrong), \
            mock.patch.object(graph_stream, "NameCheck", wraps=scan.NameCheck) as check:
        streamed, loaded = _both_graphs(tmp_path, target, bench)
    assert calls and check.called and streamed == loaded
    assert "NPU_0_0_Functional.relu.999.forward" not in streamed[0]


@pytest.mark.parametrize("side", ["target", "bench", "build"])
def test_a_name_given_twice_is_an_error_on_the_streamed_graph(gpt2_pair, tmp_path, side):
    """The streamed graph keeps no set of every entry name (the skeleton's names are checked for repeats instead,
    and the stream is held to them): a dump.json naming one entry twice, in msprobe's indent=1 layout whose names
    are read off the first lines, is still refused with the in-memory reader's one-line error, and no graph is
    left."""
    from msprobe_ci.dump import scan
    from msprobe_ci.graph import build_vis_db, compare_vis_db

    t, bench = _copy(gpt2_pair, tmp_path)
    folder = bench if side == "bench" else t
    raw = json.loads((folder / "dump.json").read_text())
    names = list(raw["data"])
    text = json.dumps(raw, indent=1).replace(f'\n  {json.dumps(names[3])}:', f'\n  {json.dumps(names[2])}:', 1)
    (folder / "dump.json").write_text(text)
    assert scan.scan_names(str(folder / "dump.json")).count(names[2]) == 2
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(MsprobeError, match=rf"^\S*dump.json: duplicate key '{re.escape(names[2])}'"):
        if side == "build":
            build_vis_db(str(t), str(out))
        else:
            compare_vis_db(str(t), str(bench), str(out))
    assert not os.listdir(out)


def test_graph_of_dumps_without_entries_is_drawn_from_the_structure(tmp_path):
    """No entries, one module in construct.json: both paths draw the structure-only graph (the node stream, which
    needs entries, hands it to the in-memory path)."""
    for side in ("t", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "dump.json").write_text('{"task": "statistics", "level": "mix", "data": {}}')
        (tmp_path / side / "construct.json").write_text('{"Module.a.A.forward.0": null}')
    streamed, loaded = _both_graphs(tmp_path, tmp_path / "t", tmp_path / "b")
    assert streamed == loaded and set(n["node_name"] for n in streamed[0].values()) == {
        "DefaultModel", "Module.a.A.forward.0"}


@pytest.mark.parametrize("chunk", [8, 1 << 16])
def test_nonfinite_tokens_are_read_as_pythons_json_reads_them(tmp_path, chunk):
    """NaN, Infinity and -Infinity values in every position, next to strings that hold those words: the streamed
    entries are json.loads's. A string holding the token in value position (': NaN,') or the marker text itself
    stops the fast path there (never misread); yajl then refuses the NaN and the in-memory reader takes the file."""
    from unittest import mock

    from msprobe_ci.dump import scan as stream
    from msprobe_ci.dump.writer import dump_json_text

    items = {"A.x.0.forward": {"Max": math.nan, "Min": -math.inf, "Mean": math.inf, "Norm": [math.nan, 1.5]},
             "A.z.0.forward": {"value": "Infinity or NaN", "n": math.nan, "s": "NaN"}}
    path = tmp_path / "dump.json"
    path.write_text(dump_json_text({"task": "statistics", "level": "mix"}, items))
    want = list(json.loads(path.read_text())["data"].items())
    with mock.patch.object(stream, "_CHUNK", chunk):
        got = list(stream.iter_items(str(path)))
    assert json.dumps(got) == json.dumps(want)
    assert math.isnan(got[0][1]["Max"]) and got[0][1]["Min"] == -math.inf and got[1][1]["s"] == "NaN"
    for tricky in ("x: NaN, y", "[Infinity]", "@msprobe-ci-nonfinite:NaN"):
        path.write_text(dump_json_text({"task": "statistics", "level": "mix"},
                                       {**items, "A.m.0.forward": {"value": tricky, "n": math.nan}}))
        with mock.patch.object(stream, "_CHUNK", 8), open(path, "rb") as fh:
            fast = list(stream._chunked_items(fh))
        assert json.dumps(fast) == json.dumps(want)  # up to the tricky entry, and not past it
        with pytest.raises(stream.NotStreamable):
            list(stream.iter_items(str(path)))
