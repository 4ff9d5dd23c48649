"""What cannot be judged element-wise, in one table, and the first reason a call falls under it.

Isolation, the offline replay (api-check, fuzz) and the free benchmark all ask :func:`unjudgeable` before they run
a reference, as torch.testing tries its ``Pair`` classes in order and keeps the first that applies: an API prefix
with no CPU reference (communication, torch_npu and MindSpeed fused ops, ATen and ``torch._VF`` calls), an output
of uninitialised memory, a random output. Dropout is the one random API judged all the same, by its own standard
(its zero share), where the caller can: a caller that cannot asks with ``dropout=True``.
"""

from __future__ import annotations

import math

#: API prefixes with no CPU reference, and what each is
UNSUPPORTED_PREFIX = {"Distributed": "communication op", "MindSpeed": "MindSpeed fused op",
                      "NPU": "torch_npu op with no CPU kernel", "Aten": "aten op", "VF": "torch._VF op"}
#: APIs whose output is drawn at random: never comparable element-wise
RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                    "bernoulli_", "normal", "normal_", "multinomial", "uniform_", "exponential_", "random_",
                    "poisson", "rrelu", "rrelu_", "gumbel_softmax", "alpha_dropout", "feature_alpha_dropout"})
#: APIs whose output is uninitialised memory (``empty_with_format``: torch_npu's)
NOT_COMPARABLE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_with_format"})
#: dropout: random, but judged by the dropout standard (its zero share) where the caller knows ``p``
DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d"})
#: channel dropouts: the trailing dimensions one draw zeroes together (a channel's length, area, volume)
_CHANNEL_DIMS = {"dropout1d": 1, "dropout2d": 2, "dropout3d": 3}


def dropout_block(short: str, shape) -> int:
    """Elements per random draw of dropout API ``short`` on an output of ``shape``: 1 for ``dropout``, the product
    of the trailing 1/2/3 dimensions for ``dropout1d``/``2d``/``3d`` (PyTorch zeroes whole channels)."""
    k = _CHANNEL_DIMS.get(short, 0)
    dims = list(shape)[-k:] if k and len(shape) > k else []
    return int(math.prod(dims)) if dims else 1


def unjudgeable(prefix: str, api: str, kwargs: dict | None = None, *, short: str | None = None,
                dropout: bool = False) -> str | None:
    """The first reason an API call cannot be judged element-wise, or None when it can.

    Args:
        prefix: the dump prefix (``Functional``, ``Distributed``, ``NPU``).
        api: the API name after the prefix (``linear``, ``dense.Dense``).
        kwargs: the call's keyword arguments, when known (``dropout_p`` > 0 makes a call random).
        short: the name the standards know the API by (default: the last part of ``api``; the offline replay
            passes a MindSpore API's PyTorch twin).
        dropout: count dropout as random (a caller with no dropout standard: the free benchmark).

    Returns:
        ``"<what>: <why>"`` (one line), or None.
    """
    short = short or api.rsplit(".", 1)[-1]
    if prefix in UNSUPPORTED_PREFIX:
        return f"{prefix}.{api}: {UNSUPPORTED_PREFIX[prefix]}, no CPU reference"
    if short in NOT_COMPARABLE:
        return f"{api}: uninitialised memory, not comparable"
    if short in RANDOM or (dropout and short in DROPOUT) or ((kwargs or {}).get("dropout_p") or 0) > 0:
        return f"{api}: random output, not comparable element-wise"
    return None
