"""One model family through ``vllm.LLM`` with pipespec's plugin installed: every run the tests compare.

1. PP=1 with the EAGLE3 draft (the plugin adapts the class at engine load): greedy outputs and vLLM's
   acceptance counts per draft position (``llm.get_metrics()``);
2. plain PP=2 through the adapted class (registered with ``model_class_overrides``, the way the plugin
   registers it): greedy outputs.

Usage: run_family.py --model DIR --draft DIR --prompts FILE --max-tokens M --k K --out FILE.json
[--override ARCH=module:Class]
(prompts: a JSON list of token-id lists). Run as a subprocess: vLLM spawns workers, hence the main guard.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any


def _metrics(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Vector

    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(metric, Vector):
            found["accepted_per_pos"] = list(metric.values)
        elif metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                             "vllm:spec_decode_num_accepted_tokens") and isinstance(metric, Counter):
            found[metric.name.split(":", 1)[1]] = metric.value
    return found


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--override", action="append", default=[], metavar="ARCH=module:Class",
                        help="model_class_overrides for the EAGLE3 run (an out-of-tree model)")
    parser.add_argument("--skip-pp2", action="store_true")
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    common = dict(model=args.model, dtype="float32", max_model_len=256, max_num_seqs=len(prompts), seed=0)

    from vllm import LLM

    result: dict[str, Any] = {}
    start = time.time()
    user_overrides = dict(o.split("=", 1) for o in args.override)
    llm = LLM(**common, enforce_eager=True, disable_log_stats=False, model_class_overrides=user_overrides,
              speculative_config={"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k})
    result["eagle3_pp1"] = {"outputs": _generate(llm, prompts, args.max_tokens), **_metrics(llm),
                            "overrides": dict(llm.llm_engine.vllm_config.model_config.model_class_overrides),
                            "s": round(time.time() - start, 1)}
    del llm
    gc.collect()
    if not args.skip_pp2:
        start = time.time()
        overrides = result["eagle3_pp1"]["overrides"]
        llm = LLM(**common, pipeline_parallel_size=2, distributed_executor_backend="mp", enforce_eager=False,
                  model_class_overrides=overrides)
        result["plain_pp2"] = {"outputs": _generate(llm, prompts, args.max_tokens), "overrides": overrides,
                               "s": round(time.time() - start, 1)}
        del llm
        gc.collect()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
