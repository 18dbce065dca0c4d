"""Does cuDNN attention cost a plan build per decode step on this GPU? (CUDA only.)

``python bench/cuda_attention_probe.py --out DIR`` measures, side by side:

1. ``scaled_dot_product_attention`` over a key length that grows by one per call (what decoding does)
   with a boolean mask, bf16, with cuDNN SDP enabled and disabled: which backend torch picks and the
   median time per call;
2. ``pipespec generate`` with the shipped demo pair at PP=2, c = 1 and 8, k = 0 and 3, in fresh
   processes with ``PIPESPEC_CUDNN_SDP=1`` (cuDNN allowed) and without (the engine's default: off):
   tokens/s and whether the tokens are identical.

Writes ``DIR/cuda_attention_probe.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def sdpa_growing(cudnn: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    names = {int(v): k for k, v in SDPBackend.__members__.items()}
    q = torch.randn(1, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
    times, backend = [], "?"
    for length in range(500, 532):
        k = torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(1, 1, 4, length, dtype=torch.bool, device="cuda")
        backend = names.get(int(torch._fused_sdp_choice(q, k, k, attn_mask=mask)), "?")
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    torch.backends.cuda.enable_cudnn_sdp(True)
    return {"cudnn_sdp": cudnn, "backend": backend, "median_ms": round(statistics.median(times[4:]) * 1e3, 3)}


def generate(target: Path, draft: Path, prompts: Path, k: int, cudnn: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PIPESPEC_CUDNN_SDP", None)
    if cudnn:
        env["PIPESPEC_CUDNN_SDP"] = "1"
    cmd = [sys.executable, "-m", "pipespec.cli", "generate", "--target", str(target), "--draft", str(draft), "--pp", "2",
           "--prompts-file", str(prompts), "--max-new-tokens", "64", "--num-spec-tokens", str(k), "--ignore-eos",
           "--device", "cuda", "--json", "--spec-policy", "always"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cuda_attention_probe: error: needs a CUDA device", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from pipespec.demo import demo_draft_dir, demo_target_dir

    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                              "sdpa": [sdpa_growing(True), sdpa_growing(False)], "generate": []}
    for row in result["sdpa"]:
        print(f"sdpa growing L, bf16, masked: cudnn_sdp={row['cudnn_sdp']}: backend {row['backend']}, {row['median_ms']} ms/call")
    target, draft = demo_target_dir(), demo_draft_dir()
    tok = AutoTokenizer.from_pretrained(target)
    text = Path(json.__file__).read_text()[:4000]  # stdlib source: the demo's domain
    ids = tok(text)["input_ids"]
    with tempfile.TemporaryDirectory() as tmp:
        for c in (1, 8):
            prompts = Path(tmp) / f"p{c}.jsonl"
            prompts.write_text("".join(json.dumps({"prompt_ids": ids[i * 40: i * 40 + 32]}) + "\n" for i in range(c)))
            outputs: dict[int, Any] = {}
            for k in (0, 3):
                for cudnn in (True, False):
                    res = generate(target, draft, prompts, k, cudnn)
                    row = {"c": c, "k": k, "cudnn_sdp": cudnn, "tokens_per_s": res.get("tokens_per_s"),
                           "mean_acceptance_length": res.get("mean_acceptance_length"), "error": res.get("error")}
                    out = [o["output_ids"] for o in res.get("outputs", [])] or None
                    row["same_tokens_as_first"] = outputs.setdefault(0, out) == out if out else None
                    result["generate"].append(row)
                    print(f"generate c={c} k={k} cudnn_sdp={cudnn}: {row['tokens_per_s']} tokens/s "
                          f"(acceptance {row['mean_acceptance_length']}, same tokens {row['same_tokens_as_first']}) {row['error'] or ''}")
    (args.out / "cuda_attention_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
