"""Per-API replay: rebuild each dumped API call's arguments, run it alone on CPU (fp64 oracle and same-dtype
bench), and judge the target's outputs by the API's own standard (:mod:`msprobe_ci.checkers`)."""

from .apis import parse_name, resolve
from .result import ApiResult
from .runner import ApiReplayer

__all__ = ["ApiReplayer", "ApiResult", "parse_name", "resolve"]
