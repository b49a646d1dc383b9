"""What the examples share: a small causal LM from an HF config and random token data.

No download happens here, so the examples run anywhere (CI included). For a real run,
replace ``tiny_causal_lm()`` with ``AutoModelForCausalLM.from_pretrained(<checkpoint>)``
and ``random_tokens`` with your tokenized dataset.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

SEQ_LEN = 32
VOCAB = 128


def tiny_causal_lm() -> PreTrainedModel:
    # A real fine-tune: AutoModelForCausalLM.from_pretrained("gpt2") (or any causal LM).
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``count`` sequences of random token ids, as ``{"input_ids", "labels"}``."""

    def __init__(self, count: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
