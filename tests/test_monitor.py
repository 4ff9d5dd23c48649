"""Training monitor (msprobe's TrainerMon) on a stock transformers Llama: benign AdamW runs raise no alert in fp32 or
bf16; an exploding layer and a NaN are named at their first step and module; files are msprobe-style CSVs, an
SQLite time series and a PNG."""

import csv
import json
import math
import sqlite3

import pytest
import torch

from msprobe_ci import MsprobeError, TrainerMon

transformers = pytest.importorskip("transformers")


def _llama(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _train(model, mon, steps, seed=0, before=lambda step, model, ids: None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon.set_monitor(model, opt)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        before(step, model, ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mon.record_loss(loss)
        opt.step()
        opt.zero_grad()
    return mon.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_benign_training_raises_no_alert_and_writes_the_time_series(tmp_path, dtype, seed):
    report = _train(_llama(dtype, seed), TrainerMon(tmp_path / "mon"), 10, seed)
    assert report.passed and report.steps == 10 and len(report.losses) == 10
    with sqlite3.connect(report.db) as db:
        stages = {r[0] for r in db.execute("SELECT DISTINCT stage FROM monitor_metrics")}
        steps = db.execute("SELECT COUNT(DISTINCT step) FROM monitor_metrics").fetchone()[0]
    assert {"loss", "actv", "actv_grad", "post_grad", "exp_avg", "exp_avg_sq"} <= stages and steps == 10
    with open(tmp_path / "mon" / "actv_0-9.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:3] == ["vpp_stage", "name", "step"] and {"norm", "min", "max", "nans"} <= set(rows[0])
    assert any(r["name"] == "model.layers.1.mlp.down_proj.output" for r in rows)
    assert report.png and (tmp_path / "mon" / "monitor.png").stat().st_size > 1000
    assert json.loads((tmp_path / "mon" / "anomaly.json").read_text()) == []


def test_an_exploding_layer_is_named_at_its_first_step(tmp_path):
    def explode(step, model, ids):
        if step == 5:
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight.mul_(100)
    report = _train(_llama(), TrainerMon(tmp_path / "mon"), 8, before=explode)
    first = report.first
    assert (first.step, first.stage, first.name, first.rule) == (5, "actv", "model.layers.1.mlp.down_proj.output",
                                                                 "AnomalyJump")
    assert first.value > 10 * first.median and "jumped to" in first.message
    assert all(a.step >= 5 for a in report.anomalies)


def test_a_nan_is_named_where_it_enters(tmp_path):
    def poison(step, model, ids):
        if step == 3:
            with torch.no_grad():
                model.model.embed_tokens.weight[int(ids[0, 0])] = math.nan
    report = _train(_llama(), TrainerMon(tmp_path / "mon"), 5, before=poison)
    first = report.first
    assert (first.step, first.stage, first.name, first.rule) == (3, "actv", "model.embed_tokens.output",
                                                                 "AnomalyNan")


def test_bad_settings_and_an_existing_monitor_db_are_one_line_errors(tmp_path):
    with pytest.raises(MsprobeError, match="alert_factor: expected a number > 1"):
        TrainerMon(tmp_path, alert_factor=1)
    with pytest.raises(MsprobeError, match="warmup: expected an int >= 1"):
        TrainerMon(tmp_path, warmup=0)
    _train(_llama(), TrainerMon(tmp_path / "mon"), 1)
    with pytest.raises(MsprobeError, match="monitor.db already exists"):
        TrainerMon(tmp_path / "mon")
    with pytest.raises(MsprobeError, match="expected a torch.nn.Module"):
        TrainerMon(tmp_path / "other").set_monitor(lambda x: x)


PLUGIN_TEST = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def batches(n=4):
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 128, (1, 8), generator=g)
                                                         for _ in range(n))]


def loop(msprobe, explode_at=None):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with msprobe.monitor(model, opt) as mon:
        for step, batch in enumerate(batches(6)):
            if step == explode_at:
                with torch.no_grad():
                    model.model.layers[0].mlp.down_proj.weight.mul_(1000)
            loss = model(**batch).loss
            loss.backward()
            mon.record_loss(loss)
            opt.step()
            opt.zero_grad()
    return mon.report


def test_own_loop(msprobe):
    assert loop(msprobe).steps == 6


def test_own_loop_exploding(msprobe):
    loop(msprobe, explode_at=4)


def test_check_training_monitored(msprobe):
    r = msprobe.check_training(build(), batches(), lambda out: out.loss,
                               lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False))
    assert len(r["losses"]["target"]) == 4
"""


def test_plugin_monitor_fails_at_the_first_anomaly_and_check_training_monitors_both_sides(pytester):
    pytester.makepyfile(test_mon=PLUGIN_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-monitor",
                                           "--msprobe-target-dtype=bf16", "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*msprobe: monitor: first anomaly at step 4: model.layers.0.mlp.down_proj.output: "
                                 "actv norm * jumped to *x the median * (AnomalyJump)*Plot: *monitor.png*"])
    result.stdout.fnmatch_lines(["*note: monitor: target 0 anomalies (0 not on the bench), bench 0; plot *"])
    out = pytester.path / "msprobe-out"
    for side in ("bench", "target"):
        assert (out / "test_mon.py_test_check_training_monitored" / "check0" / "monitor" / side / "monitor.db").is_file()
    junit = (pytester.path / "j.xml").read_text()
    assert 'name="step 4"' in junit and "test_mon.test_own_loop_exploding check 0" in junit
