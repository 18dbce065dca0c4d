"""The demo's tokenizer: byte-level BPE trained with ``tokenizers`` on the training files, saved as a
``PreTrainedTokenizerFast`` (``AutoTokenizer.from_pretrained(target_dir)`` loads it), and the token stream.

Imports tokenizers / transformers lazily; nothing of pipespec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

EOS = "<|endoftext|>"


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE over the training texts, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, model_max_length=1 << 30)


def encode_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one token stream, documents separated by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)
