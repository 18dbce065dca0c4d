"""One stage process of ``pipespec generate``: load this stage, then run greedy EAGLE3 decoding with up
to M micro-batches in flight.

``stage_main`` is the entry point ``pipespec.pp.launch`` and the CLI run; the phases live in
``pipespec.engine.stage`` (settings, loading, rounds, drafting, captures, runner, stats). ``StageRunner``
is looked up here when a stage starts (``pipespec.bench.soak`` rebinds it). Must not import the CLI or vllm.

Every stage runs the same schedule over the same replicated state (``pipespec.engine.microbatch``);
only the last stage decides anything, and its per-round message keeps the copies equal.

Sequences are grouped into M micro-batches that take turns (round-robin). A *round* of a micro-batch
runs its sequences as the rows of batched forwards (``pipespec.engine.row_batch``): one forward for
the sequences already running (verify), one for the sequences admitted this turn (prefill); each
goes through the whole pipeline, every stage handing its packed ``IntermediateTensors`` to the next.
A stage whose layers cannot hold rows with holes (sliding-window, linear-attention or convolution
layers) runs one forward per sequence instead.

Prefill (a sequence's first forward): stage 0 embeds the prompt ``x_0..x_{n-1}`` and runs its layers;
the last stage takes the greedy token ``x_n`` from the final logits; the draft reads the aux states of
all ``n`` positions paired with ``x_1..x_n`` and proposes ``d_1..d_k``. Prompts of a batch are padded
to the longest; padding is masked.

Verify (every later forward): for a sequence with ``c`` tokens committed to its KV cache, the pipeline
runs ``[x_n, d_1..d_j]`` at positions ``c..c+j`` (``j = k``, or 0 when the last stage chose plain
decoding for the round: ``pipespec.engine.spec_policy``); the last stage's greedy predictions
``y_0..y_j`` accept the longest prefix with ``d_i == y_{i-1}`` (``a`` drafts) plus the bonus token
``y_a``; the draft reads the aux states of those ``a + 1`` positions paired with ``d_1..d_a, y_a`` and
proposes the next k (or, not speculating, only stores them so it can resume with full context).

After the round, the last stage publishes one message for the micro-batch (``pipespec.engine.step``:
per slot ``a``, the tokens, the drafts) without waiting for anyone, and goes on with the next
micro-batch; every other stage has posted the receive for it and reads it only when that
micro-batch's turn comes again (M turns later). Then every stage marks each row's rejected positions
as holes in its batched KV cache (``RowBatch.resolve``: crops what every row rejected, compacts when
holes pile up), drops finished and cancelled rows, merges the new rows in, and updates its copy of
the state. With M = 1 every round waits for the previous round's message: the pipeline drains each
step.

On CUDA (``--cuda-graphs auto``) a micro-batch's running rows live in fixed KV buffers and its verify
forwards and the draft's proposals replay CUDA graphs (``pipespec.engine.cuda_graphs``,
``pipespec.engine.draft_graph``); every stage times the phases of its rounds (``pipespec.engine.phases``).

``k = 0`` is plain pipeline-parallel decoding: one token per round, no draft. Sequences accept
different numbers of drafts (their rows keep different counts), finish at different rounds, and leave
their slot to a waiting request (``--max-num-seqs``) or to nobody.
"""

from __future__ import annotations

from typing import Any

from pipespec.engine.job import GenerateJob
from pipespec.engine.phases import maybe_profile
from pipespec.engine.stage.loading import check_job, load_stage, wait_for_all_stages_loaded
from pipespec.engine.stage.runner import StageRunner
from pipespec.engine.stage.settings import configure_cuda_attention
from pipespec.engine.stage.stats import generation_result, stage_stats
from pipespec.pp.launch import StageContext

__all__ = ["StageRunner", "check_job", "configure_cuda_attention", "stage_main"]


def stage_main(ctx: StageContext, job: GenerateJob) -> dict[str, Any]:
    """Everything one stage does; returns its stats, plus the outputs on the last stage."""
    loaded = load_stage(ctx, job)
    target = loaded.target
    wait_for_all_stages_loaded(ctx)
    runner = StageRunner(ctx, job, target, loaded.draft, loaded.eos)
    warmup = runner.warmup()
    with maybe_profile(ctx.rank, ctx.device):  # $PIPESPEC_PROFILE (pipespec.engine.phases)
        elapsed = runner.run()

    stage = target.stage
    stats = {"rank": ctx.rank, "start_layer": stage.start_layer, "end_layer": stage.end_layer,
             **target.load.to_json_dict(), **stage_stats(runner)}
    result: dict[str, Any] = {"stage": stats}
    if not ctx.is_last:
        return result
    result["generation"] = generation_result(
        job, runner, loaded.draft_info, loaded.aux_layers, target.plan.partition, loaded.dtype, loaded.eos,
        elapsed, warmup, loaded.draft_stats,
    )
    return result
