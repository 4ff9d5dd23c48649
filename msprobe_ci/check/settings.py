"""One check's settings, merged and validated once: :class:`CheckSettings` (frozen) from layers of options.

Layers, lowest first: the run's (command line over ini), the test's marker, the call's keywords. The old name
``atol`` of ``rel_floor`` is read here only (:func:`merge`): set at a layer without ``rel_floor``, it wins below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import MsprobeError

#: the options of a check: ``msprobe.check(..., **options)`` and ``@pytest.mark.msprobe(...)``
CHECK_OPTIONS = ("bench", "target", "bench_dtype", "target_dtype", "bench_autocast", "target_autocast", "target_fp8",
                 "level", "task", "inject", "seed", "fuzzy", "compile", "isolate", "isolate_budget", "bench_kernel",
                 "oracle_device", "output_rtol", "round_factor", "propagation",
                 "error_factor", "rel_floor", "atol", "api_standards", "api_thresholds", "free_benchmark", "monitor")

_RULE_FACTORS = ("round_factor", "propagation", "error_factor", "rel_floor")


def check_keys(options: Mapping, where: str) -> None:
    """Refuse option names a check does not take.

    Raises:
        MsprobeError: ``{where}: unknown option(s) [...]; allowed: [...]``.
    """
    unknown = sorted(set(options) - set(CHECK_OPTIONS))
    if unknown:
        raise MsprobeError(f"{where}: unknown option(s) {unknown}; allowed: {list(CHECK_OPTIONS)}")


def merge(layers: Sequence[Mapping[str, Any]]) -> dict:
    """The options of ``layers`` merged, later layers winning. The old name ``atol`` of ``rel_floor`` is read here
    only: given at a layer without a ``rel_floor`` of its own, it sets ``rel_floor`` there; the merged options hold
    ``rel_floor`` alone."""
    merged: dict = {}
    for layer in layers:
        merged.update(layer)
        if layer.get("atol") not in (None, "") and layer.get("rel_floor") in (None, ""):
            merged["rel_floor"] = layer["atol"]
    merged.pop("atol", None)
    return merged


def thresholds(options: Mapping[str, Any]):
    """The drift rule's :class:`~msprobe_ci.compare.verdict.Thresholds` from merged options (:func:`merge`): the
    rule factors they set, the rule's defaults for the others.

    Raises:
        MsprobeError: a factor that is not a non-negative number (``error_factor`` below 1).
    """
    from ..compare import Thresholds

    return Thresholds.from_mapping({k: options.get(k) for k in _RULE_FACTORS})


@dataclass(frozen=True)
class CheckSettings:
    """Everything one check was told, validated: both backends, capture, faults, isolation, rules.

    Attributes:
        bench, target: :class:`~msprobe_ci.backends.Backend` of each side (the target compiled when asked and
            the mode supports it).
        bench_device, target_device, bench_dtype, target_dtype: the options as given (sent to rank processes
            and baseline manifests; a dtype of ``None`` keeps the model's own).
        bench_autocast, target_autocast: each side's AMP as given (``fp16``/``bf16``: its forward and loss under
            ``torch.autocast`` on its own weights, :attr:`~msprobe_ci.backends.Backend.autocast`; ``None``: none).
            The target's ``target_fp8`` option is :attr:`~msprobe_ci.backends.Backend.fp8` of :attr:`target`.
        level: ``L0``, ``L1`` or ``mix``. task: ``statistics``, ``tensor`` or ``md5``.
        inject: the check's own fault file (``None``: the run's). faults: the faults applied to the target.
        seed: ``torch.manual_seed`` of each side (default 1234). fuzzy: msprobe's fuzzy name matching.
        isolate: isolated verdicts (each target API judged on its own inputs).
        isolate_budget: budgeted isolation's cost factor (:mod:`msprobe_ci.isolate.budget`), or ``None``: every
            call isolated. rotation_seed: what seeds its rotation (the test id).
        bench_kernel: the same-dtype bench of the per-API standards (:mod:`msprobe_ci.kernels`).
        oracle_device: ``cpu`` or ``target`` as resolved for this target (:meth:`oracle_choice`).
        output_rtol: the model-level relative L2 tolerance, or ``None`` (the dtype's default).
        thresholds: the drift rule's factors (:class:`~msprobe_ci.compare.verdict.Thresholds`).
        api_standards: ``{API pattern: standard}``; api_thresholds: ``{standard: {threshold: value}}``.
        free_benchmark: a free-benchmark mode (no bench side) or ``None``/``False``. monitor: run TrainerMon
            in training checks.
    """

    bench: Any
    target: Any
    bench_device: str
    target_device: str
    bench_dtype: str | None
    target_dtype: str | None
    bench_autocast: str | None
    target_autocast: str | None
    level: str
    task: str
    inject: str | None
    faults: tuple
    seed: int
    fuzzy: bool
    isolate: bool
    bench_kernel: str
    oracle_device: str
    output_rtol: float | None
    thresholds: Any
    api_standards: dict
    api_thresholds: dict
    free_benchmark: Any
    monitor: bool
    isolate_budget: float | None = None
    rotation_seed: str = ""

    @classmethod
    def resolve(cls, options: Mapping[str, Any], *, run_faults: tuple = (), compile_target: bool = True,
                rotation_seed: str = "") -> "CheckSettings":
        """Validate merged options (:func:`merge`) into settings.

        Args:
            options: every key of :data:`CHECK_OPTIONS` the run defines, merged.
            run_faults: the run's fault plan, used when the check names no ``inject`` file of its own.
            compile_target: honour ``compile`` (the single check and the training and decode loops do; ranks run
                eagerly).
            rotation_seed: what seeds budgeted isolation's rotation (the fixture gives the test id).

        Raises:
            MsprobeError: an unknown device or dtype, a bad rule factor, an unreadable fault file, a bad
                ``isolate``, ``isolate_budget``, ``bench_kernel``, ``oracle_device`` or ``output_rtol``.
        """
        from ..backends import Backend
        from ..capture.inject import load_faults
        from ..config import check_factor

        o = options
        bench = Backend.from_options(o["bench"], o["bench_dtype"], autocast=o.get("bench_autocast"))
        target = Backend.from_options(o["target"], o["target_dtype"], bool(o.get("compile")) and compile_target,
                                      autocast=o.get("target_autocast"), fp8=bool(o.get("target_fp8")))
        rule = thresholds(o)
        faults = tuple(load_faults(o["inject"]) if o.get("inject") else run_faults)
        isolate = isolate_flag(o.get("isolate"))
        kernel = bench_kernel(o.get("bench_kernel"), bench, target)
        output_rtol = None if o.get("output_rtol") is None else positive(o["output_rtol"], "output_rtol")
        return cls(bench=bench, target=target, bench_device=o["bench"], target_device=o["target"],
                   bench_dtype=o["bench_dtype"], target_dtype=o["target_dtype"],
                   bench_autocast=o.get("bench_autocast"), target_autocast=o.get("target_autocast"),
                   level=o["level"], task=o["task"],
                   inject=o.get("inject"), faults=faults, seed=int(o.get("seed", 1234)), fuzzy=bool(o.get("fuzzy")),
                   isolate=isolate, bench_kernel=kernel,
                   oracle_device=oracle_choice(o.get("oracle_device"), target), output_rtol=output_rtol,
                   thresholds=rule, api_standards=dict(o.get("api_standards") or {}),
                   api_thresholds=dict(o.get("api_thresholds") or {}), free_benchmark=o.get("free_benchmark"),
                   monitor=bool(o.get("monitor")),
                   isolate_budget=check_factor(o.get("isolate_budget"), "option 'isolate_budget'"),
                   rotation_seed=str(rotation_seed))

    @property
    def cast_roundoff(self) -> float:
        """The unit roundoff of casting the bench's values to the dtype the target computes in (its dtype, its
        autocast dtype, e4m3 for an FP8 target; 0 where the bench is coarser)."""
        from ..compare.verdict import unit_roundoff

        def computed_in(side):  # under autocast a side computes (and rounds) in the autocast dtype; an FP8 side's
            # GEMMs round their inputs to e4m3
            if getattr(side, "fp8", False):
                return "torch.float8_e4m3fn"
            return side.autocast if getattr(side, "autocast", None) is not None else side.dtype
        return unit_roundoff(str(computed_in(self.target)), str(computed_in(self.bench)))

    @property
    def judge(self):
        """The :class:`~msprobe_ci.judge.JudgeSettings` of this check, passed whole to every judgement of it (a
        loop's later steps change only ``source_factor``: :meth:`~msprobe_ci.judge.JudgeSettings.for_step`)."""
        import copy
        import dataclasses

        from ..judge.settings import JudgeSettings

        # every judge field this object has by the same name (a field or a property): an option the judge reads is
        # declared on both and passes here without a line of its own; mappings copied, so the judge owns its own
        return JudgeSettings(**{f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(JudgeSettings)
                                if hasattr(self, f.name)})

    def isolator(self, backward: bool, target=None):
        """The target side's :class:`~msprobe_ci.isolate.Isolator` (``None`` with isolation off), from
        :attr:`judge` (:meth:`~msprobe_ci.isolate.Isolator.from_settings`): the bench kernel on the bench's device
        (the CPU where it is absent), the oracle where :attr:`oracle_device` says."""
        if not self.isolate:
            return None
        from ..isolate import Isolator

        target = self.target if target is None else target
        return Isolator.from_settings(self.judge, target_device=target.torch_device,
                                      bench_device=self.bench.torch_device if available(self.bench) else "cpu",
                                      backward=backward, **target.oracle_options(oracle_choice(self.oracle_device,
                                                                                                 target)))


def bench_kernel(option: str | None, bench, target) -> str:
    """The bench kernel of a check: the option, or :func:`msprobe_ci.kernels.default_bench_kernel` for the bench's
    device (the CPU where it is absent) and the target's."""
    from ..kernels import check_bench_kernel, default_bench_kernel

    if option:
        return check_bench_kernel(option)
    return default_bench_kernel(bench.torch_device if available(bench) else "cpu", target.torch_device,
                                target.device)


def oracle_choice(option: str | None, target) -> str:
    """``cpu`` (float64 on the CPU) or ``target`` (the target's device, at most its
    :attr:`~msprobe_ci.backends.Backend.oracle_max`: :meth:`~msprobe_ci.backends.Backend.oracle_options`); unset:
    ``target`` on CUDA, ``cpu`` elsewhere; a CPU target's oracle is the CPU's.

    Raises:
        MsprobeError: neither ``cpu`` nor ``target``.
    """
    choice = option or ("target" if target.kind == "cuda" else "cpu")
    if choice not in ("cpu", "target"):
        raise MsprobeError(f"option 'oracle_device': expected 'cpu' or 'target', got {choice!r}")
    return "cpu" if target.kind == "cpu" else choice


def available(backend) -> bool:
    """Whether ``backend``'s device is on this machine."""
    try:
        backend.check_available()
    except MsprobeError:
        return False
    return True


def isolate_flag(value: Any) -> bool:
    """``on``/``off`` (or a bool, ``true``/``false``, ``1``/``0``; ``None`` is off) as a bool.

    Raises:
        MsprobeError: anything else.
    """
    if value in (True, "on", "true", "1"):
        return True
    if value in (False, "off", "false", "0", None):
        return False
    raise MsprobeError(f"option 'isolate': expected 'on' or 'off' (or a bool), got {value!r}")


def positive(value: Any, name: str) -> float:
    """``value`` as a positive float.

    Raises:
        MsprobeError: not a number, or not above 0.
    """
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MsprobeError(f"option '{name}': expected a positive number, got {value!r}") from None
    if not v > 0:
        raise MsprobeError(f"option '{name}': expected a positive number, got {value!r}")
    return v
