"""vLLM's offline API, as vLLM's documentation writes it: a script written for `vllm.LLM` runs on
minicb with only the import changed. Names, shapes and orders are checked here, on a tiny model
with a word-level tokenizer and chat template (float64, so the outputs are exact)."""

import pytest
import torch
from reference import add_word_tokenizer

from minicb import LLM, SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("vllm_api"), seed=11)
    return load_model(add_word_tokenizer(path), torch.float64)


def make(loaded, **config):
    return LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=256, **config)


def test_generate_returns_vllm_shaped_outputs(loaded):
    llm = make(loaded)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        ["w10 w11 w12", {"prompt_token_ids": [20, 21]}, {"prompt": "w30"}], params, use_tqdm=False
    )
    assert [type(o) for o in outs] == [RequestOutput] * 3
    first = outs[0]
    assert first.prompt == "w10 w11 w12" and first.prompt_token_ids == [10, 11, 12]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [20, 21]  # given as ids: no text
    assert outs[2].prompt == "w30"
    assert first.finished and first.prompt_logprobs is None
    (sample,) = first.outputs
    assert isinstance(sample, CompletionOutput) and sample.index == 0
    assert (
        len(sample.token_ids) == 5
        and sample.finish_reason == "length"
        and sample.stop_reason is None
    )
    assert sample.text == llm.get_tokenizer().decode(sample.token_ids, skip_special_tokens=True)
    assert sample.cumulative_logprob is None and sample.logprobs is None  # not requested
    m = first.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_enforce_eager_is_accepted_as_in_vllm(loaded):
    # one of vLLM's most common engine arguments: no CUDA graphs (minicb: use_cuda_graph=False)
    llm = make(loaded, enforce_eager=True)
    assert llm.engine.config.use_cuda_graph is False and llm.engine.config.enforce_eager is True
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eager = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    default = make(loaded).generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert eager == default  # float64: the same tokens


def test_outputs_are_snapshots(loaded):
    llm = make(loaded)
    seen = list(
        llm.stream([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    )
    # earlier outputs did not grow
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4]
    assert seen[0].metrics.finish_time is None and seen[-1].metrics.finish_time is not None
    assert [o.finished for o in seen] == [False, False, False, True]


def test_priority_lowest_value_first_as_in_vllm(loaded):
    # One slot, three requests submitted together with priorities 5, 0, 3: served 0, then 3, then 5.
    llm = make(loaded, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[4, 5], [6, 7], [8, 9]], params, use_tqdm=False, priority=[5, 0, 3])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert [[5, 0, 3][i] for i in order] == [0, 3, 5]


def test_priority_refused_unless_the_policy_uses_it(loaded):
    llm = make(loaded)  # scheduling_policy="fcfs", vLLM's default
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    assert not llm.engine.has_unfinished_requests()  # nothing was left behind


def test_chat_one_conversation_or_many(loaded):
    llm = make(loaded)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    conv = [{"role": "user", "content": "w40 w41"}]
    one = llm.chat(conv, params, use_tqdm=False)
    many = llm.chat(
        [conv, [{"role": "system", "content": "w50"}, {"role": "user", "content": "w51"}]],
        params,
        use_tqdm=False,
    )
    assert len(one) == 1 and len(many) == 2
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids
    expected = llm.get_tokenizer().apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert one[0].prompt_token_ids == list(expected)


def test_stop_reason_names_the_users_stop_token(loaded):
    llm = make(loaded)
    free = (
        llm.generate(
            [[9, 10, 11]],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = free[2]
    out = llm.generate(
        [[9, 10, 11]],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free[: free.index(stop) + 1]


def test_stop_strings_are_found_in_the_text_and_cut(loaded):
    # vLLM's semantics: the text ends before the stop string (or after it, with
    # include_stop_str_in_output), finish_reason is "stop", stop_reason is the string; the tokens
    # run to the one that completed it. A stop string may span tokens.
    from minicb.engine.detokenizer import text_delta

    llm = make(loaded)
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate([[9, 10, 11]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    k = next(i for i in range(2, len(words)) if words[i] not in words[:i])  # a word not seen before
    for stop, cut_at in (
        (words[k], k),
        (" ".join(words[k - 1 : k + 1]), k - 1),
    ):  # one token, then two
        out = llm.generate(
            [[9, 10, 11]], SamplingParams(**greedy, stop=[stop, "never-there"]), use_tqdm=False
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == free.text[: free.text.index(stop)] and stop not in out.text
        assert out.token_ids == free.token_ids[: k + 1]
        kept = llm.generate(
            [[9, 10, 11]],
            SamplingParams(**greedy, stop=stop, include_stop_str_in_output=True),
            use_tqdm=False,
        )[0].outputs[0]
        assert kept.text == free.text[: free.text.index(stop) + len(stop)]
        # Streamed, the text only ever grows into the final text: nothing shown (a piece of the stop
        # string, say) is taken back later.
        sent = ""
        for o in llm.stream([[9, 10, 11]], SamplingParams(**greedy, stop=stop)):
            assert out.text.startswith(o.outputs[0].text), (o.outputs[0].text, out.text)
            sent += text_delta(sent, o.outputs[0].text, o.finished)
        assert sent == out.text and cut_at >= 1


def test_min_tokens_defers_stop_strings_too(loaded):
    # vLLM looks for stop strings only once more than min_tokens tokens are out, as it forbids EOS.
    llm = make(loaded)
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate([[9, 10, 11]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    first = free.text.split()[0]
    early = llm.generate([[9, 10, 11]], SamplingParams(**greedy, stop=[first]), use_tqdm=False)[
        0
    ].outputs[0]
    assert early.text == "" and len(early.token_ids) == 1
    held = llm.generate(
        [[9, 10, 11]], SamplingParams(**greedy, stop=[first], min_tokens=3), use_tqdm=False
    )[0].outputs[0]
    later = [i for i, w in enumerate(free.text.split()) if w == first and i >= 3]
    assert (
        held.token_ids == free.token_ids[: later[0] + 1]
        if later
        else held.token_ids == free.token_ids
    )
    assert held.text.startswith(first)


def test_stop_strings_need_a_tokenizer(tmp_path):
    llm = LLM(str(save_tiny_model(tmp_path, seed=2)), dtype="float64", block_size=4, num_blocks=16)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
