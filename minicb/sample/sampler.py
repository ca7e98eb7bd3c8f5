"""Sampler: turn one row of logits per request into one token id per request.

Every decoding strategy here is a reshaping of the next-token distribution
followed by a single draw:

- temperature T: sample from softmax(logits / T). T < 1 sharpens the
  distribution, T > 1 flattens it, and T == 0 is the limit case, greedy
  decoding: always the argmax (ties go to the lowest token id).
- top-k (Fan et al., 2018, "Hierarchical Neural Story Generation"): keep only
  the k most likely tokens; 0 turns it off.
- top-p, nucleus sampling (Holtzman et al., 2019, "The Curious Case of Neural
  Text Degeneration"): after top-k, keep the smallest set of most likely
  tokens whose probabilities add up to at least top_p (the top token is always
  kept); 1.0 turns it off.
  The kept tokens' probabilities are renormalized and one token is drawn.

- min-p (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling"): after
  temperature, drop the tokens whose probability is below min_p times the top
  token's; applied before top-k and top-p, as vLLM does.

Before any of that, the logits processors of penalties.py (min_tokens, logit_bias,
penalties) may have changed the logits; greedy decoding takes the argmax of
what it is given.

The draw uses the exponential race (the Gumbel-max trick in another form):
if E_i ~ Exp(1) independently, argmax_i p_i / E_i is distributed exactly as p.
It needs no cumulative sum and no sort, and the randomness is one plain tensor
of `vocab` numbers per row, which is what makes seeding easy.

Seeds and batching: a request with a seed owns a torch.Generator for its whole
life (made by `generator_for`, kept by the engine on the request). Each step
it is sampled, its row draws exactly `vocab` numbers from that generator, and
the noise is laid out in vocabulary order, so the tokens a seeded request gets
depend only on its logits and its seed, never on which other requests share
the batch, their order, or their settings. Requests without a seed share the
sampler's generator and draw their noise in one batched call.
"""

import torch
from torch import Tensor

from ..model_executor.attention import to_device


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed  # seeds the shared generator used by rows without a seed
        self._shared: dict[torch.device, torch.Generator] = {}  # one per device, made lazily

    def __repr__(self) -> str:
        return f"Sampler(seed={self.seed})"

    def generator_for(self, seed: int | None, device) -> torch.Generator | None:
        """A fresh generator for one request's whole life; None for an unseeded request."""
        if seed is None:
            return None
        return torch.Generator(device=torch.device(device)).manual_seed(seed)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def __call__(self, logits: Tensor, params: list, generators: list) -> Tensor:
        """logits (n, vocab), one params object and one generator (or None) per row -> (n,)
        int64."""
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"logits has {n} rows but got {len(params)} params and {len(generators)} generators"
            )
        greedy = logits.argmax(dim=-1)  # (n,)
        rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if not rows:  # the common all-greedy batch: one argmax, done
            return greedy

        row_index = to_device(rows, logits.device)
        probs = self.probabilities(logits[row_index], [params[i] for i in rows])  # (m, vocab)
        noise = self.exponential_noise(probs, [generators[i] for i in rows])
        tokens = greedy.clone()
        tokens[row_index] = (probs / noise).argmax(dim=-1)
        return tokens

    def probabilities(self, logits: Tensor, params: list) -> Tensor:
        """The distribution each row draws from: (m, vocab) logits of sampled rows (temperature > 0)
        -> (m, vocab) probabilities after temperature, min-p, top-k and top-p; a truncated token has
        probability 0."""
        # Scale in float32 at least (bf16/fp16 lose too much), float64 stays float64.
        dtype = torch.promote_types(logits.dtype, torch.float32)
        temperature = to_device([p.temperature for p in params], logits.device, dtype)
        # Subtract each row's max first: the top token sits at exactly 0 and a tiny temperature
        # sends the others to -inf, never to inf - inf = NaN (the clamp: 1e-50 is 0 in float32).
        logits = logits.to(dtype)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        scaled = logits / temperature.clamp(min=torch.finfo(dtype).tiny)[:, None]
        if any(p.min_p > 0 for p in params):
            scaled = self._apply_min_p(scaled, params)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = self._apply_top_k_top_p(scaled, params)
        return torch.softmax(scaled, dim=-1)

    def _apply_min_p(self, scaled: Tensor, params: list) -> Tensor:
        """Set to -inf the tokens whose probability is below min_p times the row's top
        probability."""
        # (m,)
        min_p = to_device([p.min_p for p in params], scaled.device, scaled.dtype)
        probs = torch.softmax(scaled, dim=-1)  # (m, vocab)
        too_unlikely = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        return scaled.masked_fill(too_unlikely, float("-inf"))  # the top token always survives

    def _apply_top_k_top_p(self, scaled: Tensor, params: list) -> Tensor:
        """Set the logits of tokens outside each row's top-k / top-p set to -inf (one sort)."""
        m, vocab = scaled.shape
        device = scaled.device
        top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], device)
        top_p = to_device([p.top_p for p in params], device, scaled.dtype)

        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # (m, vocab)
        rank = torch.arange(vocab, device=device)
        keep = rank[None, :] < top_k[:, None]  # top-k: the first k ranks

        # top-p on the distribution that top-k left, renormalized. A token is kept when
        # the probability of the tokens ranked above it is still below top_p, i.e. it
        # is needed to reach top_p. top_p == 1.0 keeps everything exactly (rounding in
        # the cumulative sum must not drop tail tokens).
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs  # (m, vocab)
        keep &= (mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep[:, 0] = True  # the most likely token always survives

        # Back from rank order to vocabulary order, so noise lines up with token ids.
        keep_by_token = torch.empty_like(keep).scatter_(-1, sorted_ids, keep)
        return scaled.masked_fill(~keep_by_token, float("-inf"))

    def exponential_noise(self, probs: Tensor, generators: list) -> Tensor:
        """Exp(1) noise (m, vocab): seeded rows from their own generator, the rest in one call."""
        uniform = torch.empty_like(probs)  # (m, vocab)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            shared = self.shared_generator(probs.device)
            index = to_device(unseeded, probs.device)
            uniform[index] = torch.rand(
                len(unseeded),
                probs.shape[1],
                dtype=probs.dtype,
                device=probs.device,
                generator=shared,
            )
        for i, g in enumerate(generators):
            if g is not None:
                uniform[i].uniform_(generator=g)  # exactly `vocab` draws from this request's stream
        # Inverse CDF: U ~ Uniform[0, 1) gives -log(1 - U) ~ Exp(1) (and is ~5x faster on CPU
        # than Tensor.exponential_). U == 0 gives 0; the clamp keeps a truncated token's
        # probs / noise at 0 / tiny = 0 instead of 0 / 0 = NaN, which argmax would pick.
        return torch.log1p(-uniform).neg_().clamp_(min=torch.finfo(probs.dtype).tiny)
