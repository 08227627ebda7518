"""n > 1 in the engine: one prompt pass, choices forked onto shared prompt blocks.

What must hold: every choice's first token comes from the one prompt pass's logits; choice i
with a seed draws from seed + i, so it is the same sequence a request with n = 1 and that
seed gives; the choices share the prompt's full blocks (one more reference each) and copy
only its partly filled last block; an abort ends every choice and frees every block; a
prefill-only request hands one first token per choice to a decode engine, which forks there
and continues each as the colocated engine does.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

from engine.engine import LLMEngine
from engine.request import RequestOutput, choice_id
from engine.sampling import SamplingParams
from tests.test_engine import MakeEngine, greedy, make_engine, one_thread, rand_prompt, tiny

__all__ = ["make_engine", "one_thread", "tiny"]  # fixtures, used by name

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True, n=4)


def run(eng: LLMEngine, request_id: str) -> tuple[dict[int, list[int]], list[RequestOutput]]:
    """Step to the end; each choice's tokens by index, and the request's outputs."""
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs.extend(o for o in eng.step().outputs if o.request_id == request_id)
    tokens: dict[int, list[int]] = defaultdict(list)
    for o in outs:
        tokens[o.index].extend(o.new_token_ids)
    return dict(tokens), outs


def test_seeded_choices_are_distinct_reproducible_and_each_its_own_seed(
    make_engine: MakeEngine,
) -> None:
    prompt = rand_prompt(random.Random(3), 37)  # 37 = 2 full blocks of 16 and a partial one
    eng = make_engine()
    eng.add_request("a", prompt, SEEDED)
    first, outs = run(eng, "a")
    assert sorted(first) == [0, 1, 2, 3] and all(len(t) == 20 for t in first.values())
    assert len({tuple(t) for t in first.values()}) == 4, "choices should differ"
    assert [o.last for o in outs].count(True) == 1 and outs[-1].last
    eng.add_request("b", prompt, SEEDED)
    again, _ = run(eng, "b")
    assert again == first
    for i in range(4):  # choice i is the n = 1 request with seed + i
        [alone] = make_engine().generate([prompt], replace(SEEDED, n=1, seed=1234 + i))
        assert alone.output_token_ids == first[i]


def test_greedy_choices_are_identical_to_n1(make_engine: MakeEngine) -> None:
    prompt = rand_prompt(random.Random(4), 40)
    eng = make_engine()
    eng.add_request("g", prompt, greedy(max_tokens=12, n=4))
    tokens, _ = run(eng, "g")
    [alone] = make_engine().generate([prompt], greedy(max_tokens=12))
    assert all(t == alone.output_token_ids for t in tokens.values()) and len(tokens) == 4


def test_choices_share_full_prompt_blocks_and_copy_the_partial_one(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(block_size=16)
    prompt = rand_prompt(random.Random(5), 37)
    eng.add_request("s", prompt, SEEDED)
    res = eng.step()  # the prompt pass: one prefill step for the whole request
    assert res.phase == "prefill" and [o.index for o in res.outputs] == [0, 1, 2, 3]
    tables = [eng.blocks.block_table(choice_id("s", i)) for i in range(4)]
    assert all(t[:2] == tables[0][:2] for t in tables), "full blocks are shared"
    assert len({t[2] for t in tables}) == 4, "each choice writes its own last block"
    assert all(eng.blocks._ref[b] == 4 for b in tables[0][:2])
    eng.blocks.check_integrity()
    # the copies hold the prompt's K/V: the next step's logits equal n = 1's (greedy check)
    run(eng, "s")
    assert eng.blocks.num_used_blocks == 0


def test_abort_ends_every_choice_and_frees_every_block(make_engine: MakeEngine) -> None:
    eng = make_engine()
    eng.add_request("x", rand_prompt(random.Random(6), 30), replace(SEEDED, max_tokens=200))
    for _ in range(3):
        eng.step()
    assert len(eng.requests) == 4
    assert eng.abort("x")
    assert not eng.has_unfinished() and not eng.requests and not eng.groups
    assert eng.blocks.num_used_blocks == 0
    eng.blocks.check_integrity()


def test_a_fork_without_a_free_block_recomputes_and_gives_the_same_tokens(
    make_engine: MakeEngine,
) -> None:
    prompt = rand_prompt(random.Random(7), 37)  # 3 blocks of 16
    params = replace(SEEDED, max_tokens=5)
    roomy = make_engine(num_blocks=64)
    roomy.add_request("r", prompt, params)
    want, _ = run(roomy, "r")
    tight = make_engine(num_blocks=4)  # the prompt's 3 + one copy: the other two wait
    tight.add_request("t", prompt, params)
    got, _ = run(tight, "t")
    assert got == want
    assert tight.scheduler.num_preemptions >= 2


def test_prefill_only_hands_each_choice_on_and_decode_forks_there(
    make_engine: MakeEngine,
) -> None:
    prompt = rand_prompt(random.Random(8), 37)
    colocated = make_engine()
    colocated.add_request("c", prompt, SEEDED)
    want, _ = run(colocated, "c")

    pre, dec = make_engine(), make_engine()
    pre.add_request("p", prompt, SEEDED, prefill_only=True)
    firsts = pre.step().outputs
    assert [o.index for o in firsts] == [0, 1, 2, 3]
    assert all(o.finished and o.finish_reason is None for o in firsts)
    assert [o.last for o in firsts] == [False, False, False, True]
    assert len(pre.blocks.block_table("p")) == 3  # only choice 0 holds blocks, for the transfer
    req = dec.make_request("p", prompt, SEEDED)
    dst = dec.blocks.allocate("p", [], len(prompt) + 1).block_ids
    pre.cache.copy_blocks(pre.blocks.block_table("p"), dec.cache, list(dst[:3]))
    pre.release("p")
    heads = dec.add_prefilled(req, [o.new_token_ids[0] for o in firsts])
    assert [h.index for h in heads] == [0, 1, 2, 3]
    rest, _ = run(dec, "p")
    got = {i: [firsts[i].new_token_ids[0], *rest[i]] for i in range(4)}
    assert got == want


def test_prompt_logprobs_come_once_with_choice_0(make_engine: MakeEngine) -> None:
    eng = make_engine()
    prompt = rand_prompt(random.Random(9), 20)
    eng.add_request("p", prompt, replace(SEEDED, n=3, max_tokens=3, prompt_logprobs=2))
    _, outs = run(eng, "p")
    with_prompt = [o for o in outs if o.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    assert len(with_prompt[0].prompt_logprobs) == len(prompt)


def test_a_request_id_with_the_choice_separator_is_refused(make_engine: MakeEngine) -> None:
    import pytest

    from engine.sampling import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="request_id"):
        make_engine().add_request(choice_id("y", 1), [1, 2, 3], greedy())
