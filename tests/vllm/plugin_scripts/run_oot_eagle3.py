"""vLLM's own Llama and the out-of-tree package ``oot_pkg`` on the same weights, each with the EAGLE3 draft
at PP=1 through ``vllm.LLM`` (pipespec's plugin adapts ``oot_pkg``'s class at engine load): greedy outputs
and vLLM's acceptance counts per draft position, for the test to compare.

Usage: run_oot_eagle3.py --target DIR --draft DIR --prompts FILE --max-tokens M --k K --work DIR --out FILE.json
(prompts: a JSON list of token-id lists; the directory holding ``oot_pkg`` on PYTHONPATH). Run as a
subprocess: vLLM spawns workers, hence the main guard.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path
from typing import Any

from run_family import _generate, _metrics

ARCHITECTURE = "OotPkgForCausalLM"
OVERRIDE = {ARCHITECTURE: f"oot_pkg.model:{ARCHITECTURE}"}


def write_checkpoint(target: Path, out: Path) -> Path:
    """The target's files, with ``architectures = ["OotPkgForCausalLM"]`` (Llama's tensor names stay)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in target.iterdir():
        if path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _run(model: Path, draft: str, prompts: list[list[int]], max_tokens: int, k: int,
         overrides: dict[str, str]) -> dict[str, Any]:
    from vllm import LLM

    start = time.time()
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, max_num_seqs=len(prompts), seed=0,
              enforce_eager=True, disable_log_stats=False, model_class_overrides=dict(overrides),
              speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k})
    result = {"outputs": _generate(llm, prompts, max_tokens), **_metrics(llm),
              "overrides": dict(llm.llm_engine.vllm_config.model_config.model_class_overrides),
              "s": round(time.time() - start, 1)}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--target", "--draft", "--prompts", "--work", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--k", type=int, required=True)
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    oot = write_checkpoint(Path(args.target), Path(args.work) / "oot_pkg_checkpoint")
    result = {"llama": _run(Path(args.target), args.draft, prompts, args.max_tokens, args.k, {}),
              "oot_pkg": _run(oot, args.draft, prompts, args.max_tokens, args.k, OVERRIDE)}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
