"""The EAGLE3 draft model: forward parity with an independent float32 oracle, KV cache, rollback, proposing.

The oracle is assembled from transformers' own Llama pieces (``LlamaAttention`` with a 2H input and an
H-wide ``o_proj``, ``LlamaRMSNorm``, ``LlamaMLP``, ``LlamaRotaryEmbedding``, eager attention with an
additive causal mask) and always recomputes the whole sequence, so it shares no code with the draft's
cache, masking, or attention path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.reference import reference_speculative_generate, target_aux_states
from pipespec.engine.tiny_checkpoints import make_random_draft, write_agreeing_pair, write_tiny_target

ATOL = 2e-5


class Oracle(nn.Module):
    """The EAGLE3 layer from transformers parts; weights copied from a draft."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        cfg = draft.config
        layer = cfg.layer
        hidden, eps = cfg.hidden_size, float(layer.rms_norm_eps)
        attn_cfg = LlamaConfig(
            hidden_size=2 * hidden, num_attention_heads=layer.num_attention_heads,
            num_key_value_heads=layer.num_key_value_heads, head_dim=cfg.head_dim,
            rope_parameters=dict(layer.rope_parameters), max_position_embeddings=layer.max_position_embeddings,
        )
        attn_cfg._attn_implementation = "eager"
        self.attn = LlamaAttention(attn_cfg, layer_idx=0)
        self.attn.o_proj = nn.Linear(layer.num_attention_heads * cfg.head_dim, hidden, bias=False)
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=layer.intermediate_size,
                                        hidden_act=layer.hidden_act))
        self.in_norm, self.hid_norm, self.post_norm, self.final_norm = (LlamaRMSNorm(hidden, eps) for _ in range(4))
        self.rotary = LlamaRotaryEmbedding(attn_cfg)
        self.norm_before_residual = cfg.norm_before_residual
        src = draft.midlayer
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(self.attn, name).weight.copy_(getattr(src.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(self.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            self.in_norm.weight.copy_(src.input_layernorm.weight)
            self.hid_norm.weight.copy_(src.hidden_norm.weight)
            self.post_norm.weight.copy_(src.post_attention_layernorm.weight)
            self.final_norm.weight.copy_(draft.norm.weight)
        self.embed = draft.embed_tokens
        self.fc = draft.fc
        self.lm_head = draft.lm_head
        self.d2t = draft.d2t

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full causal recompute over positions 0..T-1: (pre-norm output, draft logits)."""
        steps = ids.shape[1]
        residual = self.hid_norm(hidden) if self.norm_before_residual else hidden
        x = torch.cat((self.in_norm(self.embed(ids)), self.hid_norm(hidden)), dim=-1)
        positions = torch.arange(steps).expand(ids.shape[0], steps)
        mask = torch.full((steps, steps), float("-inf")).triu(1)[None, None]
        attn_out, _ = self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)
        h = residual + attn_out
        h = h + self.mlp(self.post_norm(h))
        return h, self.lm_head(self.final_norm(h))

    def chain(self, ids: torch.Tensor, feats: torch.Tensor, k: int) -> list[int]:
        """Draft k target ids by recomputing the whole sequence after each step (batch 1)."""
        hidden = self.fc(feats)
        out, logits = self(ids, hidden)
        drafts = []
        for _ in range(k):
            d = int(logits[0, -1].argmax())
            token = d + int(self.d2t[d])
            drafts.append(token)
            ids = torch.cat((ids, torch.tensor([[token]])), dim=1)
            hidden = torch.cat((hidden, out[:, -1:]), dim=1)
            out, logits = self(ids, hidden)
        return drafts


def _draft(seed: int = 0, *, gqa: bool = True, rope: dict | None = None, norm_before_residual: bool = False,
           draft_vocab: int | None = None) -> Eagle3Draft:
    target = LlamaConfig(hidden_size=32, vocab_size=80, num_hidden_layers=6, rms_norm_eps=1e-5)
    extra = {"rope_scaling": rope} if rope else {}
    draft = make_random_draft(
        target, num_aux=3, with_embedding=True, num_attention_heads=4, num_key_value_heads=2 if gqa else 4,
        draft_vocab_size=draft_vocab, seed=seed, max_position_embeddings=64, **extra,
    )
    if norm_before_residual:
        draft = _with_norm_before_residual(draft)
    return draft.eval()


def _with_norm_before_residual(draft: Eagle3Draft) -> Eagle3Draft:
    cfg = draft.config
    new = Eagle3Draft(Eagle3DraftConfig(cfg.layer, cfg.target_hidden_size, cfg.num_aux, cfg.draft_vocab_size, True),
                      with_embedding=True)
    new.load_state_dict(draft.state_dict())
    return new


def _inputs(bsz: int, steps: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 80, (bsz, steps), generator=gen), torch.randn(bsz, steps, 96, generator=gen)


VARIANTS = {
    "mha": dict(gqa=False),
    "gqa": dict(gqa=True),
    "llama3-rope": dict(rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    "norm-before-residual": dict(norm_before_residual=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_forward_matches_transformers_oracle(variant: str) -> None:
    draft = _draft(**VARIANTS[variant])
    oracle = Oracle(draft)
    ids, feats = _inputs(2, 9)
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        got = draft(ids, hidden)
        want, want_logits = oracle(ids, hidden)
        assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
        assert torch.allclose(draft.logits(got), want_logits, atol=ATOL)


@pytest.mark.parametrize("variant", ["gqa", "llama3-rope"])
def test_cached_chunks_match_full_recompute(variant: str) -> None:
    """Prefill, a chunk, then single steps through the cache give the same outputs as one causal pass."""
    draft = _draft(**VARIANTS[variant])
    oracle = Oracle(draft)
    ids, feats = _inputs(2, 12)
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        want, _ = oracle(ids, hidden)
        cache = draft.new_cache(2, capacity=4)  # forces growth
        pieces = [draft(ids[:, a:b], hidden[:, a:b], cache) for a, b in [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12)]]
    got = torch.cat(pieces, dim=1)
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    assert cache.lengths.tolist() == [12, 12] and cache.capacity >= 12


def test_crop_discards_rejected_positions() -> None:
    """Entries written past a crop point never leak into later outputs, even before being overwritten."""
    draft = _draft()
    oracle = Oracle(draft)
    ids, feats = _inputs(1, 8)
    junk_ids, junk_feats = _inputs(1, 5, seed=7)
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        junk = draft.combine_aux(junk_feats)
        want, _ = oracle(ids, hidden)
        cache = draft.new_cache(1)
        first = draft(ids[:, :5], hidden[:, :5], cache)
        draft(junk_ids, junk, cache)  # speculative entries at positions 5..9
        cache.crop(5)
        second = draft(ids[:, 5:6], hidden[:, 5:6], cache)  # writes slot 5 only; slots 6..9 still hold junk
        third = draft(ids[:, 6:8], hidden[:, 6:8], cache)
    assert torch.allclose(torch.cat((first, second, third), 1), want, atol=ATOL)


def test_ragged_batch_rows_match_their_own_sequences() -> None:
    """Rows with different valid counts in one padded call match each row run alone."""
    draft = _draft()
    oracle = Oracle(draft)
    ids, feats = _inputs(2, 10)
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        cache = draft.new_cache(2)
        # Row 0 consumes 6 then 4 positions, row 1 consumes 3 then 7 (padding beyond its count).
        out1 = draft(torch.stack([ids[0, :6], torch.cat([ids[1, :3], ids[1, :3]])]),
                     torch.stack([hidden[0, :6], torch.cat([hidden[1, :3], hidden[1, :3]])]),
                     cache, num_valid=torch.tensor([6, 3]))
        assert cache.lengths.tolist() == [6, 3]
        out2 = draft(torch.stack([torch.cat([ids[0, 6:], ids[0, :3]]), ids[1, 3:]]),
                     torch.stack([torch.cat([hidden[0, 6:], hidden[0, :3]]), hidden[1, 3:]]),
                     cache, num_valid=torch.tensor([4, 7]))
        assert cache.lengths.tolist() == [10, 10]
        for row, (a, b) in enumerate([(6, 4), (3, 7)]):
            want, _ = oracle(ids[row : row + 1], hidden[row : row + 1])
            got = torch.cat((out1[row, :a], out2[row, :b]))
            assert torch.allclose(got, want[0], atol=ATOL), (row, (got - want[0]).abs().max())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_propose_matches_oracle_chain_and_keeps_only_verified_positions(k: int) -> None:
    draft = _draft(seed=3, draft_vocab=50)
    assert bool((draft.d2t != 0).any()), "the draft vocabulary must exercise non-zero d2t offsets"
    oracle = Oracle(draft)
    ids, feats = _inputs(1, 7, seed=4)
    aux = list(feats.split(32, dim=-1))
    cache = draft.new_cache(1)
    with torch.no_grad():
        got = draft.propose(aux, ids, cache, num_tokens=k)[0].tolist()
        want = oracle.chain(ids, feats, k)
        assert got == want
        assert cache.lengths.tolist() == [7] and cache.max_length == 7
        # A second round over two more verified positions continues from the same cache.
        ids2, feats2 = _inputs(1, 2, seed=5)
        got2 = draft.propose(list(feats2.split(32, dim=-1)), ids2, cache, num_tokens=k)[0].tolist()
        want2 = oracle.chain(torch.cat((ids, ids2), 1), torch.cat((feats, feats2), 1), k)
    assert got2 == want2
    assert all(0 <= t < 80 for t in got + got2)


def test_propose_ragged_batch_uses_each_rows_last_valid_position() -> None:
    draft = _draft(seed=5)
    oracle = Oracle(draft)
    ids, feats = _inputs(2, 6, seed=6)
    cache = draft.new_cache(2)
    with torch.no_grad():
        got = draft.propose(feats, ids, cache, num_tokens=3, num_valid=torch.tensor([6, 4])).tolist()
        assert got[0] == oracle.chain(ids[:1], feats[:1], 3)
        assert got[1] == oracle.chain(ids[1:, :4], feats[1:, :4], 3)
    assert cache.lengths.tolist() == [6, 4]


def test_bfloat16_keeps_rotary_frequencies_in_float32() -> None:
    draft = _draft().to(torch.bfloat16)
    assert draft.__dict__["_rotary"].inv_freq.dtype == torch.float32
    ids, feats = _inputs(1, 4)
    cache = draft.new_cache(1)
    assert cache.key.dtype == torch.bfloat16
    out = draft.propose(feats.to(torch.bfloat16), ids, cache, num_tokens=2)
    assert out.shape == (1, 2)


def test_crop_rejects_rolling_forward() -> None:
    draft = _draft()
    cache = draft.new_cache(2)
    ids, feats = _inputs(2, 3)
    with torch.no_grad():
        draft(ids, draft.combine_aux(feats), cache)
    with pytest.raises(ValueError, match="outside the cached lengths"):
        cache.crop(4)
    cache.crop([1, 3])
    assert cache.lengths.tolist() == [1, 3]


def test_missing_embedding_is_an_explicit_error() -> None:
    target = LlamaConfig(hidden_size=32, vocab_size=80, num_hidden_layers=6)
    draft = make_random_draft(target, with_embedding=False)
    ids, feats = _inputs(1, 2)
    with pytest.raises(RuntimeError, match="maybe_share_target_embed"):
        draft(ids, draft.combine_aux(feats))


@pytest.mark.timeout(120)
def test_target_aux_states_follow_the_input_index_convention(tmp_path) -> None:
    """Id L is what enters layer L; id N is the last layer's output before the final norm."""
    path = write_tiny_target(tmp_path / "t", "llama", num_layers=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    entering: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda _m, args, i=i: entering.__setitem__(i, args[0]))
             for i, layer in enumerate(model.model.layers)]
    last: list[torch.Tensor] = []
    hooks.append(model.model.layers[-1].register_forward_hook(lambda _m, _a, out: last.append(out)))
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        _, states = target_aux_states(model, ids, [0, 2, 4])
    for h in hooks:
        h.remove()
    assert torch.equal(states[0], entering[0]) and torch.equal(states[1], entering[2])
    out4 = last[0][0] if isinstance(last[0], tuple) else last[0]
    assert torch.equal(states[2], out4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("k", [1, 3])
def test_reference_loop_is_lossless_with_a_random_draft(tmp_path, k: int) -> None:
    path = write_tiny_target(tmp_path / "t", "qwen2", num_layers=5, seed=2)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = make_random_draft(target.config, num_aux=3, seed=9, draft_vocab_size=64)
    draft.embed_tokens = target.model.embed_tokens
    prompt = [5, 17, 2, 40, 33, 8]
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=14)[0, len(prompt):].tolist()
    got, steps = reference_speculative_generate(target, draft, (2, 3, 5), prompt, 14, k)
    assert got == want
    assert len(set(want)) > 3, "the tiny target should not emit a constant sequence"
    assert all(1 <= s <= k + 1 for s in steps) and sum(steps) + 1 >= 14


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt", ["A", "B"])
def test_agreeing_pair_reaches_full_acceptance(tmp_path, fmt: str) -> None:
    from pipespec.engine.draft_checkpoint.info import TargetInfo
    from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint

    tdir, ddir, perm = write_agreeing_pair(tmp_path / "t", tmp_path / "d", format=fmt)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    loaded = load_draft_checkpoint(ddir, TargetInfo.from_config(target.config), target_embed=target.model.embed_tokens)
    prompt = [7, 3, 11]
    k = 4
    got, steps = reference_speculative_generate(target, loaded.model, loaded.info.aux_layers, prompt, 21, k)
    expect = [perm[prompt[-1]]]
    while len(expect) < 21:
        expect.append(perm[expect[-1]])
    assert got == expect
    assert steps == [k + 1] * 4
