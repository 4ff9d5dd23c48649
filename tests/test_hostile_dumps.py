"""Dumps are data, never code: a hostile dump cannot run a command, unpickle an object or write a file.

Each case is a real dump.json that names a dangerous function (``Torch.os.system``, ``Torch.load`` on a malicious
pickle, ``Torch.save`` to a path outside the output folder). Replay through the CLI, the pytest plugin and the
Python API must refuse it with a named skip, and nothing may execute or be written.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from msprobe_ci.dump import load_dump
from msprobe_ci.replay import allowlist
from msprobe_ci.replay import ApiReplayer as Replayer


def _tensor(shape=(2, 3)):
    return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": list(shape), "Max": 1.0, "Min": -1.0,
            "Mean": 0.0, "Norm": 1.0, "requires_grad": False}


def _str(v):
    return {"type": "str", "value": v}


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def hostile(tmp_path):
    """A statistics dump whose API entries name os.system, torch.load and torch.save, plus one honest entry."""
    root = tmp_path / "hostile"
    root.mkdir()
    marks = {k: tmp_path / f"pwned_{k}" for k in ("system", "load", "save", "getattr")}
    evil = tmp_path / "evil.pkl"
    with open(evil, "wb") as fh:
        pickle.dump(_Payload(marks["load"]), fh)
    out = _tensor()
    data = {
        "Torch.os.system.0.forward": {"input_args": [_str(f"touch {marks['system']}")], "input_kwargs": {},
                                      "output": [{"type": "int", "value": 0}]},
        "Torch.load.0.forward": {"input_args": [_str(str(evil))],
                                 "input_kwargs": {"weights_only": {"type": "bool", "value": False}},
                                 "output": [out]},
        "Torch.save.0.forward": {"input_args": [_tensor(), _str(str(marks["save"]))], "input_kwargs": {},
                                 "output": [None]},
        "Torch.__builtins__.getattr.0.forward": {"input_args": [_str("os"), _str(str(marks["getattr"]))],
                                                 "input_kwargs": {}, "output": [None]},
        "Tensor.apply_.0.forward": {"input_args": [_tensor(), _str("print")], "input_kwargs": {}, "output": [out]},
        "Functional.relu.0.forward": {"input_args": [_tensor()], "input_kwargs": {}, "output": [out]},
    }
    (root / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "pytorch",
                                                "dump_data_dir": None, "data": data}))
    return root, marks


def _nothing_happened(marks):
    assert [str(m) for m in marks.values() if m.exists()] == []


def test_replayer_refuses_every_dangerous_name(hostile):
    root, marks = hostile
    rep = Replayer(load_dump(str(root)), live=True)
    results = {n: rep.check(n) for n in rep.api_names()}
    _nothing_happened(marks)
    for name in ("Torch.os.system.0.forward", "Torch.load.0.forward", "Torch.save.0.forward",
                 "Torch.__builtins__.getattr.0.forward", "Tensor.apply_.0.forward"):
        assert results[name].status == "skip", (name, results[name])
        assert "not on the replay allowlist" in results[name].reason
    assert results["Functional.relu.0.forward"].status == "pass"


def test_cli_api_check_refuses_and_runs_nothing(hostile, tmp_path):
    root, marks = hostile
    r = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", "api-check", "-api_info", str(root / "dump.json"),
                        "-o", str(tmp_path / "out"), "--live"], capture_output=True, text=True, cwd=tmp_path)
    _nothing_happened(marks)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "pass 1, warning 0, error 0, skip 5" in r.stdout
    [details] = [f for f in os.listdir(tmp_path / "out") if f.startswith("accuracy_checking_details")]
    with open(tmp_path / "out" / details) as fh:
        text = fh.read()
    for name in ("Torch.os.system.0.forward", "Torch.load.0.forward", "Torch.save.0.forward"):
        assert any(name in line and "not on the replay allowlist" in line for line in text.splitlines()), name


def test_pytest_api_check_refuses_and_runs_nothing(hostile, pytester):
    root, marks = hostile
    result = pytester.runpytest_subprocess(f"--msprobe-api-check={root}", "--msprobe-api-live", "-p",
                                           "no:cacheprovider", "-rs")
    _nothing_happened(marks)
    result.stdout.fnmatch_lines(["*Torch.os.system: not on the replay allowlist*",
                                 "*Torch.load: not on the replay allowlist*",
                                 "*Torch.save: not on the replay allowlist*"])
    result.assert_outcomes(passed=1, skipped=5)


def test_allowlist_file_holds_only_tensor_operations():
    names = allowlist.allowed()
    for banned in ("load", "save", "from_file", "set_rng_state", "manual_seed", "seed", "compile", "vmap",
                   "frombuffer", "from_numpy", "asarray"):
        assert banned not in names["Torch"]
    for banned in ("apply_", "map_", "map2_", "storage", "untyped_storage", "share_memory_", "set_",
                   "register_hook", "backward", "tolist", "numpy", "__reduce_ex__", "__setstate__"):
        assert banned not in names["Tensor"]
    for prefix, listed in names.items():
        assert not [n for n in listed if allowlist.denied(n)]
        owner = {"Functional": torch.nn.functional, "Torch": torch, "Tensor": torch.Tensor}[prefix]
        for n in listed:  # every listed name is a real callable of this torch; nothing outside the three owners
            obj = owner
            for part in n.split("."):
                obj = getattr(obj, part)
            assert callable(obj), f"{prefix}.{n}"
    assert {"linear", "layer_norm", "scaled_dot_product_attention", "silu", "softmax"} <= names["Functional"]
    assert {"matmul", "rsqrt", "cat", "arange", "linalg.vector_norm"} <= names["Torch"]
    assert {"__add__", "__getitem__", "masked_fill", "add_", "to"} <= names["Tensor"]


def test_allowlist_file_is_what_generate_derives():
    """The committed data is reproducible from the installed torch (regenerate it when torch is upgraded)."""
    derived = allowlist.generate()
    for prefix in allowlist.PREFIXES:
        assert allowlist.allowed()[prefix] == frozenset(derived[prefix]), prefix
    # the private names replayed are exactly the compute functions the capture records, nothing else private
    assert {n for n in allowlist.allowed()["Torch"] if n.startswith("_") and not n.endswith("__")} == \
        {n for n in allowlist.PRIVATE_COMPUTE if hasattr(torch, n)}
    assert allowlist.denied("_foreach_add") and allowlist.denied("linalg._private") and \
        not allowlist.denied("_grouped_mm")


def test_oversized_statistics_shape_is_a_named_skip(tmp_path):
    """A shape of 1e12 elements is not allocated: the replay caps what it materialises and says so."""
    data = {"Functional.relu.0.forward": {"input_args": [_tensor((1_000_000, 1_000_000))], "input_kwargs": {},
                                          "output": [_tensor((1_000_000, 1_000_000))]}}
    (tmp_path / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": data}))
    res = Replayer(load_dump(str(tmp_path)), live=True).check("Functional.relu.0.forward")
    assert res.status == "skip" and "elements" in res.reason and "1000000000000" in res.reason
