"""The token bitmask: which tokens a constrained row may sample next, 32 tokens per int32 word.

Bit j of word w says whether token 32 * w + j is allowed (1) or not (0), the layout llguidance and
xgrammar both write. Applying it is one masked fill per step over the constrained rows only.
"""

import numpy as np
import torch

from ..model_executor.attention import to_device


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row: one bit per token, rounded up to whole words."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask (CPU) -> (rows, vocab_size) bool: True where a token is allowed.
    numpy unpacks the bits in one C loop (bit j of byte k is token 8k + j, little-endian), about
    ten times faster on a CPU than shifting every word 32 times with torch."""
    as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # (rows, 4 * words)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]):
    """Logits with the tokens that row rows[i]'s bitmask (bitmask[i]) forbids set to -inf.

    logits: (n, vocab); bitmask: (len(rows), words) int32 on the CPU. The other rows are returned
    exactly as they were (the tensor itself when `rows` is empty)."""
    if not rows:
        return logits
    index = to_device(rows, logits.device)
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked
