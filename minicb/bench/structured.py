"""What a structured-outputs mask costs per step (issue 33): the CPU time to fill one bitmask row
per constrained request, and to apply the masks to the step's logits, at 1, 16 and 64 rows.

    python -m minicb.bench.structured [--rows 1,16,64] [--steps 40]

The embedded SmolLM2-135M's tokenizer (49,152 tokens), a JSON schema, and each row's matcher walked
along a real JSON document so that the masks are those of a decode in the middle of an object, not
of its first token. Prints both sides beside a decode step's time measured on the same machine, so
the share is read from one run (name the CPU with the figures: they differ between machines).
"""

import argparse
import time

import torch

from ..sampling_params import SamplingParams, StructuredOutputsParams
from .machine import cpu_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "poetry"]}'


def main(argv=None) -> None:
    from ..config import EngineConfig  # noqa: PLC0415
    from ..engine.llm_engine import Engine  # noqa: PLC0415
    from ..structured_output import StructuredOutputManager  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(max_model_len=512, max_num_seqs=8))
    tok, vocab = engine.tokenizer, engine.vocab_size
    manager = StructuredOutputManager(tok, vocab, engine.eos_token_ids)
    doc = tok.encode(DOCUMENT, add_special_tokens=False)
    decode = measure_decode(engine)
    print(
        f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"vocabulary {vocab}; a decode step of 1 row: {decode * 1e3:.1f} ms"
    )
    print(f"{'rows':>5} {'fill ms/step':>13} {'apply ms/step':>14} {'mask / 1-row step':>19}")
    so = StructuredOutputsParams(json=SCHEMA)
    for n in (int(x) for x in args.rows.split(",")):
        fill, apply = mask_cost(manager, so, doc, n, args.steps)
        print(f"{n:>5} {fill * 1e3:>13.3f} {apply * 1e3:>14.3f} {(fill + apply) / decode:>18.1%}")


def mask_cost(manager, so, document: list[int], rows: int, steps: int) -> tuple[float, float]:
    """(seconds to fill `rows` mask rows, seconds to apply them to a step's logits), per step:
    every row's matcher walks `document` (a text that follows `so`), so that the masks are those of
    a decode in the middle of it, not of its first token."""
    from ..structured_output import apply_token_bitmask, bitmask_words  # noqa: PLC0415

    grammars = [manager.new_grammar(so) for _ in range(rows)]  # one compile, then copies
    bitmask = torch.empty(rows, bitmask_words(manager.vocab_size), dtype=torch.int32)
    logits = torch.randn(rows, manager.vocab_size)
    fill = apply = 0.0
    for step in range(steps):
        at = step % (len(document) - 1)
        for g in grammars:
            if at == 0:
                g.matcher.reset()
            g.accept(document[at])
        t0 = time.perf_counter()
        for i, g in enumerate(grammars):
            g.fill_bitmask(bitmask, i)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, list(range(rows)))
        t2 = time.perf_counter()
        fill, apply = fill + t1 - t0, apply + t2 - t1
    return fill / steps, apply / steps


def measure_decode(engine) -> float:
    """Seconds of the fastest of 20 decode steps of one request (the engine's own trace)."""
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return min(s.duration for s in engine.trace.steps[1:])


if __name__ == "__main__":
    main()
