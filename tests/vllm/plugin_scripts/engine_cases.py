"""Run engine-load cases through vLLM's front-end in one process; one JSON line per case on stdout.

Usage: engine_cases.py CASES.json, a list of ``{"name", "model", "draft"?, "pp"?, "overrides"?, "env"?,
"config_only"?}``. Each case builds the run's config the way ``vllm.LLM`` does (``config_only``:
``EngineArgs(...).create_engine_config()``, which is where the plugin acts, without starting an engine)
or constructs ``vllm.LLM`` itself, and prints ``{"name", "ok", "overrides"}`` or ``{"name", "ok": false,
"type", "message"}``. ``env`` is set in this process before the case (e.g. PIPESPEC_ADAPTERS_PATH);
switches read when the plugin loads (PIPESPEC_VLLM) need a process of their own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(model=case["model"], dtype="float32", max_model_len=256, max_num_seqs=1,
                                  enforce_eager=True, model_class_overrides=dict(case.get("overrides", {})))
    if case.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": case["draft"], "num_speculative_tokens": 3}
    if case.get("pp", 1) > 1:
        kwargs.update(pipeline_parallel_size=case["pp"], distributed_executor_backend="mp", enforce_eager=False)
    for key, value in case.get("env", {}).items():
        os.environ[key] = value
    try:
        if case.get("config_only"):
            from vllm.engine.arg_utils import EngineArgs

            config = EngineArgs(**kwargs).create_engine_config()
        else:
            from vllm import LLM

            config = LLM(**kwargs).llm_engine.vllm_config
    except Exception as exc:  # the case under test: report how it failed
        return {"name": case["name"], "ok": False, "type": type(exc).__name__, "message": str(exc)}
    finally:
        for key in case.get("env", {}):
            os.environ.pop(key, None)
    return {"name": case["name"], "ok": True, "overrides": dict(config.model_config.model_class_overrides)}


def main() -> None:
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(run_case(case)), flush=True)


if __name__ == "__main__":
    main()
