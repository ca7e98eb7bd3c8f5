"""Multi-head latent attention (model_executor/mla.py): the absorbed decode against the naive
expand-then-attend form, the cache of one latent per token, and its sizes for real configs. The
DeepSeek-V3-shaped tiny model's parity with transformers runs in test_parity.py and
test_cuda_graph.py with the other families."""

import pytest
import torch
import transformers

from minicb import LLM, SamplingParams
from minicb.model_executor.hf_config import kv_bytes_per_token
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.model_executor.mla import MLAttention, gather_latents
from minicb.model_executor.model import RMSNorm
from minicb.model_executor.tiny_models import tiny_config
from minicb.worker.kv_cache import KVCache


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("mla"), arch="deepseek_v3", seed=2)
    return load_model(path, dtype=torch.float64)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_the_absorbed_form_equals_the_expanded_one(num_queries):
    """W_UK folded into the query and W_UV after the attention give each head's output of the naive
    form, which expands every latent to per-head keys and values: equal to float64 rounding, with
    rows of different lengths and right-aligned queries (a decode, or a row verifying drafts)."""
    cfg = tiny_config("deepseek_v3")
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0, RMSNorm).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block_size, width = 4, 5
    k_cache = torch.randn(12, block_size, 1, 32 + 16, dtype=torch.float64)
    tables = torch.tensor([[3, 7, 1, 0, 0], [2, 9, 4, 5, 11], [6, 0, 0, 0, 0]])
    lens = torch.tensor([10, 19, 3])
    q = torch.randn(3, num_queries, cfg.num_attention_heads, 16 + 16, dtype=torch.float64)
    absorbed = attn.absorbed(q, k_cache, tables, lens)
    expanded = attn.expanded(q, gather_latents(k_cache, tables), lens)
    assert absorbed.shape == (3, num_queries, cfg.num_attention_heads, 24)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-12, atol=1e-12)
    assert gather_latents(k_cache, tables).shape == (3, width * block_size, 48)


def test_an_engine_decoding_in_the_expanded_form_gives_the_same_tokens(loaded):
    prompts, params = [[5, 6, 7, 8, 9], [3, 4], list(range(10, 40))], None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for form in ("absorbed", "expanded"):
        llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
        for layer in llm.engine.runner.model.layers:
            layer.self_attn.decode_form = form
        tokens[form] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert tokens["absorbed"] == tokens["expanded"]


def test_the_cache_holds_one_latent_per_token(loaded):
    kv = KVCache(loaded.hf_config, num_blocks=8, block_size=4, dtype=torch.float64, device="cpu")
    assert kv.k.shape == (2, 9, 4, 1, 32 + 16) and kv.v.shape == (2, 9, 4, 1, 0)
    assert kv.num_bytes == 2 * 9 * 4 * 48 * 8
    assert kv_bytes_per_token(loaded.hf_config, torch.float64) == 2 * 48 * 8


def test_deepseek_v3_caches_70_kb_a_token_against_320_for_llama_70b():
    """The issue's numbers, from the published configs in bf16: DeepSeek-V3's 61 layers of a
    512-value latent and a 64-value rotary key, against Llama 3.1 70B's 80 layers of 8 K and 8 V
    heads of 128."""
    deepseek = transformers.DeepseekV3Config()  # its defaults are DeepSeek-V3's published config
    assert (deepseek.num_hidden_layers, deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == (
        61,
        512,
        64,
    )
    assert kv_bytes_per_token(deepseek, torch.bfloat16) == 61 * 576 * 2 == 70_272
    llama = transformers.LlamaConfig(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
    )
    assert kv_bytes_per_token(llama, torch.bfloat16) == 2 * 80 * 8 * 128 * 2 == 327_680


def test_what_latent_attention_does_not_run_yet_is_refused(tmp_path, loaded):
    with pytest.raises(ValueError, match="fp8"):
        LLM.from_loaded(loaded, dtype="float64", kv_cache_dtype="fp8", num_blocks=8)
    with pytest.raises(ValueError, match="latent attention"):
        LLM.from_loaded(loaded, dtype="float64", tensor_parallel_size=2, num_blocks=8)
    make_tiny_model("deepseek_v3")  # the reference builds
