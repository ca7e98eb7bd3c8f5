"""Shared test helpers: the reference every parity test compares with (transformers' greedy
generate, each prompt alone), and a word-level tokenizer with a chat template for tiny models."""

import torch


def greedy_reference(hf_model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Exactly max_tokens[i] greedy tokens for prompts[i] (EOS ignored), no batching, no padding."""
    refs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens):
            out = hf_model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


def add_word_tokenizer(path):
    """Give a tiny model a tokenizer: words "w3".."w127" are token ids 3..127, plus a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "system", "user", "assistant"] + [
        f"w{i}" for i in range(6, 128)
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant{% endif %}"
    )
    fast.save_pretrained(path)
    return path


def byte_model(path):
    """A tiny float64 Llama over bytes (ids 0..255, EOS 256) with a byte tokenizer: text prompts,
    stop strings and grammars on a model small enough for exact tests."""
    from minicb.model_executor.loader import load_model
    from minicb.model_executor.tiny_models import save_byte_tokenizer, save_tiny_model

    save_tiny_model(path, vocab_size=264, eos_token_id=256, seed=5)
    save_byte_tokenizer(path)
    return load_model(path, dtype=torch.float64)
