"""``accuracy_checking_result_<ts>.csv`` and ``accuracy_checking_details_<ts>.csv`` with msprobe's columns
(``shared/spec/api-accuracy-checker.md`` §3.1: UTF-8 with BOM, unset cells a single space)."""

from __future__ import annotations

import csv
import os

from ..dump.writer import timestamped_path
from ..outputs import atomic_write, release
from .apis import parse_name
from .result import ApiResult

RESULT_COLUMNS = ["API name", "Forward Test Success", "Backward Test Success", "Message"]
DETAIL_COLUMNS = ["API Name", "Bench Dtype", "DEVICE Dtype", "Shape", "余弦相似度", "最大绝对误差", "双百指标", "双千指标",
                  "双万指标", "二进制一致错误率", "误差均衡性", "均方根误差", "小值域错误占比", "相对误差最大值", "相对误差平均值",
                  "inf/nan错误率", "相对误差错误率", "绝对误差错误率", "ULP误差最大值", "ULP误差平均值", "ULP误差大于阈值占比",
                  "Status", "Message"]
# our metric names -> msprobe detail column
_METRIC_COLUMNS = {"cosine": "余弦相似度", "max_abs_err": "最大绝对误差", "dual_hundredth": "双百指标",
                   "dual_thousandth": "双千指标", "rel_err_thousandth": "双千指标", "dual_ten_thousandth": "双万指标",
                   "mismatch_rate": "二进制一致错误率", "error_balance": "误差均衡性", "target_rmse": "均方根误差",
                   "target_small_value_err": "小值域错误占比", "target_max_rel_err": "相对误差最大值",
                   "target_mean_rel_err": "相对误差平均值", "inf_nan_err_ratio": "inf/nan错误率",
                   "rel_err_ratio": "相对误差错误率", "abs_err_ratio": "绝对误差错误率", "max_ulp": "ULP误差最大值",
                   "mean_ulp": "ULP误差平均值", "large_ulp_ratio": "ULP误差大于阈值占比"}


def _status(r: ApiResult | None) -> str:
    if r is None:
        return " "
    return "SKIP" if r.status == "skip" else r.status


def write_reports(results: list[ApiResult], out_dir: str) -> tuple[str, str]:
    """Write both CSVs; returns ``(result path, details path)``.

    Args:
        results: every checked entry (forward and backward).
        out_dir: output folder (created).
    """
    calls: dict[str, dict[str, ApiResult]] = {}
    for r in results:
        prefix, api, n, direction = parse_name(r.name)
        calls.setdefault(f"{prefix}.{api}.{n}", {})[direction] = r
    result_path = timestamped_path(out_dir, "accuracy_checking_result", ".csv")
    details_path = result_path.replace("accuracy_checking_result_", "accuracy_checking_details_")
    try:
        # details first: the result CSV, published last, releases the name both share
        with atomic_write(details_path, "w", newline="", encoding="utf-8-sig") as fh:
            w = csv.writer(fh)
            w.writerow(DETAIL_COLUMNS)
            for r in results:
                if r.status == "skip":
                    w.writerow([r.name] + [" "] * (len(DETAIL_COLUMNS) - 3) + ["SKIP", r.reason])
                    continue
                for row, check in r.outputs:
                    cells = dict.fromkeys(DETAIL_COLUMNS, " ")
                    bench_dt, dev_dt, shape = r.info.get(row, (" ", " ", " "))
                    cells.update({"API Name": row, "Bench Dtype": bench_dt, "DEVICE Dtype": dev_dt, "Shape": shape,
                                  "Status": check.status, "Message": f"{check.standard}: {check.message}"})
                    for k, v in check.metrics.items():
                        if k in _METRIC_COLUMNS:
                            cells[_METRIC_COLUMNS[k]] = v
                    w.writerow([cells[c] for c in DETAIL_COLUMNS])
        with atomic_write(result_path, "w", newline="", encoding="utf-8-sig") as fh:
            w = csv.writer(fh)
            w.writerow(RESULT_COLUMNS)
            for call, sides in calls.items():
                fwd, bwd = sides.get("forward"), sides.get("backward")
                message = next((s.reason for s in (fwd, bwd) if s is not None and s.status == "skip"), " ")
                w.writerow([call, _status(fwd), _status(bwd), message])
    finally:
        release(result_path)
    return result_path, os.path.abspath(details_path)
