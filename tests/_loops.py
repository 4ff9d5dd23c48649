"""A user's own training loop, as the loop tests run it."""

import torch


def debugged_loop(model, batches, folder, autocast=False, **debugger):
    """Train ``model`` with AdamW (lr 1e-3), one step per batch of ``batches`` (each a dict of model inputs whose
    output has a ``loss``), the forward under bf16 autocast when ``autocast``; every step dumped by
    ``PrecisionDebugger(dump_path=folder, **debugger)``: ``start(model)`` before the forward, ``stop(); step()``
    after the optimizer, as a user wraps their own loop."""
    from msprobe_ci import PrecisionDebugger

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    dbg = PrecisionDebugger(dump_path=str(folder), **debugger)
    for batch in batches:
        dbg.start(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        dbg.stop()
        dbg.step()
