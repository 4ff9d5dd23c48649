"""API identity → msprobe names (``Functional.linear``, ``Tensor.__add__``, ``Torch.matmul``).

L1 capture sees the function object that ``TorchFunctionMode`` is handed. This module maps it to msprobe's
prefix and API name, and classifies it:

* ``SKIP``: metadata and plumbing (``size``, ``dim``, property getters, ``backward``, ``__getitem__`` ...):
  neither counted nor recorded, as msprobe does not wrap them.
* ``LOW``: shape/view/dtype/creation APIs that msprobe's default ``risk_level: FOCUS`` leaves out of dump.json;
  they are still counted, so call numbers match msprobe's, and listed in construct.json at mix.
* ``RECORD``: everything else, and the private functions in :data:`COMPUTE_PRIVATE` (grouped and fp8 GEMMs).

Binary operators reach the mode as plain methods (``y + 1`` arrives as ``TensorBase.add``). The caller's bytecode
instruction tells them apart, so ``y + 1`` is named ``Tensor.__add__`` and ``y.add(1)`` ``Tensor.add``, as
msprobe names them.
"""

from __future__ import annotations

import dis
import os
import sys
from typing import Any

from ..replay.allowlist import PRIVATE_COMPUTE

SKIP, LOW, RECORD = 0, 1, 2

_SKIP_NAMES = frozenset("""
size dim ndimension numel nelement stride storage_offset is_contiguous data_ptr element_size is_floating_point
is_complex is_signed get_device tolist item type requires_grad_ retain_grad register_hook
register_post_accumulate_grad_hook backward untyped_storage storage is_leaf is_set_to is_shared is_pinned
__getitem__ __setitem__ __len__ __iter__ __reversed__ __hash__ __repr__ __format__ __reduce_ex__ __deepcopy__
__setstate__ __array__ __array_wrap__ __contains__ __index__ __int__ __float__ __complex__ __long__ __dir__
__get__ __set__ __delete__ __torch_function__ __torch_dispatch__ as_subclass share_memory_ pin_memory cpu cuda npu
detach detach_ is_tensor is_storage is_grad_enabled get_default_dtype is_nonzero numpy dim_order
is_inference is_autocast_enabled set_grad_enabled has_names refine_names rename align_to
""".split())

_LOW_NAMES = frozenset("""
view view_as reshape reshape_as transpose transpose_ permute flatten unflatten unsqueeze unsqueeze_ squeeze
squeeze_ cat concat concatenate stack split split_with_sizes chunk unbind narrow select expand expand_as t
contiguous to float half bfloat16 double int long bool short byte char type_as clone zeros ones full empty
zeros_like ones_like full_like empty_like arange range linspace new_zeros new_ones new_full new_empty
new_tensor tensor as_tensor movedim moveaxis swapaxes swapdims __bool__ repeat_interleave tile
""".split())

# dunder name by BINARY_OP argument (CPython 3.11+ ``NB_*`` order)
_BINARY_OPS = ["add", "and", "floordiv", "lshift", "matmul", "mul", "mod", "or", "pow", "rshift", "sub",
               "truediv", "xor"]
_COMPARE = {"<": "lt", "<=": "le", "==": "eq", "!=": "ne", ">": "gt", ">=": "ge"}
_OPERATOR_CANDIDATES = frozenset("""add sub mul div true_divide floor_divide matmul pow remainder fmod
bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift __lshift__ __rshift__ __and__ __or__
__xor__ neg negative bitwise_not logical_not abs lt le eq ne gt ge __eq__ __ne__ __lt__ __le__ __gt__ __ge__
add_ sub_ mul_ div_ pow_ matmul_ remainder_ floor_divide_ __iand__ __ior__ __ixor__ __ilshift__ __irshift__
""".split())

_TORCH_DIR = os.path.dirname(os.path.dirname(__import__("torch").__file__)) + os.sep + "torch" + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INTERNAL_FILES = (os.path.join(_TORCH_DIR, "overrides.py"), os.path.join(_TORCH_DIR, "_tensor.py"))
_PLUMBING_FILES = (os.path.join(_TORCH_DIR, "utils", "hooks.py"), os.path.join(_TORCH_DIR, "autograd", "function.py"))


def called_from_hook_plumbing() -> bool:
    """True when torch's hook/autograd.Function machinery made the call (``view_as`` aliases), not user code."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        f = f.f_back
    return f is not None and f.f_code.co_filename in _PLUMBING_FILES

_TABLE: dict[Any, tuple[str, str, int]] | None = None


# torch's private functions that compute what a model's public calls leave to them: MoE experts' grouped GEMMs
# (transformers' ``grouped_mm`` experts call ``torch._grouped_mm``) and the fp8 GEMMs. Captured and named
# ``Torch.<name>`` like any torch function; every other private name is plumbing.
COMPUTE_PRIVATE = frozenset(PRIVATE_COMPUTE)  # one list, the replay allowlist's: what is captured is replayable


def _classify(name: str) -> int:
    if name in COMPUTE_PRIVATE:
        return RECORD
    if name in _SKIP_NAMES or (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))):
        return SKIP
    return LOW if name in _LOW_NAMES else RECORD


def table() -> dict[Any, tuple[str, str, int]]:
    """``{function object: (prefix, api name, kind)}``, built once. Functional wins over Tensor over Torch."""
    global _TABLE
    if _TABLE is None:
        import torch
        import torch.nn.functional as F

        tab: dict[Any, tuple[str, str, int]] = {}
        for prefix, owner in (("Functional", F), ("Tensor", torch.Tensor), ("Torch", torch)):
            for name in dir(owner):
                try:
                    obj = getattr(owner, name)
                except Exception:  # pragma: no cover - exotic attributes
                    continue
                if isinstance(obj, type) or not callable(obj):
                    continue
                try:
                    if obj in tab:
                        continue
                    tab[obj] = (prefix, name, _classify(name))
                except TypeError:  # unhashable callables
                    continue
        _TABLE = tab
    return _TABLE


def operator_name(api: str, args: tuple = ()) -> str | None:
    """Return the dunder name when the user's code reached ``api`` through an operator (``a + b``), else None.

    Looks at the first caller frame outside torch's own dispatch files and decodes its current instruction.
    ``1 + y`` reaches torch as ``TensorBase.add(y, 1)``, exactly like ``y + 1``; it is named ``__radd__`` (as
    msprobe, which wraps ``Tensor.__radd__``) when the operator's right operand, read from the instruction that
    loaded it (a local, global, cell or constant), is the tensor torch got first. A right operand computed by an
    expression cannot be read back and is named as the forward operator.
    """
    if api not in _OPERATOR_CANDIDATES:
        return None
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename in _INTERNAL_FILES or f.f_code.co_filename.startswith(_PKG_DIR)):
        f = f.f_back
    if f is None:
        return None
    try:
        op = f.f_code.co_code[f.f_lasti]
        arg = f.f_code.co_code[f.f_lasti + 1]
    except IndexError:  # pragma: no cover
        return None
    opname = dis.opname[op]
    if opname == "BINARY_OP":
        inplace = arg >= 13
        base = _BINARY_OPS[arg - 13 if inplace else arg]
        if inplace:
            return f"__i{base}__"
        if base in _REFLECTABLE and len(args) > 1 and not _is_tensor(args[1]) and _right_operand_is(f, args[0]):
            return f"__r{base}__"
        return f"__{base}__"
    if opname == "COMPARE_OP":
        idx = arg >> 4 if sys.version_info >= (3, 12) else arg
        if sys.version_info >= (3, 13):
            idx = arg >> 5
        try:
            return f"__{_COMPARE[dis.cmp_op[idx]]}__"
        except (IndexError, KeyError):  # pragma: no cover
            return None
    if opname == "UNARY_NEGATIVE":
        return "__neg__"
    if opname == "UNARY_INVERT":
        return "__invert__"
    return None


# operators torch answers with the plain method for both operand orders (sub/div/pow/... have __r*__ functions)
_REFLECTABLE = frozenset(("add", "mul", "and", "or", "xor"))
_MISSING = object()
_INSTRUCTIONS: dict[Any, tuple[list, dict]] = {}


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _right_operand_is(frame: Any, first: Any) -> bool:
    """Whether the value the instruction before ``frame``'s current BINARY_OP loaded is ``first``."""
    code = frame.f_code
    cached = _INSTRUCTIONS.get(code)
    if cached is None:
        instrs = list(dis.get_instructions(code))
        cached = _INSTRUCTIONS[code] = (instrs, {ins.offset: i for i, ins in enumerate(instrs)})
    instrs, index = cached
    i = index.get(frame.f_lasti)
    if not i:
        return False
    prev = instrs[i - 1]
    name, argval = prev.opname, prev.argval
    if name == "LOAD_CONST":
        return argval is first
    if name == "LOAD_FAST_LOAD_FAST" and isinstance(argval, tuple):  # CPython 3.13+: both operands at once
        name, argval = "LOAD_FAST", argval[-1]
    if name in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_NAME"):
        value = frame.f_locals.get(argval, _MISSING)
        if value is _MISSING and name == "LOAD_NAME":
            value = frame.f_globals.get(argval, _MISSING)
        return value is first
    if name == "LOAD_GLOBAL":
        return frame.f_globals.get(argval, _MISSING) is first
    return False


def lookup(func: Any) -> tuple[str, str, int] | None:
    """``(prefix, api name, kind)`` of a function object, by the name it was reached under, ``None`` when it is
    not a torch API. torch binds some C functions under several names as distinct objects that compare equal
    (``torch.mm``, ``torch.dsmm``, ``torch.spmm``), which one dict key cannot tell apart: such an object is named
    by its own ``__name__`` (``Torch.mm``); one object under several names (``Tensor.abs`` is ``Tensor.__abs__``)
    keeps the table's name.

    Raises:
        TypeError: an unhashable callable.
    """
    info = table().get(func)
    if info is None:
        return None
    prefix, name, _ = info
    own = getattr(func, "__name__", None)
    if own and own != name:
        import torch
        import torch.nn.functional as F

        owner = {"Functional": F, "Tensor": torch.Tensor, "Torch": torch}[prefix]
        if getattr(owner, name, None) is not func and getattr(owner, own, None) is func:
            return prefix, own, _classify(own)
    return info


def counted(func: Any, args: tuple = ()) -> tuple[str, str, str | None] | None:
    """``(prefix, api, the name capture counts the call under)`` of a torch function called with ``args``, the
    name ``None`` for a call capture does not count (:data:`SKIP`), ``None`` for no torch API. An operator is
    counted under its dunder name (``Tensor.__add__``, :func:`operator_name`), as API capture counts it.

    Raises:
        TypeError: an unhashable callable.
    """
    info = lookup(func)
    if info is None:
        return None
    prefix, api, kind = info
    if kind == SKIP:
        return prefix, api, None
    op = operator_name(api, args) if prefix != "Functional" else None
    return prefix, api, f"Tensor.{op}" if op is not None else f"{prefix}.{api}"
