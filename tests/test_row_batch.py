"""``RowBatch``: several sequences as the rows of one cached forward, rejected positions kept as masked
holes. Every round's logits must equal a from-scratch forward (no cache) of each row's committed
tokens plus its new ones, through rounds that keep random counts, merges of new rows, drops and the
compaction of holes; on a stage of a real 2-stage split too (hidden states handed over)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipespec.engine.row_batch import RowBatch, batchable
from pipespec.engine.target import build_target_stage
from pipespec.engine.tiny_checkpoints import write_tiny_target


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("rb") / "llama", "llama", num_layers=4, seed=21)


def _oracle(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def _run(stages: list[Any], batches: list[RowBatch], tokens: list[list[int]], committed: list[int]) -> torch.Tensor:
    """One forward through every stage's batch (hidden states handed from stage to stage)."""
    received = None
    out: Any = None
    for stage, batch in zip(stages, batches):
        ids, positions, mask, _ = batch.inputs(tokens, committed)
        if stage.stage.is_first:
            out = stage.forward(batch.cache, positions, input_ids=ids, attention_mask=mask)
        else:
            out = stage.forward(batch.cache, positions, received=received, attention_mask=mask)
        received = out
    logits, _aux = out
    return logits


@pytest.mark.parametrize(("pp", "mask_dtype"), [(1, None), (2, None), (2, torch.float32)])
@pytest.mark.timeout(240)
def test_batched_rounds_with_holes_equal_from_scratch_forwards(llama: Path, pp: int, mask_dtype: torch.dtype | None) -> None:
    """Boolean masks (sdpa) and additive masks (eager attention's form; sdpa takes it too)."""
    rng = random.Random(pp)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    stages = [build_target_stage(str(llama), rank, pp) for rank in range(pp)]
    assert batchable(stages[0].resolved.config)
    history: dict[int, list[int]] = {}

    def prefill(rows: list[int]) -> list[RowBatch]:
        batches = [RowBatch(s.new_cache(), rows, torch.device("cpu"), mask_dtype) for s in stages]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in rows]
        logits = _run(stages, batches, prompts, [0] * len(rows))
        for b, (row, prompt) in enumerate(zip(rows, prompts)):
            torch.testing.assert_close(logits[b, : len(prompt)], _oracle(model, prompt), atol=1e-4, rtol=1e-4)
            history[row] = list(prompt)
        for batch in batches:
            batch.resolve([len(p) for p in prompts])
        return batches

    batches = prefill([0, 1, 2])
    compactions = 0
    for round_ in range(24):
        if round_ == 5:  # a new row joins (prefilled on its own, then merged)
            joined = prefill([3])
            batches = [RowBatch.merge([b, j]) for b, j in zip(batches, joined)]
        if round_ == 11:  # a row leaves
            for batch in batches:
                batch.drop({1})
            del history[1]
        rows = batches[0].rows
        new = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 5))] for _ in rows]
        logits = _run(stages, batches, new, [len(history[r]) for r in rows])
        for b, r in enumerate(rows):
            expected = _oracle(model, history[r] + new[b])[-len(new[b]):]
            torch.testing.assert_close(logits[b, : len(new[b])], expected, atol=1e-4, rtol=1e-4)
            history[r] += new[b][: rng.choice([1, rng.randrange(1, len(new[b]) + 1)])]
        before = batches[0].compactions
        for batch in batches:
            batch.resolve([len(history[r]) for r in rows])
        compactions += batches[0].compactions - before
        assert all(b.slots == batches[0].slots for b in batches)
        assert batches[0].valid.sum(dim=1).tolist() == [len(history[r]) for r in rows]
    assert compactions, "24 rounds of random rejections never triggered a compaction"


def test_one_row_batch_is_the_per_sequence_path(llama: Path) -> None:
    """A single row never builds a mask and its rejected positions are cropped, not kept as holes."""
    stage = build_target_stage(str(llama), 0, 1)
    batch = RowBatch(stage.new_cache(), [0], torch.device("cpu"))
    _, _, mask, _ = batch.inputs([[1, 2, 3]], [0])
    assert mask is None
    stage.forward(batch.cache, torch.arange(3)[None], input_ids=torch.tensor([[1, 2, 3]]))
    batch.resolve([3])
    _, _, mask, _ = batch.inputs([[4, 5, 6, 7]], [3])
    assert mask is None
    stage.forward(batch.cache, torch.arange(3, 7)[None], input_ids=torch.tensor([[4, 5, 6, 7]]))
    batch.resolve([5])
    assert batch.slots == 5 and batch.cache.get_seq_length() == 5


def test_sliding_window_models_are_not_batchable(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "mistral", "mistral", num_layers=2, seed=3, sliding_window=4)
    assert not batchable(AutoConfig.from_pretrained(target))


def test_resolve_refuses_more_kept_positions_than_were_run(llama: Path) -> None:
    stage = build_target_stage(str(llama), 0, 1)
    batch = RowBatch(stage.new_cache(), [0, 1], torch.device("cpu"))
    ids, positions, mask, _ = batch.inputs([[1, 2], [3]], [0, 0])
    stage.forward(batch.cache, positions, input_ids=ids, attention_mask=mask)
    with pytest.raises(RuntimeError, match="kept 3 of 2"):
        batch.resolve([2, 3])


@pytest.mark.parametrize(("model_type", "overrides", "expected"), [
    ("llama", {}, True),
    ("qwen2", {}, True),
    ("gemma2", {"sliding_window": 8}, False),  # alternating sliding/full layers: decided for the whole model
    ("qwen3_next", {}, False),  # linear-attention layers
])
def test_batchable_is_decided_for_the_whole_model(model_type: str, overrides: dict[str, Any], expected: bool) -> None:
    config = AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides)
    assert batchable(config) is expected


def test_inputs_travel_as_one_packed_buffer_and_come_back_exact() -> None:
    """``pack_bytes``/``unpack_bytes`` (one host-to-device copy per forward on CUDA): tensors of every dtype
    the inputs use, odd sizes included, come back bit-exact with their shapes; every view starts at an
    8-byte boundary of the buffer."""
    from pipespec.engine.row_batch import pack_bytes, to_device_many, unpack_bytes

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 50_000, (3, 5), generator=gen),  # ids
        torch.randint(0, 9, (3, 5), generator=gen) + 100,  # positions
        torch.rand(3, 1, 5, 13, generator=gen) > 0.5,  # a boolean mask of odd size
        torch.randn(2, 1, 3, 7, generator=gen).to(torch.bfloat16),  # an additive mask
        torch.randn(1, 1, 1, 3, generator=gen),
    ]
    buffer, offsets = pack_bytes(tensors)
    assert buffer.dtype == torch.uint8 and all(o % 8 == 0 for o in offsets)
    for back, original in zip(unpack_bytes(buffer.clone(), offsets, tensors), tensors):
        assert back.dtype == original.dtype and back.shape == original.shape
        assert torch.equal(back, original)
    assert all(a is b for a, b in zip(to_device_many(tensors, torch.device("cpu")), tensors))  # nothing to copy on CPU
