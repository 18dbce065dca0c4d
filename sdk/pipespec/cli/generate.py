"""``pipespec generate``: EAGLE3 speculative decoding (greedy) with the target split over P processes.

Starts P stage processes itself (gloo on CPU, NCCL with ``--device cuda``, one GPU per stage); the same
flags run one stage per process under ``torchrun --nproc-per-node P -m pipespec.engine``. Output
contract: ``--json`` prints ``{"output_ids", "num_steps", "mean_acceptance_length",
"tokens_per_s", "aux_convention", "aux_layers", ...}``, or ``{"outputs": [...], ...}`` for
``--prompts-file``. The aux convention in use is printed in every run (stderr) and in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from pipespec.cli.args import int_list, non_negative_int, positive_int
from pipespec.errors import UsageError

HELP = "run greedy EAGLE3 speculative decoding with the target split over P pipeline stages"


def add_arguments(parser: argparse.ArgumentParser, pp_help: str = "pipeline stages, one process each (default 1)") -> None:
    parser.add_argument("--target", required=True, metavar="DIR", help="target checkpoint directory (HF, safetensors)")
    parser.add_argument("--draft", metavar="DIR", help="EAGLE3 draft checkpoint (Format A or B); not needed with --num-spec-tokens 0")
    parser.add_argument("--pp", type=positive_int, default=1, metavar="P", help=pp_help)
    parser.add_argument("--partition", type=int_list, metavar="C0,C1,...", help="layers per stage (default: vLLM's rule)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a tokenizer in the target directory)")
    src.add_argument("--prompt-ids", type=int_list, metavar="1,2,3", help="prompt token ids")
    src.add_argument("--prompts-file", metavar="FILE",
                     help='JSON lines, each {"prompt": ...} or {"prompt_ids": [...]}, optionally "max_new_tokens" and '
                          '"cancel_after" (cancel once its n-th target forward is in flight)')
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="M", help="new tokens per prompt (default 32)")
    parser.add_argument("--micro-batches", type=positive_int, metavar="N",
                        help="micro-batches in flight through the pipeline (default: P, or the number of sequences if "
                             "fewer; 1 = every step waits for the last stage)")
    parser.add_argument("--max-num-seqs", type=positive_int, metavar="S",
                        help="sequences decoded at once; the others wait for a free slot (default: all prompts)")
    parser.add_argument("--aux-transport", choices=("relay", "overlap"), default="relay",
                        help="relay: aux states ride in the stage's one packed message (default); overlap: each is "
                             "sent as soon as captured, while the stage's later layers compute (prefill-sized forwards)")
    parser.add_argument("--overlap-min-tokens", type=positive_int, default=64, metavar="T",
                        help="with --aux-transport overlap: use it for forwards of at least T tokens (default 64)")
    parser.add_argument("--num-spec-tokens", type=non_negative_int, default=3, metavar="K",
                        help="draft tokens verified per step (default 3; 0 = plain pipeline decoding)")
    parser.add_argument("--spec-policy", choices=("adaptive", "always"), default="adaptive",
                        help="adaptive: measure tokens/s with and without drafts and fall back to plain decoding "
                             "while that is faster (default); always: speculate every step (deterministic steps)")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="replay decode forwards from CUDA graphs: auto = on CUDA for batchable models (default); "
                             "on = also on CPU, where the same fixed-buffer path runs without graphs (for testing); off",
                        )
    parser.add_argument("--aux-convention", choices=("input", "output"),
                        help="how to read the draft's aux ids (default: Format A output, Format B input)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per stage)")
    parser.add_argument("--dtype", help="compute dtype (default float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds any stage waits on another during decoding before giving up (default 300)")
    parser.add_argument("--load-timeout", type=float, default=1800.0, metavar="S",
                        help="seconds a stage waits for the others to finish loading their weights (default 1800)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    parser.add_argument("--trace", action="store_true",
                        help="add each output's draft_trace (the drafts every verify step checked; [] for a plain step) to the JSON")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object: {"output_ids" (new tokens only), "num_steps", '
                             '"mean_acceptance_length", "tokens_per_s", "aux_convention", "aux_layers", ...}; '
                             'with --prompts-file {"outputs": [{"output_ids": [...]}, ...] in input order, ...}')
    parser.add_argument("--verbose", "-v", action="store_true", help="per-stage log lines on stderr")


def check_device(device: str) -> None:
    """``--device cuda`` needs a CUDA device visible here: refused before the job is read or a stage starts."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else \
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        raise UsageError(f"--device cuda: {built}; use --device cpu, or run where a GPU is visible")


def job_from_args(args: argparse.Namespace) -> Any:
    """The ``GenerateJob`` these flags describe (tokenizes text prompts)."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # nan and inf would fail deep in torch.distributed
        raise UsageError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if not (math.isfinite(args.load_timeout) and args.load_timeout > 0):
        raise UsageError(f"--load-timeout must be a finite number of seconds > 0, got {args.load_timeout}")
    check_device(args.device)
    from pipespec.engine.job import GenerateJob, build_requests

    if args.dtype is not None:
        from pipespec.pp.loading import dtype_from_name

        dtype_from_name(args.dtype)  # refuse a bad --dtype before any stage process starts
    requests = build_requests(
        args.target, prompt=args.prompt, prompt_ids=args.prompt_ids, prompts_file=args.prompts_file,
        max_new_tokens=args.max_new_tokens,
    )
    return GenerateJob(
        target=args.target, draft=args.draft, pp=args.pp,
        partition=tuple(args.partition) if args.partition is not None else None,
        requests=requests, num_spec_tokens=args.num_spec_tokens, aux_convention=args.aux_convention,
        device=args.device, dtype=args.dtype, timeout_s=args.timeout, verbose=args.verbose, ignore_eos=args.ignore_eos,
        trace=args.trace, load_timeout_s=args.load_timeout, micro_batches=args.micro_batches, max_num_seqs=args.max_num_seqs,
        aux_transport=args.aux_transport, overlap_min_tokens=args.overlap_min_tokens, spec_policy=args.spec_policy,
        cuda_graphs=args.cuda_graphs,
    )


def compose_output(job: Any, stage_results: list[dict[str, Any]], batch: bool) -> dict[str, Any]:
    """Merge the stages' results into the ``--json`` object (the keys ``add_arguments``'s help names)."""
    from pipespec.engine.job import load_tokenizer

    generation = dict(stage_results[-1]["generation"])
    outputs = generation.pop("outputs")
    tokenizer = load_tokenizer(job.target)
    if tokenizer is not None:
        for out in outputs:
            out["text"] = tokenizer.decode(out["output_ids"])
    head: dict[str, Any] = {"outputs": outputs} if batch else dict(outputs[0])
    if batch:
        head["num_steps"] = generation.pop("num_steps")
    else:
        generation.pop("num_steps")
    head.update(generation)
    head.update({
        "pp": job.pp,
        "num_spec_tokens": job.num_spec_tokens,
        "device": job.device,
        "stages": [r["stage"] for r in stage_results],
    })
    return head


def print_result(result: dict[str, Any], as_json: bool, batch: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    outputs = result["outputs"] if batch else [result]
    for i, out in enumerate(outputs):
        label = f"[{i}] " if batch else ""
        cancelled = " (cancelled)" if out.get("finish_reason") == "cancelled" else ""
        print(f"{label}output ids{cancelled}: {out['output_ids']}")
        if "text" in out:
            print(f"{label}text: {out['text']!r}")
    print(
        f"steps {result['num_steps']}, mean acceptance length {result['mean_acceptance_length']:.2f}, "
        f"{result['tokens_per_s']:.1f} tokens/s, pp {result['pp']} partition {result['partition']}, k {result['num_spec_tokens']}, "
        f"micro-batches {result['micro_batches']}"
    )
    for s in result["stages"]:
        share = s["bytes_read"] / s["checkpoint_bytes"] if s["checkpoint_bytes"] else 0.0
        print(f"  stage {s['rank']}: layers [{s['start_layer']}, {s['end_layer']}), "
              f"read {s['bytes_read'] / 1e6:.2f} MB ({share:.0%} of the checkpoint)")


_ANNOUNCED: set[str] = set()


def announce_convention(result: dict[str, Any]) -> None:
    """The aux convention line every run prints (stderr, so --json stdout stays one object).

    Once per process for each distinct line: a benchmark that runs ``generate`` through this entry
    point many times over one pair says it once (each result's JSON still carries the convention)."""
    if result.get("aux_convention") is None:
        line = "pipespec: plain pipeline decoding (--num-spec-tokens 0): no draft, no aux states"
    else:
        line = (f"pipespec: aux convention {result['aux_convention']} ({result['aux_convention_source']}): "
                f"draft ids {result['config_aux_layers']} -> aux layers {result['aux_layers']} (input-index)")
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    job = job_from_args(args)  # flag errors first: before the engine, the model check, any stage
    from pipespec.engine.stage.loading import check_job
    from pipespec.engine.worker import stage_main
    from pipespec.pp.launch import run_stages

    check_job(job)
    results = run_stages(stage_main, job, job.pp, device_type=job.device, timeout_s=job.timeout_s,
                         load_timeout_s=job.load_timeout_s, verbose=job.verbose)
    batch = args.prompts_file is not None
    result = compose_output(job, results, batch)
    announce_convention(result)
    print_result(result, args.json, batch)
    return 0
