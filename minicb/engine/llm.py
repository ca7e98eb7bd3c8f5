"""LLM: the offline front end, with vLLM's names (vLLM keeps it in vllm/entrypoints/llm.py).

`LLM(model, **EngineConfig fields)` builds an Engine; `generate()` adds every prompt and steps the
engine until all have finished; `chat()` renders conversations with the model's chat template
first; `stream()` (minicb's) yields each request's output as it grows. Everything here is the step
loop of engine.py called again and again.
"""

import copy
import time
from collections.abc import Iterator

from ..config import EngineConfig
from ..model_executor.loader import LoadedModel
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .llm_engine import Engine


def _with_output_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    """A copy that hands out outputs as `kind` says, checked once: it shares the lists, as
    SamplingParams.for_sample does (checking a 150k-entry logit_bias again took 0.13 s a prompt)."""
    if params.output_kind == kind:
        return params
    params = copy.copy(params)
    object.__setattr__(params, "output_kind", kind)
    return params


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation in the model's chat template, ending where the assistant
    replies."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template: pass prompts (text or token ids) instead"
        )
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


class LLM:
    """The offline front end, with vLLM's names: `LLM(model, **EngineConfig fields)`,
    `generate(prompts, sampling_params)`, `chat(messages, sampling_params)`, `get_tokenizer()`.
    A script written for `vllm.LLM` runs with only the import changed. minicb adds `stream()`,
    `engine` (the step loop, to look inside) and the configurations vLLM lacks (see
    EngineConfig)."""

    def __init__(self, model: str | None = None, **config_fields):
        self.engine = Engine(EngineConfig(model=model, **config_fields))

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **config_fields) -> "LLM":
        """An LLM over weights already loaded (to compare configurations without reloading).

        The model keeps the dtype it was loaded in unless `dtype=` says otherwise (and then the
        engine says that it converts it)."""
        llm = cls.__new__(cls)
        config_fields.setdefault("dtype", str(loaded.dtype).removeprefix("torch."))
        llm.engine = Engine(EngineConfig(model=loaded.name, **config_fields), loaded)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params, priority, user=None, kind=None) -> list[str]:
        prompts = _prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
                )
        else:
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if kind is not None:  # one copy per distinct params object, checked once (for_sample's way)
            own = [p for p in sampling_params if isinstance(p, SamplingParams)]
            copies = {id(p): _with_output_kind(p, kind) for p in own}  # (others: refused below)
            sampling_params = [copies.get(id(p), p) for p in sampling_params]
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        users = _user_list(user, len(prompts))
        ids = []
        try:
            for prompt, p, prio, u in zip(prompts, sampling_params, priority, users):
                ids.append(self.engine.add_request(prompt, p, prio, user=u))
        except ValueError as e:  # all or nothing: a bad prompt leaves nothing behind
            for rid in ids:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        return ids

    def generate(
        self,
        prompts,
        sampling_params=None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        user: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in input order.

        prompts: a string, a list of token ids, {"prompt": text} or {"prompt_token_ids": ids}, or a
        list of those. sampling_params: one for all prompts, or a list with one per prompt.
        priority: one int per prompt, the lowest served first (needs
        scheduling_policy="priority"). user: the tenant (OpenAI's field), one for all prompts or a
        list with one per prompt; scheduling_policy="vtc" serves tenants fairly, the other policies
        ignore it."""
        # vLLM's LLM.generate: each request's last output only, no snapshot of it while it runs
        final = RequestOutputKind.FINAL_ONLY
        ids = self._add_all(prompts, sampling_params, priority, user, final)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        t0, num_tokens = time.perf_counter(), 0
        try:
            wanted = set(ids)  # an output of a request added elsewhere (or aborted) is not ours
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        num_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(
                        f"{num_tokens / (time.perf_counter() - t0):.1f} tok/s", refresh=False
                    )
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # interrupted (e.g. Ctrl-C): do not leave requests holding blocks
                if rid not in results:
                    self.engine.abort_request(rid)
            self.engine.drain()  # async scheduling: the extra rows of requests that just finished
        return [results[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to a list of them,
        each rendered by the model's chat template. Returns one RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [chat_token_ids(tokenizer, conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's: the beam_width best continuations of each prompt, one BeamSearchOutput per prompt
        in input order, its sequences best first. The beams are rows of the continuous batch that
        fork and share their blocks (engine/beam_search.py, which also says how beams are ranked).

        prompts: as generate() takes them."""
        search = BeamSearch(self.engine, params)
        prompts = _prompt_list(prompts)
        bar = None
        try:
            for i, prompt in enumerate(prompts):
                try:
                    search.add(prompt)
                except ValueError as e:  # all or nothing, as generate()
                    raise ValueError(f"prompt {i}: {e}") from None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(prompts), desc="beam search", unit="prompt")
            while not search.finished:
                self.engine.step()
                search.update()
                if bar is not None:
                    bar.update(sum(inst.finished for inst in search.instances) - bar.n)
        finally:
            if bar is not None:
                bar.close()
            search.abort()  # interrupted (e.g. Ctrl-C): no row left holding blocks
            self.engine.drain()
        return [search.output(inst) for inst in search.instances]

    def stream(
        self, prompts, sampling_params=None, priority=None, user=None
    ) -> Iterator[RequestOutput]:
        """minicb: yield a RequestOutput each time a request gets a token (`.finished` on its
        last). priority and user: as generate() takes them."""
        ids = set(self._add_all(prompts, sampling_params, priority, user))
        remaining = set(ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.request_id in ids:
                        if out.finished:
                            remaining.discard(out.request_id)
                        yield out
        finally:
            for rid in remaining:
                self.engine.abort_request(rid)
            self.engine.drain()


def _user_list(user, num_prompts: int) -> list:
    """The tenant of each prompt: one name (or None) for all, or a list with one per prompt."""
    if user is None or isinstance(user, str):
        return [user] * num_prompts
    users = list(user)
    if len(users) != num_prompts:
        raise ValueError(f"got {len(users)} users for {num_prompts} prompts")
    bad = [u for u in users if u is not None and not isinstance(u, str)]
    if bad:
        raise ValueError(f"user must be a str or None (the tenant's name), got {bad[0]!r}")
    return users


def _prompt_list(prompts) -> list:
    """Prompts as a list of text or token ids: one prompt given bare, or vLLM's prompt dicts."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt given bare
    return [_prompt_of(p) for p in prompts]


def _prompt_of(prompt):
    """A prompt as text or token ids; vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts
    too."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(
            f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        )
    return prompt
