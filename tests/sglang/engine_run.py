"""One ``sglang.Engine`` run on CPU, in a process of its own (run by ``harness.run_engine``).

SGLang loads its plugins once per process (``load_plugins`` keeps a global flag) and keeps their hooks, so a
run with ``PIPESPEC_SGLANG=off`` and one with the plugin cannot share a process: every engine gets its own.
Writes ``result.json`` (``output_ids``; ``hidden_states``, the rows SGLang returns, at pp_size 1 only: with
pp_size > 1 SGLang 0.5.23 cannot return hidden states) into ``--out``; on an error, prints its one line to
stderr and exits 1. The engine is always shut down.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--aux-ids", default="", help="SGLang's ids (output of layer i); empty: the model's default")
    parser.add_argument("--prompt-ids", default="1,5,9,13,17")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    args = parser.parse_args()
    import numpy as np
    import sglang

    kwargs = dict(model_path=args.model, skip_tokenizer_init=True, device="cpu", attention_backend="torch_native",
                  sampling_backend="pytorch", dtype="float32", pp_size=args.pp, disable_overlap_schedule=True,
                  mem_fraction_static=0.1, max_total_tokens=1024, disable_cuda_graph=True, log_level="error",
                  host="127.0.0.1", port=_free_port(), nccl_port=_free_port(), enable_return_hidden_states=True,
                  enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3")
    if args.aux_ids:
        kwargs["return_aux_hidden_state_layer_ids"] = [int(i) for i in args.aux_ids.split(",")]
    try:
        engine = sglang.Engine(**kwargs)
    except Exception as exc:  # the refusal under test is one line: print it as it is
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        prompt = [int(i) for i in args.prompt_ids.split(",")]
        out = engine.generate(input_ids=[prompt], return_hidden_states=args.pp == 1,
                              sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0.0})[0]
    finally:
        engine.shutdown()
    result: dict[str, object] = {"output_ids": out["output_ids"]}
    if args.pp == 1:
        rows = out["meta_info"]["hidden_states"]
        prefill = np.asarray(rows[0], dtype=np.float32)  # [prompt tokens, K * hidden], then one row per step
        result["hidden_states"] = np.concatenate([prefill] + [np.asarray(r, dtype=np.float32)[None] for r in rows[1:]]
                                                 ).tolist()
    with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
