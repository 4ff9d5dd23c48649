"""Bad inputs give one clear line naming the file, never a deep traceback; nothing is executed or lost."""

import os
import shutil

import pytest
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
        compare_dumps(load_dump(str(t)), load_dump(str(b)))


def test_pt_that_is_not_a_tensor_is_not_executed(fixtures_dir, tmp_path):
    t = _copy(fixtures_dir, "bf16_tensor", tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save(Evil(), t / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    b = _copy(fixtures_dir, "fp32_tensor", tmp_path)
    with pytest.raises(MsprobeError, match="Functional.linear.0.forward.output.0.pt: not a loadable tensor file"):
        compare_dumps(load_dump(str(t)), load_dump(str(b)))
    assert not marker.exists()
    torch.save({"a": 1}, t / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    with pytest.raises(MsprobeError, match="expected a torch.Tensor, found dict"):
        compare_dumps(load_dump(str(t)), load_dump(str(b)))


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
