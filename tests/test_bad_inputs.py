"""Bad inputs give one clear line naming the file, never a deep traceback; nothing is executed or lost."""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
import torch

from msprobe_ci import MsprobeError
from msprobe_ci.compare import compare_dumps
from msprobe_ci.dump import load_dump


def _copy(fixtures_dir, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(fixtures_dir, name, "step0", "proc0"), dst)
    return dst


def test_malformed_json(tmp_path):
    (tmp_path / "dump.json").write_text('{"data": {"a": [1, }')
    with pytest.raises(MsprobeError, match=r"dump.json: malformed JSON \(.* at line 1 column"):
        load_dump(str(tmp_path))


def test_missing_data_object(tmp_path):
    (tmp_path / "dump.json").write_text('{"task": "statistics"}')
    with pytest.raises(MsprobeError, match="expected a JSON object with a 'data' object"):
        load_dump(str(tmp_path))


def test_missing_tensor_file(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    os.remove(t / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    b = _copy(fixtures_dir, "fp32_tensor", tmp_path)
    with pytest.raises(MsprobeError, match=r"Functional.linear.0.forward.output.0.pt: tensor file listed in dump.json is missing"):
        compare_dumps(bench=load_dump(str(b)), target=load_dump(str(t)))


def test_pt_that_is_not_a_tensor_is_not_executed(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save(Evil(), t / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    b = _copy(fixtures_dir, "fp32_tensor", tmp_path)
    with pytest.raises(MsprobeError, match="Functional.linear.0.forward.output.0.pt: not a loadable tensor file"):
        compare_dumps(bench=load_dump(str(b)), target=load_dump(str(t)))
    assert not marker.exists()
    torch.save({"a": 1}, t / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    with pytest.raises(MsprobeError, match="expected a torch.Tensor, found dict"):
        compare_dumps(bench=load_dump(str(b)), target=load_dump(str(t)))


def test_data_name_cannot_escape(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    with pytest.raises(MsprobeError, match="points outside dump_tensor_data"):
        load_dump(str(t)).load_tensor("../../etc/passwd")


def test_bad_fault_file(tmp_path):
    from msprobe_ci.capture import load_faults

    f = tmp_path / "f.yaml"
    f.write_text("faults:\n  - {api: Functional.linear, perturb: squash, value: 2}\n")
    with pytest.raises(MsprobeError, match=r"f.yaml: faults\[0\].perturb: expected one of scale, offset, noise, got 'squash'"):
        load_faults(str(f))


# --------------------------------------------------------------------------- dump records that must not pass silently
def _linear_dump(fixtures_dir, tmp_path, mutate):
    t = _copy(fixtures_dir, "bf16_statistics", tmp_path)
    doc = json.loads((t / "dump.json").read_text())
    mutate(doc["data"])
    (t / "dump.json").write_text(json.dumps(doc))
    return t


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["Functional.linear.0.forward"]["input_args"][0].update(Max="big"),
     r"dump.json: data\['Functional.linear.0.forward'\].input_args\[0\].Max: 'big' must be number or boolean or null"),
    (lambda d: d["Functional.linear.0.forward"]["input_args"][0].update(dtype="torch.float128"),
     r"input_args\[0\].dtype: 'torch.float128' is not a known torch or MindSpore dtype"),
    (lambda d: d.update({"Functional.linear.0.forward": "a string"}),
     r"data\['Functional.linear.0.forward'\]: 'a string' must be object"),
    (lambda d: d["Functional.linear.0.forward"].update(input_args={"0": {}}),
     r"data\['Functional.linear.0.forward'\].input_args: a JSON object must be array"),
    (lambda d: d["Functional.linear.0.forward"].update(output=d["Functional.linear.0.forward"]["output"][0]),
     r"data\['Functional.linear.0.forward'\].output: a JSON object must NOT match a disallowed definition"),
    (lambda d: d["Functional.linear.0.forward"]["input_args"][0].update(shape="4,16"),
     r"input_args\[0\].shape: '4,16' must be array"),
    (lambda d: d["Functional.linear.0.forward"]["input_args"][0].update(shape=[4, -16]),
     r"input_args\[0\].shape\[1\]: -16 must be bigger than or equal to 0"),
    (lambda d: d["Functional.linear.0.forward"]["output"][0].update(data_name="Functional.relu.0.forward.output.0.pt"),
     r"data\['Functional.linear.0.forward'\]: data_name 'Functional.relu.0.forward.output.0.pt' belongs to another"),
])
def test_schema_violations_are_one_line_naming_entry_and_field(fixtures_dir, tmp_path, mutate, message):
    with pytest.raises(MsprobeError, match=message):
        load_dump(str(_linear_dump(fixtures_dir, tmp_path, mutate)))


def test_duplicate_key_and_deep_nesting_and_not_a_dump(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_statistics", tmp_path)
    text = (t / "dump.json").read_text()
    first = text.index('"Functional.linear.0.forward"')
    dup = text[:first] + '"Functional.linear.0.forward": {},\n' + text[first:]
    (t / "dump.json").write_text(dup)
    with pytest.raises(MsprobeError, match=r"dump.json: duplicate key 'Functional.linear.0.forward'"):
        load_dump(str(t))
    deep = '{"data": {"Torch.add.0.forward": {"input_args": ' + "[" * 100_000 + "]" * 100_000 + "}}}"
    (t / "dump.json").write_text(deep)
    with pytest.raises(MsprobeError, match="dump.json: .*nested too deeply"):
        load_dump(str(t))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(MsprobeError, match=r"x.csv: not a dump; expected a dump.json"):
        load_dump(str(tmp_path / "x.csv"))


def test_grouped_stack_entry_that_is_a_string(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_statistics", tmp_path)
    (t / "stack.json").write_text(json.dumps({"0": "not a group"}))
    with pytest.raises(MsprobeError, match=r"stack.json: entry '0': expected \[\[names\], \[frames\]\]"):
        load_dump(str(t))


def test_pt_whose_shape_disagrees_with_dump_json(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    b = _copy(fixtures_dir, "fp32_tensor", tmp_path)
    name = "Functional.linear.0.forward.output.0.pt"
    torch.save(torch.zeros(3, 3, dtype=torch.bfloat16), t / "dump_tensor_data" / name)
    with pytest.raises(MsprobeError, match=rf"{name}: holds shape \[3, 3\], dump.json says \[4, 32\]"):
        compare_dumps(bench=load_dump(str(b)), target=load_dump(str(t)))


def test_complex_tensors_compare_as_complex():
    from msprobe_ci.compare import metrics as M

    a = torch.tensor([1 + 1j, 2 + 2j, 3 - 1j], dtype=torch.complex64)
    b = torch.tensor([1 + 1j, 2 - 2j, 3 - 1j], dtype=torch.complex64)  # differs in the imaginary part only
    cols = M.tensor_metrics(M.to_array(a), M.to_array(b))
    assert cols["MaxAbsErr"] == pytest.approx(4.0)
    assert M.tensor_metrics(M.to_array(a), M.to_array(a.clone()))["MaxAbsErr"] == 0.0


# --------------------------------------------------------------------------- outputs: nothing of the user's is lost
def test_cli_outputs_never_land_on_inputs_or_user_files(fixtures_dir, tmp_path):
    import subprocess
    import sys

    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    before = (t / "dump.json").read_bytes()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "msprobe_ci.cli", *args], capture_output=True, text=True)

    r = run("api-check", "-api_info", str(t / "dump.json"), "-o", str(tmp_path / "o"), "--junitxml", str(t / "dump.json"))
    assert r.returncode == 2 and "is an input of this run; refusing to write an output onto it" in r.stderr
    assert (t / "dump.json").read_bytes() == before
    (tmp_path / "notes.txt").write_text("mine")
    r = run("api-check", "-api_info", str(t), "-o", str(tmp_path / "o"), "--junitxml", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and "exists and was not written by msprobe-ci" in r.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    r = run("overflow", "-i", str(t), "-o", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and "exists and is a file, expected a folder" in r.stderr
    for n in ("0", "-3", "x"):
        r = run("api-check", "-api_info", str(t), "-n", n)
        assert r.returncode == 2 and "-n/--num_workers" in r.stderr and "Traceback" not in r.stderr
    # a dump root (step folders) is accepted, as compare and graph accept it
    root = tmp_path / "root"
    shutil.copytree(os.path.join(fixtures_dir, "bf16_tensor"), root)
    r = run("api-check", "-api_info", str(root), "-o", str(tmp_path / "o3"))
    assert r.returncode == 0 and "API calls: pass" in r.stdout, r.stderr


def test_owned_dir_refuses_unmarked_folders_and_replaces_ours(tmp_path):
    from msprobe_ci.outputs import MARKER, owned_dir

    user = tmp_path / "graphs" / "test_x.check0"
    user.mkdir(parents=True)
    (user / "keep.txt").write_text("mine")
    with pytest.raises(MsprobeError, match="was not written by msprobe-ci"):
        owned_dir(str(user))
    assert (user / "keep.txt").read_text() == "mine"
    ours = owned_dir(str(tmp_path / "ours"), "t")
    (tmp_path / "ours" / "old.csv").write_text("x")
    owned_dir(ours, "t")
    assert sorted(os.listdir(ours)) == [MARKER]


def test_reserved_names_are_unique_across_concurrent_writers(tmp_path):
    """Two processes naming outputs in the same second never get the same file (O_EXCL reservation)."""
    from concurrent.futures import ProcessPoolExecutor

    from msprobe_ci.outputs import reserve

    with ProcessPoolExecutor(2) as pool:
        paths = list(pool.map(reserve, [str(tmp_path)] * 40, ["compare_result"] * 40, [".csv"] * 40))
    assert len(set(paths)) == 40


@pytest.mark.parametrize("args, message", [
    (["--msprobe-fuzz=-5"], "*--msprobe-fuzz: expected 0 or more examples per API, got -5*"),
    (["--msprobe-out=afile"], "*afile: --msprobe-out exists and is a file, expected a folder*"),
    (["--msprobe-out=afile/sub"], "*afile/sub: --msprobe-out cannot be created (*afile is a file)*"),
    (["--msprobe-junitxml=dump.json"], "*dump.json: --msprobe-junitxml exists and was not written by msprobe-ci*"),
    (["--junitxml=adir"], "*--junitxml must be a filename, given: adir*"),  # pytest's own check
    (["--msprobe-junitxml=adir"], "*adir: --msprobe-junitxml is a folder, expected a file path*"),
])
def test_bad_output_options_fail_at_start(pytester, args, message):
    pytester.makefile(".json", dump='{"data": {}}')
    pytester.makefile("", afile="x")
    pytester.mkdir("adir")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    assert result.ret == 4
    result.stderr.fnmatch_lines([message])
    assert (pytester.path / "dump.json").read_text() == '{"data": {}}'


@pytest.mark.parametrize("ini, message", [
    ("msprobe_level = L2", "*msprobe: ini msprobe_level: expected one of L0, L1, mix, got 'L2'*"),
    ("msprobe_bench_kernel = exact", "*msprobe: ini msprobe_bench_kernel: expected one of device, upcast, rounded, "
                                     "decomposed, got 'exact'*"),
    ("msprobe_output_rtol = -1", "*msprobe: ini msprobe_output_rtol: expected a positive number, got '-1'*"),
    ("msprobe_fuzz = many", "*msprobe: ini msprobe_fuzz: invalid literal for int()*"),
    ("msprobe_bench = tpu", "*msprobe: ini msprobe_bench: *tpu*"),
])
def test_an_ini_value_is_parsed_by_its_flags_own_parser(pytester, ini, message):
    """One declaration, one parse: the option table's parser refuses a bad ini value as it refuses the flag, with
    one line naming the ini key, before any test runs."""
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 4
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize("xdist", [False, True])
def test_unknown_marker_option_is_that_tests_error(pytester, xdist):
    """A typo in one test's marker errors that test at setup, in one line, before it runs; the others run (it
    used to stop the session with exit 4, and under xdist end in an INTERNALERROR)."""
    pytester.makepyfile("import pytest\n@pytest.mark.msprobe(taregt='cpu')\ndef test_x(msprobe):\n"
                        "    raise AssertionError('never runs')\n\ndef test_y():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *(["-n", "2"] if xdist else []))
    result.assert_outcomes(passed=1, errors=1)
    assert result.ret == 1 and "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert "never runs" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*msprobe: test_*.py::test_x: @pytest.mark.msprobe: unknown option(s) ?'taregt'?*"])


@pytest.mark.parametrize("args,message", [
    (["--rank_size", "2", "--tp", "2"], r"bf16_statistics/step0: --rank_size 2: expected 2 rank folders \(ranks "
                                        r"0..1\), found ranks \[0\]"),
    (["--tp", "3"], r"--rank_size 1 is not divisible by --tp 3 x --pp 1"),
    (["--vpp", "2"], r"--vpp 2: virtual pipeline stages are not merged; only --vpp 1 is supported"),
    (["--tp", "1", "1", "1"], r"--tp: expected one value \(both sides\) or two \(target, bench\), got 3"),
    (["--order", "tp-pp", "--tp", "1"], r"--order 'tp-pp': expected the dimensions tp, dp and pp"),
    (["--tp", "1", "-fm"], r"merging combines with -lm/-cm, not with -fm, -dm or -am"),
])
def test_rank_merge_flags_give_one_line_errors(fixtures_dir, tmp_path, args, message):
    """Layouts that do not fit the dumps, or flags merging cannot honour: exit 2 with one line naming them."""
    import re
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", "compare", "-tp",
                          os.path.join(fixtures_dir, "bf16_statistics"), "-gp",
                          os.path.join(fixtures_dir, "fp32_statistics"), "-o", str(tmp_path / "o")] + args,
                         capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert re.search(message, run.stderr), run.stderr
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


# --------------------------------------------------------------------------- the schema's fast path
_SCALAR = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=3)
_ENTRY_KEYS = ["input_args", "input_kwargs", "input", "output", "parameters", "extra"]
_NAMES = st.sampled_from(["Functional.x.0.forward", "Module.m.Linear.forward.0"])


def _tensor():
    from msprobe_ci.dump.validate import _TENSOR_TYPES, _dtypes

    stat = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    return st.fixed_dictionaries(
        {"type": st.sampled_from(sorted(_TENSOR_TYPES)), "dtype": st.sampled_from(sorted(_dtypes())),
         "shape": st.lists(st.integers(0, 4), max_size=3)},
        optional={"Max": stat, "Min": stat, "Mean": stat, "Norm": stat,
                  "requires_grad": st.booleans() | st.none() | st.text(max_size=3),
                  "data_name": st.just("Functional.x.0.forward.input.0.pt"), "md5": st.text(max_size=3),
                  "extra": _SCALAR})


def _valid_docs():
    """Parsed dump.json documents of many shapes, all valid under the schema."""
    keys = st.sampled_from(["value", "a", "0", "dtype"])
    leaf = _SCALAR | _tensor() | st.fixed_dictionaries({"type": st.sampled_from(["int", "torch.Size", "slice"]),
                                                        "value": _SCALAR | st.lists(_SCALAR, max_size=2)})
    value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(keys, kids, max_size=3),
                         max_leaves=10)
    entry = st.fixed_dictionaries({}, optional={
        "input_args": st.lists(value, max_size=3), "input_kwargs": st.dictionaries(keys, value, max_size=2),
        "output": st.lists(value, max_size=2) | st.dictionaries(st.sampled_from(["logits", "0"]), value, max_size=2),
        "parameters": st.dictionaries(keys, value, max_size=2), "extra": value})
    header = st.text(max_size=3)
    return st.fixed_dictionaries({"data": st.dictionaries(_NAMES, entry, min_size=1, max_size=2)},
                                 optional={"task": header, "level": header, "framework": header,
                                           "dump_data_dir": header | st.none()})


# what a broken or hostile writer puts in one place: wrong JSON types, negative sizes, records that lie
_JUNK = (_SCALAR | st.integers(-3, -1) | st.just("") | st.sampled_from(["torch.float128", "torch.Tensor"])
         | st.lists(_SCALAR, max_size=2) | st.dictionaries(st.sampled_from(["type", "dtype", "shape", "Max"]), _SCALAR,
                                                            max_size=3))


def _slots(node, parent=None):
    """Every (container, key, the container's own key) of a parsed JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield node, k, parent
        yield from _slots(v, k)


_FIELDS = {"data", "output", "input_args", "input_kwargs", "parameters", "type", "dtype", "shape", "Max", "Norm",
           "requires_grad", "data_name", "md5", "value", "task", "dump_data_dir"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_valid_docs())
def test_schema_fast_path_takes_valid_dumps(doc):
    """Valid documents of every shape pass both the compiled schema and the fast path (so the fast path is used)."""
    from msprobe_ci.dump.validate import _surely_valid, _validator

    _validator()(doc)
    assert _surely_valid(doc)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_valid_docs(), data=st.data())
def test_schema_fast_path_accepts_only_what_the_schema_accepts(doc, data):
    """``_surely_valid`` lets a dump skip the compiled schema: a valid document with one value replaced by junk
    (anywhere: header, entry, record field, shape item) is accepted by the fast path only if the schema accepts it."""
    import fastjsonschema

    from msprobe_ci.dump.validate import _surely_valid, _validator

    slots = list(_slots(doc))
    fields = [s for s in slots if s[1] in _FIELDS or s[2] == "shape"]  # half the draws: a named field
    container, key, _ = data.draw(st.sampled_from(fields) if fields and data.draw(st.booleans())
                                  else st.sampled_from(slots))
    container[key] = data.draw(_JUNK)
    if _surely_valid(doc):
        try:
            _validator()(doc)
        except fastjsonschema.JsonSchemaValueException as exc:
            pytest.fail(f"fast path accepted what the schema rejects: {exc.message}")


def test_schema_fast_path_takes_real_dumps(fixtures_dir):
    """msprobe's own dumps (PyTorch and MindSpore, statistics and tensor) go through the fast path."""
    from msprobe_ci.dump.validate import _surely_valid

    files = [os.path.join(root, "dump.json") for root, _, names in os.walk(fixtures_dir) if "dump.json" in names]
    assert len(files) >= 4
    for f in files:
        with open(f, encoding="utf-8") as fh:
            assert _surely_valid(json.load(fh)), f


_KILLED_MIDWAY = """
import os, signal, sys
from msprobe_ci.compare import csvout
from msprobe_ci.graph import db
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
db.VisDbWriter.add_node = die          # the graph writer dies at its first node
csvout.RowWriter.write = die           # the CSV writer at its first row
from msprobe_ci.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["graph", "compare"])
def test_killed_writer_leaves_no_file_under_a_final_name(fixtures_dir, tmp_path, command):
    """``kill -9`` while a graph or a compare CSV is written: no empty or partial ``*.vis.db``/``*.csv`` under a
    final name (the viewer would list it), only hidden files; the next run writes a complete file beside them."""
    import sqlite3
    import subprocess
    import sys

    from msprobe_ci.cli import main

    target = os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0")
    bench = os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0")
    out = tmp_path / "out"
    args = [command, "-tp", target, "-gp", bench, "-o", str(out)]
    proc = subprocess.run([sys.executable, "-c", _KILLED_MIDWAY, *args], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert os.listdir(out), "the writer was killed before it created anything"
    assert [f for f in os.listdir(out) if not f.startswith(".")] == []
    main(args)  # the next run, in the same folder and maybe the same second
    done = [f for f in os.listdir(out) if not f.startswith(".")]
    assert len(done) == 1, os.listdir(out)
    path = out / done[0]
    if command == "graph":
        assert done[0].startswith("compare_") and done[0].endswith(".vis.db")
        assert sqlite3.connect(path).execute("SELECT count(*) FROM tb_config").fetchone() == (1,)
    else:
        assert done[0].startswith("compare_result_") and path.read_text().count("\n") > 10


def test_reserved_name_appears_only_when_written(tmp_path):
    """:func:`reserve` holds a name by a hidden claim; the file appears when published; a failed write gives
    the name back and leaves nothing."""
    from msprobe_ci.outputs import atomic_write, reserve

    path = reserve(str(tmp_path), "compare_result", ".csv")
    assert not os.path.exists(path) and os.listdir(tmp_path) == [f".{os.path.basename(path)}.claim"]
    assert reserve(str(tmp_path), "compare_result", ".csv") != path  # held
    with pytest.raises(RuntimeError):
        with atomic_write(path) as fh:
            fh.write("half")
            raise RuntimeError
    assert not os.path.exists(path) and f".{os.path.basename(path)}.claim" not in os.listdir(tmp_path)
    path = reserve(str(tmp_path), "x", ".csv")
    with atomic_write(path) as fh:
        fh.write("whole")
    assert Path(path).read_text() == "whole" and not any(f.startswith(".x_") for f in os.listdir(tmp_path))


def _deep_dump(folder, depth):
    folder.mkdir()
    (folder / "dump.json").write_text(
        '{"task":"statistics","level":"L1","framework":"pytorch","dump_data_dir":null,"data":'
        '{"Functional.relu.0.forward":{"input_args":[],"output":[]},'
        '"Functional.linear.0.forward":{"input_args":' + "[" * depth + "]" * depth + ',"output":[]}}}')
    for name in ("stack.json", "construct.json"):
        (folder / name).write_text("{}")
    return str(folder)


@pytest.mark.parametrize("command", ["compare", "graph"])
def test_absurd_nesting_is_refused_at_once(tmp_path, capsys, command):
    """A compact one-line dump with 100,000 nested arrays (yajl's prefixes made it minutes and all the memory):
    refused before parsing, one line naming the entry and field."""
    from msprobe_ci.cli import main

    target, bench = _deep_dump(tmp_path / "t", 100_000), _deep_dump(tmp_path / "b", 100_000)
    assert main([command, "-tp", target, "-gp", bench, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "dump.json: JSON nested deeper than 1000 levels in data['Functional.linear.0.forward']['input_args'] " \
           "at byte 1" in err


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, 1 << 22])
def test_nesting_check_counts_brackets_outside_strings_across_blocks(tmp_path, chunk):
    """Brackets and escaped quotes inside strings do not count, wherever a block boundary falls."""
    from msprobe_ci.dump.validate import check_nesting

    value = '[[[\\\\\\"{{{ ]'  # the JSON text of a string holding brackets, a backslash and a quote
    body = ('{"task":"statistics","data":{"A.b.0.forward":{"input_args":[{"type":"str","value":"' + value + '"}]},'
            '"X.y.1.forward":{"output":' + "[" * 30 + "]" * 30 + "}}}")
    json.loads(body)
    path = tmp_path / "dump.json"
    path.write_text(body)
    check_nesting(str(path), limit=33, chunk=chunk)  # top, data, entry + 30
    with pytest.raises(MsprobeError, match=r"nested deeper than 32 levels in data\['X.y.1.forward'\]\['output'\] "
                                           rf"at byte {body.index('[' * 30) + 29}; "):
        check_nesting(str(path), limit=32, chunk=chunk)
