"""Graphed verify forwards (``pipespec.engine.cuda_graphs``) over fixed KV buffers
(``pipespec.engine.slot_cache``).

On CPU the graphs are emulated (the captured callable re-executed on the static tensors), which checks
everything but the graph itself: the fixed buffers, the capacity-wide masks, the static inputs, the
slot bookkeeping through RowBatch's merges, drops and compactions. Every round's logits must equal a
from-scratch transformers forward; ``pipespec generate --cuda-graphs on`` must give the tokens of
``--cuda-graphs off``. The CUDA replay itself is checked by the GPU test at the end (skipped without
a GPU) and by the GPU benchmark runs (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipespec.cli import main
from pipespec.cli.demo import shipped_pair
from pipespec.engine.cuda_graphs import GraphedForwards, GraphMode
from pipespec.engine.row_batch import RowBatch
from pipespec.engine.slot_cache import SlotLayer, SlotStore
from pipespec.engine.target import build_target_stage
from pipespec.engine.tiny_checkpoints import write_tiny_target

CAPACITY = 160  # the longest row: 8 prompt + 24 rounds x 4 tokens, plus holes up to a quarter (RowBatch compacts)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("graphs") / "llama", "llama", num_layers=4, seed=5)


def _oracle(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class _Pipeline:
    """A P-stage split run in one process: per stage a SlotStore and its graphed forwards."""

    def __init__(self, path: Path, pp: int, mode: GraphMode, device: torch.device, dtype: torch.dtype) -> None:
        self.stages = [build_target_stage(str(path), rank, pp, device=device, dtype=dtype) for rank in range(pp)]
        pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stores = [SlotStore(s.new_cache, 4, CAPACITY, device) for s in self.stages]
        self.graphed = [GraphedForwards(s, store, mode, pool) for s, store in zip(self.stages, self.stores)]
        self.device = device

    def run(self, batches: list[RowBatch], tokens: list[list[int]], committed: list[int]) -> torch.Tensor:
        received: Any = None
        out: Any = None
        for stage, store, graphed, batch in zip(self.stages, self.stores, self.graphed, batches):
            adopted = batch.cache is store.cache
            ids, positions, mask, _ = batch.inputs(tokens, committed, store.capacity if adopted else None)
            if adopted:
                assert mask is not None
                out = graphed(positions, mask, input_ids=ids if stage.stage.is_first else None,
                              received=None if stage.stage.is_first else received)
            elif stage.stage.is_first:
                out = stage.forward(batch.cache, positions, input_ids=ids, attention_mask=mask)
            else:
                out = stage.forward(batch.cache, positions, received=received, attention_mask=mask)
            received = out
        logits, _aux = out
        return logits.float().cpu()


def _rounds(path: Path, pp: int, mode: GraphMode, device: torch.device, dtype: torch.dtype, atol: float) -> _Pipeline:
    rng = random.Random(pp)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    pipe = _Pipeline(path, pp, mode, device, dtype)
    history: dict[int, list[int]] = {}

    def prefill(rows: list[int]) -> list[RowBatch]:
        batches = [RowBatch(s.new_cache(), rows, device) for s in pipe.stages]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in rows]
        logits = pipe.run(batches, prompts, [0] * len(rows))
        for b, (row, prompt) in enumerate(zip(rows, prompts)):
            torch.testing.assert_close(logits[b, : len(prompt)], _oracle(model, prompt), atol=atol, rtol=atol)
            history[row] = list(prompt)
        for batch in batches:
            batch.resolve([len(p) for p in prompts])
        return batches

    def adopt(batches: list[RowBatch]) -> None:
        for batch, store in zip(batches, pipe.stores):
            batch.cache = store.adopt(batch.cache)

    batches = prefill([0, 1, 2])
    adopt(batches)
    pointers = [store.layers[0].key_buffer.data_ptr() for store in pipe.stores]
    compactions = 0
    for round_ in range(24):
        if round_ == 5:  # a new row joins: prefilled on its own, merged into the fixed buffers
            joined = prefill([3])
            batches = [RowBatch.merge([b, j]) for b, j in zip(batches, joined)]
            assert all(b.cache is s.cache for b, s in zip(batches, pipe.stores))
        if round_ == 11:  # a row leaves
            for batch in batches:
                batch.drop({1})
            del history[1]
        rows = batches[0].rows
        new = [[rng.randrange(vocab) for _ in range(rng.choice([1, 4]))] for _ in rows]  # plain or k = 3 rounds
        logits = pipe.run(batches, new, [len(history[r]) for r in rows])
        for b, r in enumerate(rows):
            expected = _oracle(model, history[r] + new[b])[-len(new[b]):]
            torch.testing.assert_close(logits[b, : len(new[b])], expected, atol=atol, rtol=atol)
            history[r] += new[b][: rng.choice([1, rng.randrange(1, len(new[b]) + 1)])]
        before = batches[0].compactions
        for batch, store in zip(batches, pipe.stores):
            batch.resolve([len(history[r]) for r in rows])
            assert store.length == batch.slots and store.rows == batch.size
        compactions += batches[0].compactions - before
        assert batches[0].valid.sum(dim=1).tolist() == [len(history[r]) for r in rows]
    assert compactions, "24 rounds of random rejections never triggered a compaction"
    assert [store.layers[0].key_buffer.data_ptr() for store in pipe.stores] == pointers  # never reallocated
    return pipe


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.timeout(240)
def test_emulated_graph_rounds_equal_from_scratch_forwards(llama: Path, pp: int) -> None:
    pipe = _rounds(llama, pp, "emulate", torch.device("cpu"), torch.float32, 1e-4)
    for graphed in pipe.graphed:
        # One capture per (rows, tokens) shape: 3 or 4 rows (then 3 again after the drop) x 1 or 4 tokens.
        assert graphed.captured == len(graphed.entries) <= 4
        assert graphed.replays == 24 and graphed.eager_forwards == 0


def test_slot_layers_refuse_what_does_not_fit(llama: Path) -> None:
    stage = build_target_stage(str(llama), 0, 1)
    store = SlotStore(stage.new_cache, 2, 8, torch.device("cpu"))
    batch = RowBatch(stage.new_cache(), [0, 1, 2], torch.device("cpu"))
    ids, positions, mask, _ = batch.inputs([[1, 2], [3, 4], [5, 6]], [0, 0, 0])
    stage.forward(batch.cache, positions, input_ids=ids, attention_mask=mask)
    with pytest.raises(RuntimeError, match="3 rows x 2 slots .* do not fit"):
        store.adopt(batch.cache)
    store.set_length(7)
    with pytest.raises(RuntimeError, match="7 \\+ 2 slots exceed the slot cache's capacity 8"):
        store.begin(2)
    layer = SlotLayer(store, torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def _generate(capsys: pytest.CaptureFixture[str], graphs: str, prompts: Path, pp: int) -> dict[str, Any]:
    target, draft = shipped_pair()
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--pp", str(pp), "--prompts-file", str(prompts),
                 "--max-new-tokens", "40", "--ignore-eos", "--json", "--spec-policy", "always", "--timeout", "60",
                 "--cuda-graphs", graphs, "--micro-batches", str(pp)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(300)
def test_generate_with_graphs_gives_the_tokens_of_eager_decoding(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Four prompts of different lengths in two micro-batches at P = 2; rows finish at different rounds."""
    rng = random.Random(0)
    vocab = json.loads((shipped_pair()[0] / "config.json").read_text())["vocab_size"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_ids": [rng.randrange(1, vocab) for _ in range(n)], "max_new_tokens": m}) + "\n"
        for n, m in [(5, 40), (17, 23), (9, 40), (30, 31)]
    ))
    eager = _generate(capsys, "off", prompts, 2)
    graphed = _generate(capsys, "on", prompts, 2)
    assert [o["output_ids"] for o in graphed["outputs"]] == [o["output_ids"] for o in eager["outputs"]]
    for stage in graphed["stages"]:
        assert stage["cuda_graphs"] == "emulate"
        assert stage["graphs_captured"] >= 2 and stage["graph_replays"] > 0 and stage["graph_eager_forwards"] == 0
    last = graphed["stages"][-1]
    # Proposals of running rows replay draft graphs; only the prefill proposals (new rows' own caches) run eagerly.
    assert last["draft_graphs"] >= 4 and last["draft_graph_replays"] > 0 and last["draft_eager_proposals"] == 0
    assert all(stage["cuda_graphs"] == "off" for stage in eager["stages"])


def test_graphs_on_a_model_that_cannot_batch_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "mistral", "mistral", num_layers=2, seed=3, sliding_window=4)
    code = main(["generate", "--target", str(target), "--pp", "1", "--prompt-ids", "1,2,3", "--num-spec-tokens", "0",
                 "--max-new-tokens", "2", "--json", "--timeout", "60", "--cuda-graphs", "on"])
    assert code == 2
    assert "--cuda-graphs on needs a model whose sequences run as rows of one batch" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_cuda_graph_rounds_equal_from_scratch_forwards(llama: Path) -> None:
    pipe = _rounds(llama, 2, "cuda", torch.device("cuda"), torch.float32, 2e-3)
    for graphed in pipe.graphed:
        assert graphed.captured >= 2 and graphed.eager_forwards == 0


def test_the_memory_estimate_is_what_a_store_allocates(llama: Path) -> None:
    """``slot_bytes`` (checked against the free device memory before any buffer is made) equals the
    buffers a store really makes, here for stage 1 of 2 of a GQA model."""
    from pipespec.engine.slot_cache import slot_bytes

    stage = build_target_stage(str(llama), 1, 2)
    store = SlotStore(stage.new_cache, 3, 40, torch.device("cpu"))
    batch = RowBatch(stage.new_cache(), [0, 1], torch.device("cpu"))
    ids, positions, mask, _ = batch.inputs([[1, 2], [3, 4]], [0, 0])
    hidden = torch.zeros(2, 2, stage.hidden_size)
    from pipespec.contract.intermediate import IntermediateTensors

    received = IntermediateTensors({key: hidden.clone() for key in stage.receive_keys()})
    stage.forward(batch.cache, positions, received=received, attention_mask=mask)
    store.adopt(batch.cache)
    made = sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in store.layers)
    layers = stage.stage.end_layer - stage.stage.start_layer
    assert slot_bytes(stage.resolved.config, layers, 3, 40, torch.float32) == made > 0


def test_graphs_that_do_not_fit_fall_back_or_are_refused() -> None:
    from pipespec.engine.stage.captures import graphs_fit
    from pipespec.errors import UsageError

    gib = 2**30
    assert graphs_fit("auto", 10 * gib, 40 * gib) == "cuda"
    assert graphs_fit("auto", 30 * gib, 40 * gib) is None  # auto: decode eagerly instead
    with pytest.raises(UsageError, match="need 30.00 GiB, more than half of the 40.00 GiB free"):
        graphs_fit("on", 30 * gib, 40 * gib)
