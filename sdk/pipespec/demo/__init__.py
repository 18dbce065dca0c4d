"""The trained demo pair shipped with pipespec: a small Llama target and its EAGLE3 draft.

Both were trained by one command, ``python bench/train_demo.py --out DIR --device cuda`` (the ``demo``
preset), on the Python standard library's own source (see ``train.log`` and ``metrics.json`` beside this
file for the command, machine, and figures):

* ``target/`` — an HF checkpoint (``LlamaForCausalLM``, 8 layers, H=192, 3.2M parameters, fp16,
  tied embedding) with a byte-level BPE tokenizer (320 tokens) that ``AutoTokenizer`` loads; trained for
  800 steps of 128 sequences of 256 tokens;
* ``draft/`` — an EAGLE3 draft in Format B (speculators), aux ids ``(2, 4, 5)`` in the input-index
  convention, the full 320-token vocabulary (``d2t`` is the identity), no ``embed_tokens`` (it shares
  the target's); trained on 131,072 of the target's own greedy generations (EAGLE3's training-time
  test, 3 steps), 0.48M parameters, MLP 256. Acceptance at k = 3: 3.43 tokens per step replayed on 256
  held-out generations, 3.37 on 24 held-out prompts, 3.92 on the demo's three prompts.

Usage::

    from pipespec.demo import demo_target_dir, demo_draft_dir
    pipespec generate --target $(python -c "import pipespec.demo as d; print(d.demo_target_dir())") ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEMO_DIR = Path(__file__).resolve().parent

__all__ = ["DEMO_DIR", "demo_available", "demo_draft_dir", "demo_metrics", "demo_target_dir"]


def demo_target_dir() -> Path:
    """The shipped target checkpoint directory (config.json, model.safetensors, tokenizer files)."""
    return DEMO_DIR / "target"


def demo_draft_dir() -> Path:
    """The shipped EAGLE3 draft checkpoint directory (Format B)."""
    return DEMO_DIR / "draft"


def demo_available() -> bool:
    """True when both checkpoints are present (a source checkout or an install that kept package data)."""
    return all((d / name).is_file() for d in (demo_target_dir(), demo_draft_dir())
               for name in ("config.json", "model.safetensors"))


def demo_metrics() -> dict[str, Any]:
    """The training/evaluation record (``metrics.json``): acceptance lengths, sizes, command, machine."""
    path = DEMO_DIR / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}
