"""What every GPU benchmark needs: a CUDA device (or a clear error), a model built from a named
config with random weights (no hub: throughput does not depend on the weights' values), a decode
step built by hand, and the GPU's memory given back between two engines. Used by w2.py and
gpu_step.py."""

import gc

import torch

from ..core.request import Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..model_executor.loader import LoadedModel, load_model
from ..sampling_params import SamplingParams

W2_MODEL = "random:qwen3-0.6b"  # W2's model: Qwen3-0.6B's config, random weights
# Named configs for random-weight models (the field values of the published config.json files).
RANDOM_CONFIGS = {
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    # A dense model whose prefill costs more per byte of KV cache (the CPU tier's bench, issue 39):
    # 8.2B parameters, 144 KiB of K/V a token in bf16
    "qwen3-8b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    # A mixture of experts (issue 36's GPU bench): 30.5B parameters, 3.3B active per token, 61 GB in
    # bf16, so one 80 GB GPU holds it with about 10 GB left for the KV cache
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
}


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU"
        )


def random_model(name: str, dtype: torch.dtype, hf_model: bool = False):
    """A LoadedModel of a named config with random weights (or the transformers model itself)."""
    import transformers

    key = name.removeprefix("random:")
    if key not in RANDOM_CONFIGS:
        raise ValueError(
            f"unknown random model {name!r}; known: "
            f"{', '.join('random:' + k for k in RANDOM_CONFIGS)}"
        )
    class_name, fields = RANDOM_CONFIGS[key]
    config = getattr(transformers, class_name)(**fields)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    with torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    ):  # initializing on the GPU takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if hf_model:
        return model
    tied = config.tie_word_embeddings  # then the LM head is the embedding, loaded once
    state = {
        k: v.detach().cpu()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    del model
    return LoadedModel(
        name=name,
        hf_config=config,
        state_dict=state,
        tokenizer=None,
        eos_token_ids=frozenset(),
        max_model_len=config.max_position_embeddings,
        vocab_size=config.vocab_size,
    )


def _load(model_path, loaded, dtype: str):
    if loaded is not None:
        return loaded
    model_path = model_path or W2_MODEL
    if model_path.startswith("random:"):
        return random_model(model_path, getattr(torch, dtype))
    return load_model(model_path, getattr(torch, dtype))


def free_gpu() -> None:
    """Return what deleted engines held, so that the next engine measures the same free memory."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _decode_batch(
    batch_size: int, context_len: int, block_size: int, vocab_size: int
) -> SchedulerOutput:
    """A synthetic decode step: row i feeds token context_len - 1 over its own blocks."""
    blocks_per_row = -(-context_len // block_size)
    rows = []
    for i in range(batch_size):
        req = Request(
            f"b{i}",
            [(7 * i + j) % vocab_size for j in range(context_len)],
            SamplingParams(max_tokens=1, temperature=0.0),
        )
        table = list(range(i * blocks_per_row, (i + 1) * blocks_per_row))
        rows.append(
            ScheduledRequest(
                req,
                start=context_len - 1,
                num_tokens=1,
                is_prefill=False,
                do_sample=True,
                block_table=table,
                slot=i,
            )
        )
    return SchedulerOutput(step=1, scheduled=rows, num_batched_tokens=batch_size)
