"""Target-embedding rules for drafts on the last pipeline stage.

EAGLE-family drafts embed the tokens they are fed with the *target's* input embedding. Under PP the
embedding lives on stage 0; the last stage must load it too, and a draft that ships no
``embed_tokens`` uses the target's tensor (shared, not copied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pipespec.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

# torch is imported inside the functions that touch modules: the method set is read by the verifier and
# the CLI's pure commands (`pipespec verify`), which must not pay torch's import.

METHODS_NEEDING_TARGET_EMBED = frozenset({"eagle", "eagle3", "dflash", "dspark"})


def spec_decode_needs_target_embed(method: str | None, pp_size: int, is_last_stage: bool) -> bool:
    """True when this stage must hold the target's input embedding for the draft.

    >>> spec_decode_needs_target_embed("eagle3", pp_size=2, is_last_stage=True)
    True
    >>> spec_decode_needs_target_embed("eagle3", pp_size=1, is_last_stage=True)  # stage 0 has it anyway
    False
    """
    return method in METHODS_NEEDING_TARGET_EMBED and pp_size > 1 and is_last_stage


def _has_weights(embed: nn.Module | None) -> bool:
    import torch

    if embed is None:
        return False
    weight = getattr(embed, "weight", None)
    return isinstance(weight, torch.Tensor) and not weight.is_meta


def maybe_share_target_embed(
    draft: nn.Module, target_embed: nn.Module | None, attr: str = "embed_tokens"
) -> Literal["own", "shared"]:
    """Give ``draft`` the target's embedding unless it ships its own.

    Returns ``"own"`` when the draft keeps its embedding, ``"shared"`` when it now uses the target's
    module (the same tensor object, no copy). Raises ``CheckpointError`` when neither has weights.
    """
    if _has_weights(getattr(draft, attr, None)):
        return "own"
    if not _has_weights(target_embed):
        raise CheckpointError(
            f"the draft {type(draft).__name__} has no {attr} weights and the target's input embedding is not loaded "
            "on this stage: load the target embedding on the last stage (spec_decode_needs_target_embed) or use a "
            "draft checkpoint that ships embed_tokens"
        )
    setattr(draft, attr, target_embed)
    return "shared"
