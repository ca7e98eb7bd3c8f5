"""Multi-head latent attention (MLA, DeepSeek-V2, 2024; DeepSeek-V3): the cache holds one small
latent vector per token instead of K and V for every head.

Grouped-query attention shrinks the cache by sharing K/V heads. MLA compresses instead: each token's
hidden state is projected down to a latent c (kv_lora_rank values, 512 in DeepSeek-V3), normalized,
plus one rotary key k_rope (qk_rope_head_dim, 64) shared by every head. The cache stores only
[c, k_rope]: 576 values a token and layer, against 2 x 128 heads x 128 for DeepSeek-V3's 128 heads
under plain multi-head attention. Each head's keys and values come back from c by an up-projection
(kv_b_proj, with W_UK (qk_nope_head_dim x kv_lora_rank) and W_UV (v_head_dim x kv_lora_rank) per
head):

  k_h = [W_UK_h c, k_rope]      v_h = W_UV_h c      q_h = [q_nope_h, q_rope_h]

Two ways to attend, both here:

- expanded (the naive form; what a prefill does): up-project every cached latent of the sequence to
  each head's k_h and v_h, then ordinary attention. Cheap when many queries share the keys.
- absorbed (what decode does, in vLLM and FlashMLA): fold W_UK into the query and W_UV after the
  attention, since q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_rope and sum_t p_t v_h,t =
  W_UV_h (sum_t p_t c_t). The H heads then attend to the latent itself, as multi-query attention
  with one shared "head" of 576 values whose first 512 are also the value: decode reads only the
  latents, once, for all heads, never an expanded K or V.

The cache of an MLA layer is k_cache (blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim); its
v_cache holds nothing (width 0). DeepSeek lays the rotary dims out in interleaved pairs
(rope_interleave): they are de-interleaved for q and k alike, which leaves every q . k unchanged.
Not yet: tensor parallelism and an fp8 cache (both refused), DeepSeek-V3's MoE layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, decode_attention, pad_decode_queries, unpad_decode_outputs
from .hf_config import mla_spec_of


class MLAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rms_norm):
        super().__init__()
        spec = mla_spec_of(cfg)
        self.num_heads = cfg.num_attention_heads
        self.rank, self.rope_dim = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.nope_dim, self.v_dim = spec.qk_nope_head_dim, spec.v_head_dim
        q_dim = self.num_heads * (self.nope_dim + self.rope_dim)
        bias = bool(getattr(cfg, "attention_bias", False))
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        else:  # the query is compressed too (it is not cached: this only saves weights)
            self.q_a_proj = nn.Linear(cfg.hidden_size, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = rms_norm(spec.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = rms_norm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = spec.softmax_scale
        self.interleaved = spec.rope_interleave
        self.decode_form = "absorbed"  # or "expanded": the naive reference, for tests

    def query(self, x):
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, quant=None):
        from .model import apply_rope  # noqa: PLC0415 (model.py builds this module)

        n, heads = x.shape[0], self.num_heads
        q = self.query(x).view(n, heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # (n, rank)
        q_rope = apply_rope(self.deinterleave(q_rope), cos, sin)  # (n, heads, rope_dim)
        k_rope = apply_rope(self.deinterleave(k_rope)[:, None], cos, sin)[:, 0]  # (n, rope_dim)
        latent = torch.cat([c, k_rope], dim=-1)  # (n, rank + rope_dim): what the cache keeps
        k_cache.view(-1, 1, latent.shape[-1]).index_copy_(0, meta.cache_locs, latent[:, None])

        q = torch.cat([q_nope, q_rope], dim=-1)
        parts, nd = [], meta.num_decodes
        if nd:
            q_dec = pad_decode_queries(q[: meta.num_decode_tokens], meta)  # (nd, Q, heads, dq)
            tables, lens = meta.block_tables[:nd], meta.context_lens[:nd]
            if self.decode_form == "absorbed":
                out = self.absorbed(q_dec, k_cache, tables, lens)
            else:
                out = self.expanded(q_dec, gather_latents(k_cache, tables), lens)
            parts.append(unpad_decode_outputs(out, meta))
        for i in range(nd, meta.num_seqs):  # prefill chunks, one sequence at a time (eager only)
            start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
            length = meta.context_lens_host[i]
            blocks = meta.block_tables[i : i + 1, : -(-length // k_cache.shape[1])]
            latents = gather_latents(k_cache, blocks)[:, :length]  # (1, length, rank + rope)
            lens = meta.context_lens[i : i + 1]
            parts.append(self.expanded(q[None, start:end], latents, lens)[0])
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (n, heads, v_dim)
        return self.o_proj(out.reshape(n, heads * self.v_dim))

    def deinterleave(self, x):
        """(..., rope_dim) in DeepSeek's interleaved pairs -> the halves rotate_half expects."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def up_projections(self):
        """W_UK (heads, nope_dim, rank) and W_UV (heads, v_dim, rank): kv_b_proj's per-head rows."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w.split([self.nope_dim, self.v_dim], dim=1)

    def absorbed(self, q, k_cache, tables, lens):
        """q (B, Q, heads, nope + rope) -> (B, Q, heads, v_dim), reading the latents only: W_UK
        folded into the query, the latent cache attended as one key/value head (decode_attention's
        grouped path, with the cache as its own value: FlashMLA's trick), W_UV applied after."""
        w_uk, w_uv = self.up_projections()
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)  # (B, Q, heads, rank)
        q_abs = torch.cat([q_latent, q_rope], dim=-1)  # (B, Q, heads, rank + rope)
        out = decode_attention(q_abs, k_cache, k_cache, tables, lens, self.scale)
        return torch.einsum("bqhr,hvr->bqhv", out[..., : self.rank], w_uv)

    def expanded(self, q, latents, lens):
        """The naive form: every latent up-projected to each head's key and value, then attention.
        q (B, Q, heads, nope + rope), right-aligned as decode_attention's; latents (B, L, rank +
        rope) -> (B, Q, heads, v_dim)."""
        batch, num_queries, heads, _ = q.shape
        length = latents.shape[1]
        c, k_rope = latents.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(batch, length, heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
        offsets = torch.arange(num_queries - 1, -1, -1, device=q.device)  # Q - 1 - j
        q_pos = (lens[:, None] - 1 - offsets).clamp(min=0)  # (B, Q)
        allowed = torch.arange(length, device=q.device) <= q_pos[:, :, None]  # (B, Q, L)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=allowed[:, None],
            scale=self.scale,
        )  # (B, heads, Q, v_dim)
        return out.transpose(1, 2)


def gather_latents(k_cache, tables):
    """(B, W) block tables -> (B, W * block_size, rank + rope): each row's latents in order."""
    batch, width = tables.shape
    return k_cache.index_select(0, tables.reshape(-1)).view(batch, width * k_cache.shape[1], -1)
