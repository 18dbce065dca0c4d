"""``load_draft_checkpoint``: materialise a validated draft on the last stage, sharing the target embedding.

Must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipespec.contract.embed import maybe_share_target_embed
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import AuxConvention
from pipespec.engine.draft_checkpoint.files import read_tensors, weight_files
from pipespec.engine.draft_checkpoint.formats import canonical_name, disk_name
from pipespec.engine.draft_checkpoint.info import LoadedDraft, TargetInfo
from pipespec.engine.draft_checkpoint.read import inspect_draft_checkpoint
from pipespec.engine.draft_checkpoint.vocab import vocab_maps
from pipespec.errors import CheckpointError


def load_draft_checkpoint(
    path: str | Path,
    target: TargetInfo,
    *,
    aux_convention: AuxConvention | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_embed: nn.Module | None = None,
) -> LoadedDraft:
    """Materialise a draft (last stage only): validate, read its tensors, share the target embedding.

    A draft without ``embed_tokens`` takes ``target_embed`` (shared, not copied); with neither, a
    ``CheckpointError``.
    """
    info = inspect_draft_checkpoint(path, target, aux_convention)
    tensors_raw, nbytes = read_tensors(weight_files(info.path))
    tensors = {canonical_name(k, info.format): v for k, v in tensors_raw.items()}
    config = info.config
    d2t, t2d = vocab_maps(tensors, config.draft_vocab_size, target.vocab_size, info.path)

    with torch.device("meta"):
        model = Eagle3Draft(config, with_embedding=info.has_embedding)
    state: dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        if key == "d2t":
            state[key] = d2t.to(device)
        elif key == "t2d":
            state[key] = t2d.bool().to(device)
        else:
            value = tensors[key]
            if not value.dtype.is_floating_point:
                # A cast would turn integer (e.g. quantised) weights into garbage without a word.
                raise CheckpointError(
                    f"{info.path}: tensor {disk_name(key, info.format)} has dtype {value.dtype}, expected floating point: "
                    "only floating-point weights can be cast on load"
                )
            state[key] = value.to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True)
    model.reset_rotary()
    model.to(device)
    model.eval()
    embedding = maybe_share_target_embed(model, target_embed)
    return LoadedDraft(model=model, info=info, embedding=embedding, bytes_read=nbytes, warnings=list(info.warnings))
