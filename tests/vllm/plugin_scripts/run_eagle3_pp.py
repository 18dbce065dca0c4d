"""EAGLE3 through ``vllm.LLM`` at PP=1 and at PP=2, with pipespec's plugin installed: what the PP test compares.

Only run where the build's runner relays aux hidden states between PP ranks (vLLM's V2 runner; the test
asks ``compat`` first). Prints nothing; writes ``{"pp1": {...}, "pp2": {...}}`` with greedy outputs, vLLM's
acceptance counts per draft position and the overrides the plugin set.

Usage: run_eagle3_pp.py --model DIR --draft DIR --prompts FILE --max-tokens M --k K --out FILE.json
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from run_family import _generate, _metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--draft", "--prompts", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--k", type=int, required=True)
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())

    from vllm import LLM

    result: dict[str, Any] = {}
    for pp in (1, 2):
        llm = LLM(model=args.model, dtype="float32", max_model_len=256, max_num_seqs=len(prompts), seed=0,
                  pipeline_parallel_size=pp, distributed_executor_backend="mp", enforce_eager=pp == 1,
                  disable_log_stats=False,
                  speculative_config={"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k})
        result[f"pp{pp}"] = {"outputs": _generate(llm, prompts, args.max_tokens), **_metrics(llm),
                             "overrides": dict(llm.llm_engine.vllm_config.model_config.model_class_overrides)}
        del llm
        gc.collect()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
