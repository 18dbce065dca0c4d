"""The single-process reference for EAGLE3 speculative decoding: an HF model's aux states, and greedy
speculative decoding with the target recomputed from scratch every step (slow, obviously right).

The oracle the engine's tests, the demo's training and the benchmarks compare against. Imports torch and
the draft; must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec.engine.draft.model import Eagle3Draft

__all__ = ["reference_speculative_generate", "target_aux_states"]


def target_aux_states(model: torch.nn.Module, input_ids: torch.Tensor, aux_layers: Sequence[int]) -> tuple[
    torch.Tensor, list[torch.Tensor]
]:
    """Logits and the aux states (input-index ids) of an HF causal LM over ``input_ids [B, T]``.

    Ids below N come from ``output_hidden_states`` (entry L = what enters layer L); id N is the input
    of the final norm, caught with a pre-hook, because HF's last hidden-states entry is post-norm.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    num_layers = int(model.config.num_hidden_layers)
    captured: list[torch.Tensor] = []
    hook = base.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0])) if num_layers in aux_layers else None
    try:
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        if hook is not None:
            hook.remove()
    states = [captured[0] if i == num_layers else out.hidden_states[i] for i in aux_layers]
    return out.logits, states


@torch.no_grad()
def reference_speculative_generate(
    target: torch.nn.Module,
    draft: Eagle3Draft,
    aux_layers: Sequence[int],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_spec_tokens: int,
) -> tuple[list[int], list[int]]:
    """Greedy EAGLE3 speculative decoding in one process, batch 1: the oracle for engines and the demo.

    The target recomputes the whole sequence each step (no KV cache: slow but obviously right); the
    draft uses its own cache via ``propose``. Returns the new tokens (exactly ``max_new_tokens``) and the
    tokens gained per verify step (accepted drafts + 1 bonus; the prefill's first token is not a step).
    """
    device = draft.fc.weight.device
    ids = list(prompt_ids)
    logits, aux = target_aux_states(target, torch.tensor([ids], device=device), aux_layers)
    out = [int(logits[0, -1].argmax())]
    steps: list[int] = []
    if num_spec_tokens == 0:
        while len(out) < max_new_tokens:
            logits, _ = target_aux_states(target, torch.tensor([ids + out], device=device), ())
            out.append(int(logits[0, -1].argmax()))
            steps.append(1)
        return out[:max_new_tokens], steps
    cache = draft.new_cache(1, capacity=len(ids) + max_new_tokens + num_spec_tokens + 2)
    next_ids = torch.tensor([ids[1:] + out], device=device)
    drafts = draft.propose(aux, next_ids, cache, num_spec_tokens)[0].tolist()
    while len(out) < max_new_tokens:
        context = ids + out  # the last token is sampled but not yet run through the target
        start = len(context) - 1
        logits, aux = target_aux_states(target, torch.tensor([context + drafts], device=device), aux_layers)
        greedy = logits[0, start:].argmax(dim=-1).tolist()  # greedy[i] follows drafts[:i]
        accepted = 0
        while accepted < num_spec_tokens and drafts[accepted] == greedy[accepted]:
            accepted += 1
        new = drafts[:accepted] + [greedy[accepted]]
        out.extend(new)
        steps.append(len(new))
        if len(out) >= max_new_tokens:
            break
        step_aux = [a[:, start : start + accepted + 1] for a in aux]
        drafts = draft.propose(step_aux, torch.tensor([new], device=device), cache, num_spec_tokens)[0].tolist()
    return out[:max_new_tokens], steps
