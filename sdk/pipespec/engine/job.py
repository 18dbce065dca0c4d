"""What one ``pipespec generate`` run asks of every stage: plain, picklable data.

The launcher builds one ``GenerateJob`` and hands the same object to every stage process (under
``torchrun`` each rank builds it from the same flags), so every stage knows every prompt's length and
token budget without any message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipespec.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class Request:
    """One prompt: its token ids, how many new tokens it may get, and optionally when to cancel it.

    ``cancel_after = n`` cancels the request once its n-th target forward is in flight (the prefill is
    the first); see ``pipespec.engine.microbatch``.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    prompt: str | None = None
    cancel_after: int | None = None


@dataclass(frozen=True)
class GenerateJob:
    target: str
    draft: str | None
    pp: int
    partition: tuple[int, ...] | None
    requests: tuple[Request, ...]
    num_spec_tokens: int
    aux_convention: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    timeout_s: float = 300.0
    load_timeout_s: float = 1800.0
    verbose: bool = False
    method: str = "eagle3"
    ignore_eos: bool = False
    trace: bool = False
    # Micro-batches in flight (None: P, or fewer when fewer sequences run) and the cap on sequences
    # running at once (None: every request at once); see pipespec.engine.microbatch.
    micro_batches: int | None = None
    max_num_seqs: int | None = None
    # How aux states travel between stages: "relay" (one packed message at the end of a stage's forward)
    # or "overlap" (each state sent when captured) for forwards of at least overlap_min_tokens tokens;
    # see pipespec.pp.overlap and docs/benchmarks.md (P1) for the trade-off.
    aux_transport: str = "relay"
    overlap_min_tokens: int = 64
    # Speculate every round ("always") or measure and fall back to plain decoding while it is faster
    # ("adaptive"); see pipespec.engine.spec_policy.
    spec_policy: str = "adaptive"
    # Replay verify forwards from CUDA graphs over fixed KV buffers: "auto" (on CUDA, batchable models),
    # "on" (also on CPU, emulated: the same fixed-buffer path without graphs) or "off";
    # see pipespec.engine.cuda_graphs.
    cuda_graphs: str = "auto"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _tokenizer(target_dir: str) -> Any:
    from transformers import AutoTokenizer

    if not any((Path(target_dir) / name).exists() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"--prompt TEXT needs a tokenizer in {target_dir} ({', '.join(TOKENIZER_FILES)}), and there is none: "
            "pass token ids with --prompt-ids instead"
        )
    try:
        return AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError variants
        first = " ".join(str(exc).split())
        raise CheckpointError(
            f"--prompt TEXT needs a tokenizer in {target_dir}, and AutoTokenizer cannot load it ({first}): "
            "pass token ids with --prompt-ids instead"
        ) from None


def load_tokenizer(target_dir: str) -> Any | None:
    """The target's tokenizer, or ``None`` when the directory ships none (ids-only runs)."""
    if not any((Path(target_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    return _tokenizer(target_dir)


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise UsageError(f"{where}: prompt_ids must be a non-empty list of non-negative integers, got {value!r}")
    return tuple(value)


def build_requests(
    target_dir: str, *, prompt: str | None = None, prompt_ids: Sequence[int] | None = None,
    prompts_file: str | None = None, max_new_tokens: int = 32,
) -> tuple[Request, ...]:
    """Turn ``--prompt`` / ``--prompt-ids`` / ``--prompts-file`` into requests (tokenizing text prompts)."""
    given = [x is not None for x in (prompt, prompt_ids, prompts_file)]
    if sum(given) != 1:
        raise UsageError("give exactly one of --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file FILE")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    tokenizer: Any = None

    def encode(text: str, where: str) -> tuple[int, ...]:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = _tokenizer(target_dir)
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise UsageError(f"{where}: the prompt {text!r} tokenizes to no tokens")
        return tuple(int(i) for i in ids)

    if prompt is not None:
        return (Request(encode(prompt, "--prompt"), max_new_tokens, prompt),)
    if prompt_ids is not None:
        return (Request(_ids(list(prompt_ids), "--prompt-ids"), max_new_tokens),)
    assert prompts_file is not None
    path = Path(prompts_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"--prompts-file {path}: cannot read it ({exc.strerror or exc})") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{where}: not a JSON object ({exc})") from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_ids" in entry):
            raise UsageError(f'{where}: each line must be a JSON object with exactly one of "prompt" or "prompt_ids"')
        budget = entry.get("max_new_tokens", max_new_tokens)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise UsageError(f"{where}: max_new_tokens must be an integer >= 1, got {budget!r}")
        cancel = entry.get("cancel_after")
        if cancel is not None and (isinstance(cancel, bool) or not isinstance(cancel, int) or cancel < 1):
            raise UsageError(f"{where}: cancel_after must be an integer >= 1 (target forwards, the prefill is the first), got {cancel!r}")
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str):
                raise UsageError(f"{where}: prompt must be a string")
            requests.append(Request(encode(entry["prompt"], where), budget, entry["prompt"], cancel))
        else:
            requests.append(Request(_ids(entry["prompt_ids"], where), budget, cancel_after=cancel))
    if not requests:
        raise UsageError(f"--prompts-file {path} holds no prompts")
    return tuple(requests)
