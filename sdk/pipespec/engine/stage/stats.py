"""What a stage reports after decoding: its own statistics, and on the last stage the outputs and the run's
figures (the ``generation`` part of ``pipespec generate``'s JSON).

Must not import the CLI or vllm.
"""

from __future__ import annotations

from typing import Any

import torch

from pipespec.engine.job import GenerateJob
from pipespec.engine.stage.runner import StageRunner


def stage_stats(runner: StageRunner) -> dict[str, Any]:
    """What this stage did and how long it waited on the others (seconds): ``decode_s`` minus the
    waits is the time the stage was busy, and the busiest stage bounds the pipeline's speed."""
    return {
        "messages_sent": runner.sender.messages if runner.sender else 0,
        "aux_transport": runner.job.aux_transport,
        "overlap_messages_sent": runner.overlap.messages if runner.overlap else 0,
        "bytes_sent": runner.sender.bytes_sent if runner.sender else 0,
        "rounds": runner.step,
        "forwards": runner.forwards,
        "batched": runner.batched,
        "decode_s": round(runner.elapsed, 4),
        "hop_recv_wait_s": round(runner.receiver.waited_s, 4) if runner.receiver else 0.0,
        "hop_send_wait_s": round(runner.sender.waited_s, 4) if runner.sender else 0.0,
        "step_message_wait_s": round(runner.channel.waited_s, 4),
        "phase_s": runner.clock.to_json(),
        "phase_first_ms": runner.clock.first_ms(),
        "cuda_graphs": runner.graph_mode or "off",
        **({"graphs_captured": sum(g.captured for g in runner.graphed.values()),
            "graph_replays": sum(g.replays for g in runner.graphed.values()),
            "graph_eager_forwards": sum(g.eager_forwards for g in runner.graphed.values())} if runner.graphed else {}),
        **({"draft_graphs": sum(r.graphs for r in runner.draft_runners),
            "draft_graph_replays": sum(r.replays for r in runner.draft_runners),
            "draft_eager_proposals": sum(r.eager_calls for r in runner.draft_runners)} if runner.draft_runners else {}),
        **({"draft_backlog": runner.backlog_cap, "draft_ingests": runner.draft_ingests} if runner.policy else {}),
    }


def generation_result(
    job: GenerateJob, runner: StageRunner, info: Any, aux_layers: tuple[int, ...], partition: Any,
    dtype: torch.dtype, eos: frozenset[int], elapsed: float, warmup: float, draft_stats: dict[str, Any],
) -> dict[str, Any]:
    """The last stage's ``generation``: every output, acceptance, rounds, speed, and the aux-id facts."""
    outputs = [
        {"output_ids": s.output, "num_steps": len(s.acceptance) + s.plain_steps, "plain_steps": s.plain_steps,
         "mean_acceptance_length": _mean(s.acceptance),
         "acceptance_lengths": s.acceptance, "finish_reason": s.finish_reason,
         **({"draft_trace": s.trace} if job.trace else {})}
        for s in runner.seqs
    ]
    all_acceptance = [a for s in runner.seqs for a in s.acceptance]
    new_tokens = sum(len(s.output) for s in runner.seqs)
    return {
        "outputs": outputs,
        # Verify steps of the longest-running sequence: with one micro-batch and every sequence admitted
        # at once, the pipeline's step count after the prefill.
        "num_steps": max(len(s.acceptance) + s.plain_steps for s in runner.seqs),
        "spec_policy": job.spec_policy,
        **({"spec_rounds": runner.policy.spec_rounds, "plain_rounds": runner.policy.plain_rounds,
            "policy_switches": runner.policy.switches, "policy_load_changes": runner.policy.load_changes,
            "policy_rates": runner.policy.rates(), "policy_trace": runner.policy.trace()} if runner.policy else {}),
        "batched_forwards": runner.batched,
        "micro_batches": runner.scheduler.num_micro_batches,
        "micro_batches_why": runner.micro_batch_reason,
        "slots_per_micro_batch": runner.slots,
        "max_num_seqs": runner.scheduler.capacity,
        "rounds": runner.step,
        "stale_entries_ignored": runner.scheduler.stale,
        "mean_acceptance_length": _mean(all_acceptance),
        "num_new_tokens": new_tokens,
        "elapsed_s": round(elapsed, 4),
        "warmup_s": round(warmup, 4),
        "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "aux_layers": list(aux_layers),
        "aux_convention": info.aux_convention if info else None,
        "aux_convention_source": info.aux_convention_source if info else None,
        "config_aux_layers": list(info.config_aux_layers) if info and info.config_aux_layers is not None else None,
        "partition": list(partition),
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_ids": sorted(eos),
        **draft_stats,
    }


def _mean(values: list[int]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
