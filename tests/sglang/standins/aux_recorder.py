"""A test-only SGLang plugin: saves the aux hidden states the last pipeline rank hands to the logits processor.

Why: SGLang 0.5.23 cannot return hidden states from a pipeline (with pp_size > 1 the first rank, which answers
the request, finishes a ``return_hidden_states`` request on a result without them and fails), so the oracle
reads them where the draft would: the ``aux_hidden_states`` argument of ``LogitsProcessor.forward`` on the last
rank. It observes and never changes anything. Active only when ``PIPESPEC_TEST_AUX_DIR`` names a directory;
registered through SGLang's own plugin entry points (the ``.dist-info`` beside this file, found on PYTHONPATH).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

_count = itertools.count()


def register() -> None:
    if not os.environ.get("PIPESPEC_TEST_AUX_DIR"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.logits_processor.LogitsProcessor.forward", _record, HookType.AROUND)


def _record(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    import torch
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    aux = kwargs.get("aux_hidden_states", args[5] if len(args) > 5 else None)
    if aux is not None and len(aux):
        packed = pack_aux_hidden_states(aux if isinstance(aux, torch.Tensor) else list(aux))
        path = os.path.join(os.environ["PIPESPEC_TEST_AUX_DIR"], f"{os.getpid()}_{next(_count):05d}.pt")
        torch.save(packed.detach().to("cpu", torch.float32).clone(), path)
    return original(*args, **kwargs)
