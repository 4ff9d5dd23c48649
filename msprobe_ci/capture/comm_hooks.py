"""Communication ops: the records of torch.distributed collectives while a capture runs (wrappers in :mod:`.comm`)."""

from __future__ import annotations

from .observers import CommCall


class CommHooks:
    """Communication ops: one :class:`~.observers.CommCall` per torch.distributed collective for the engine's
    observers (``Distributed.<op>.<N>.forward``; :mod:`.comm` installs the wrappers and calls :meth:`on_comm`).

    Args:
        engine: the :class:`~msprobe_ci.capture.session.CaptureSession`.
    """

    def __init__(self, engine):
        self.engine = engine

    def on_comm(self, op: str, func, args: tuple, kwargs: dict, functional: bool = False):
        """Run and record one communication op; a ``functional`` (out-of-place) collective's output is its
        returned tensor. Its output event comes when its work completes (``wait``) where it is asynchronous."""
        eng = self.engine
        if not eng.recording:
            return func(*args, **kwargs)
        state = eng.state
        key = f"Distributed.{op}."
        n = state.api_counts.get(key, 0)
        state.api_counts[key] = n + 1
        name = f"{key}{n}.forward"
        if eng.with_construct:
            state.construct[name] = state.fwd_stack[-1] if state.fwd_stack else None
        record = eng.keep(name)
        api_id = f"Distributed.{op}"
        faults = eng.faults_due(api_id, n)[0] if api_id in eng.fault_apis else []
        call = CommCall(op, n, func, args, kwargs, functional, record, list(faults))
        on = eng.on
        for before in on.comm_before:
            before(call)
        with eng.machinery:  # a collective built from other collectives is one record, as msprobe's
            call.result = result = func(*args, **kwargs)

        def done() -> None:
            for after in on.comm_after:
                after(call)

        from .comm import wrap_work

        if isinstance(result, list) and result and all(hasattr(w, "wait") for w in result):
            pending = {"left": len(result)}

            def one_done() -> None:
                pending["left"] -= 1
                if pending["left"] == 0:
                    done()
            return [wrap_work(w, one_done) for w in result]
        if not functional and result is not None and hasattr(result, "wait"):
            return wrap_work(result, done)
        done()
        return result
