"""The training corpus and the prompts drawn from it.

The corpus is ``Lib/**/*.py`` of the running interpreter's stdlib (site-packages excluded), split into
train and held-out files by a hash of the relative path, so the split does not depend on file order.
Prompts: evaluation prompts from held-out files, and ``--retrain-draft``'s distinct generation prompts.

Imports torch (seeded draws) and nothing of pipespec or transformers (tokenizers are passed in).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def load_corpus(max_chars: int, holdout_every: int = 40) -> tuple[list[str], list[str], dict[str, Any]]:
    """Stdlib ``.py`` sources: (train texts, held-out texts, a description). Deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)
    train: list[str] = []
    held: list[str] = []
    total = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % holdout_every
        if bucket == 0:
            held.append(text)
        elif total < max_chars:
            train.append(text)
            total += len(text)
    info = {"root": str(root), "files": len(files), "train_files": len(train), "heldout_files": len(held),
            "train_chars": total}
    return train, held, info


def eval_prompts(tokenizer: Any, texts: Sequence[str], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from held-out files, each starting at a random line start;
    files are visited round-robin (in a seeded order) so a small held-out split still yields ``count``."""
    gen = torch.Generator().manual_seed(seed + 7)
    usable = [t.splitlines(keepends=True) for t in texts]
    usable = [lines for lines in usable if len(lines) >= 40]
    order = torch.randperm(len(usable), generator=gen).tolist()
    prompts: list[list[int]] = []
    for attempt in range(20 * count if usable else 0):
        lines = usable[order[attempt % len(usable)]]
        start = int(torch.randint(0, len(lines) - 30, (1,), generator=gen))
        ids = tokenizer("".join(lines[start : start + 200]), add_special_tokens=False)["input_ids"][:length]
        if len(ids) == length and ids not in prompts:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def generation_prompts(tokenizer: Any, texts: Sequence[str], count: int, length: int, seed: int) -> torch.Tensor:
    """``[count, length]`` distinct prompts from training files, each starting at a seeded random line start
    (every third attempt at a file's first line, like the demo's prompts); files visited in a seeded order.

    Distinct because greedy generation is deterministic: a repeated prompt is a repeated training sequence
    (drawing a file's first line again and again made ~30 % of 16384 prompts copies of a few hundred, which
    the draft memorized: in-sample agreement that held-out prompts never see)."""
    gen = torch.Generator().manual_seed(seed + 11)
    files = [t.splitlines(keepends=True) for t in texts]
    files = [lines for lines in files if len(lines) >= 20]
    rows: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    attempt = 0
    while len(rows) < count and attempt < 20 * count:
        texts_now = []
        for _ in range(min(4096, 20 * count - attempt)):  # tokenized a batch at a time (the fast tokenizer's batch path)
            lines = files[int(torch.randint(0, len(files), (1,), generator=gen))]
            start = 0 if attempt % 3 == 0 else int(torch.randint(0, len(lines) - 10, (1,), generator=gen))
            attempt += 1
            texts_now.append(_whole_lines(lines, start, 8 * length))
        for ids in tokenizer(texts_now, add_special_tokens=False)["input_ids"]:
            ids = ids[:length]
            if len(rows) < count and len(ids) == length and tuple(ids) not in seen:
                seen.add(tuple(ids))
                rows.append(ids)
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} of {count} distinct generation prompts of {length} tokens found in the "
                           "corpus: ask for fewer (--gen-sequences) or shorter (--gen-prompt-len) ones")
    return torch.tensor(rows, dtype=torch.long)


def _whole_lines(lines: Sequence[str], start: int, chars: int) -> str:
    """Whole lines from ``start`` until at least ``chars`` characters (~2-3x the characters a prompt needs)."""
    end, total = start, 0
    while end < len(lines) and total < chars:
        total += len(lines[end])
        end += 1
    return "".join(lines[start:end])
