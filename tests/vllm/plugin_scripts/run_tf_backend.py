"""The demo pair through ``vllm.LLM`` with vLLM's Transformers modeling backend: every run the tests compare.

1. EAGLE3 at PP=1 on vLLM's native Llama class (``model_impl="vllm"``): greedy outputs and acceptance
   counts per draft position (``llm.get_metrics()``);
2. the same with ``model_impl="transformers"`` (pipespec's plugin registers its Transformers-backend
   subclass at engine load), compiled (``enforce_eager=False``, vLLM's default): outputs, acceptance, the
   override vLLM applied;
3. plain PP=2 with ``model_impl="transformers"`` through the same subclass (registered with
   ``model_class_overrides`` as the plugin registers it): greedy outputs.

Usage: run_tf_backend.py --model DIR --draft DIR --prompts FILE --max-tokens M --k K --out FILE.json
(prompts: a JSON list of token-id lists). One engine at a time, each deleted before the next starts.
Run as a subprocess: vLLM spawns workers, hence the main guard.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

from run_family import _generate, _metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    common = dict(model=args.model, dtype="float32", max_model_len=256, max_num_seqs=len(prompts), seed=0)
    speculative = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}

    from vllm import LLM

    result: dict[str, Any] = {}
    # The backend's run is compiled (vLLM's default; the id-0 tap and the recorders are hooks dynamo traces),
    # the native class's eager: the two must still agree token for token in float32.
    for name, impl, eager in (("native_eagle3_pp1", "vllm", True), ("backend_eagle3_pp1", "transformers", False)):
        start = time.time()
        llm = LLM(**common, model_impl=impl, enforce_eager=eager, disable_log_stats=False,
                  speculative_config=speculative)
        result[name] = {"outputs": _generate(llm, prompts, args.max_tokens), **_metrics(llm),
                        "overrides": dict(llm.llm_engine.vllm_config.model_config.model_class_overrides),
                        "s": round(time.time() - start, 1)}
        del llm
        gc.collect()
    start = time.time()
    overrides = result["backend_eagle3_pp1"]["overrides"]
    llm = LLM(**common, model_impl="transformers", pipeline_parallel_size=2, distributed_executor_backend="mp",
              enforce_eager=False, model_class_overrides=overrides)
    result["backend_plain_pp2"] = {"outputs": _generate(llm, prompts, args.max_tokens), "overrides": overrides,
                                   "s": round(time.time() - start, 1)}
    del llm
    gc.collect()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
