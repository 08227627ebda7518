"""`make demo`: what the engine does for a few prompts, on the embedded default (tiny model)."""

from __future__ import annotations

import time

from engine.sampling import SamplingParams
from pdserve.cli import load_engine

PROMPTS = (
    "The prefill worker reads the whole prompt at once, and the decode worker",
    "The prefill worker reads the whole prompt at once, and then the router",
    "Hello, world",
)


def main() -> None:
    t0 = time.perf_counter()
    engine = load_engine("tiny", "auto")
    print(
        f"pdserve demo: loaded the tiny preset in {time.perf_counter() - t0:.2f} s "
        f"({engine.model_config.num_params() / 1e6:.2f}M params, "
        f"{engine.cache_config.num_blocks} KV blocks of {engine.cache_config.block_size})"
    )
    assert engine.tokenizer is not None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        t = time.perf_counter()
        (req,) = engine.generate([ids], params)
        total = time.perf_counter() - t
        ttft = (req.first_token_s or t) - req.arrival_s
        reason = req.finish_reason.value if req.finish_reason else None
        per_tok = (total - ttft) / max(len(req.output_token_ids) - 1, 1)
        print(
            f"\nprompt ({len(ids)} tokens, {req.num_cached_tokens} from the prefix cache): "
            f"{prompt!r}\n  output: {req.text!r}\n  TTFT {ttft * 1e3:.1f} ms, "
            f"{per_tok * 1e3:.2f} ms/token, finish={reason}"
        )
    engine.blocks.check_integrity()
    print(
        f"\nKV blocks: {engine.blocks.num_used_blocks} used, "
        f"{engine.blocks.num_cached_blocks} cached for reuse, "
        f"{engine.blocks.num_free_blocks} free or evictable (integrity holds)"
    )


if __name__ == "__main__":
    main()
