"""Speculation from a draft model (issue 36, 2b) and the engine's own speculators (2c).

A draft model is a second model handle beside the target's, on the engine thread: its sequences
are stepped for every drafting lane at once, rolled back to what the target accepted, and freed
with the lane's own sequence (`EngineStats.draft_live_sequences`), their KV published to the draft's
own prefix cache when the lane finished or paused (`EngineStats.draft_cached_tokens`, bounded by
`prefix_cache_mb`). Its vocabulary must be the target's (refused at open by name). The engine's
own speculators (MTP, EAGLE-3, DFlash, DSpark) are refused by name where the engine lacks them (the
reference engine does). All on the real reference engine with tiny models the suite builds; asyncio
and trio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from aiobasert import Engine, InvalidConfigError, ModelFileNotFoundError, UnsupportedError
from aiobasert._core.draft_model import RETRY_EVERY, DraftModel, DraftModelDrafter, MeasuredGain, best_depth
from aiobasert._core.speculate import SpecPolicy
from aiobasert._ffi import Library
from aiobasert.config import SpeculationConfig
from aiobasert.models.tiny import build_tiny_model
from aiobasert.testing import snapshot, wait_until

pytestmark = pytest.mark.anyio

PROMPT = "the cat sat on the mat and a b ab x yz"


LONG = 300
"""A long prompt's tokens (more than one prefill chunk of the default 256)."""


def draft(path: Path, **kw: Any) -> SpeculationConfig:
    return SpeculationConfig(method="draft", draft_model=str(path), adaptive=False, **kw)


async def long_prompt(engine: Engine) -> list[int]:
    ids = list(await engine.encode(PROMPT))
    return (ids * (LONG // len(ids) + 1))[:LONG]


def drafter_of(engine: Engine) -> DraftModelDrafter:
    d = engine._thread.drafter
    assert isinstance(d, DraftModelDrafter)
    return d


async def draft_counts(engine: Engine) -> tuple[int, int]:
    """Tokens fed to the draft model so far, and its steps (read on the engine thread)."""
    d = drafter_of(engine)
    return await engine._call(lambda: (d.fed, d.steps))


async def draft_kv(engine: Engine) -> tuple[int, int, int | None]:
    """The draft pool's blocks in use, those its prefix cache holds, and the cache's bound."""
    d = drafter_of(engine)
    used, cached = await engine._call(d.kv_blocks)
    return used, cached, d.model.bound


async def test_a_draft_with_the_targets_weights_is_accepted(tiny_model_path: Path) -> None:
    """The target drafting for itself (greedy): every draft is the token the target picks, so
    nearly all are accepted and the output comes in far fewer steps; the tokens are the plain ones."""
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate(PROMPT, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)
        plain_steps = (await plain.stats()).steps
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path, num_speculative_tokens=4)) as engine:
        got = await engine.generate(PROMPT, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)
        stats = await engine.stats()
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert got.finish_reason == want.finish_reason
    assert got.usage.draft_tokens >= 20
    assert got.usage.accepted_draft_tokens >= 0.9 * got.usage.draft_tokens  # the draft path is the one used
    assert stats.steps < plain_steps / 2
    assert stats.live_sequences == 0 and stats.draft_live_sequences == 0


async def test_a_draft_with_other_weights_gives_the_plain_output(
    tiny_model_path: Path, second_tiny_model_path: Path
) -> None:
    """Other random weights, the same vocabulary: few drafts accepted, the same tokens (greedy and
    seeded, several lanes at once)."""
    cases: list[dict[str, Any]] = [
        dict(max_tokens=30, ignore_eos=True),
        dict(max_tokens=30, ignore_eos=True, temperature=0.8, seed=5),
        dict(max_tokens=12, stop=["a"], logprobs=True),
    ]
    async with Engine.open(tiny_model_path, max_batch_size=4) as plain:
        want = [await plain.generate(f"{PROMPT} {i}", **c) for i, c in enumerate(cases)]
    async with Engine.open(tiny_model_path, max_batch_size=4, speculation=draft(second_tiny_model_path)) as engine:
        got: list[Any] = [None] * len(cases)

        async def one(i: int) -> None:
            got[i] = await engine.generate(f"{PROMPT} {i}", **cases[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(cases)):
                tg.start_soon(one, i)
        stats = await engine.stats()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs and g.finish_reason == w.finish_reason
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.draft_live_sequences == 0


async def test_a_draft_of_another_vocabulary_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "bytes.base", vocab="bytes")
    with pytest.raises(InvalidConfigError, match=r"speculation\.draft_model.*another vocabulary.*vocab_size"):
        await Engine.open(tiny_model_path, speculation=draft(other))
    extra = build_tiny_model(tmp_path / "extra.base", extra_tokens=[("<|extra|>", 3)])
    with pytest.raises(InvalidConfigError, match=r"speculation\.draft_model"):
        await Engine.open(tiny_model_path, speculation=draft(extra))


async def test_a_missing_draft_model_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match=r"speculation\.draft_model: .*missing\.base") as caught:
        await Engine.open(tiny_model_path, speculation=draft(tmp_path / "missing.base"))
    assert str(caught.value).count("baseRT_load_model_ex") == 1  # the engine's function named once


async def test_an_engine_that_cannot_verify_frees_its_draft_model(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `baseRT_batch_step_fused_logits_rows` the engine decodes plainly (the same tokens):
    the draft model it loaded is freed at open, not held for nothing."""
    has = Library.has
    rows = "baseRT_batch_step_fused_logits_rows"
    monkeypatch.setattr(Library, "has", lambda self, name: name != rows and has(self, name))
    freed: list[int] = []
    free = DraftModel.free
    monkeypatch.setattr(DraftModel, "free", lambda self: (freed.append(self.handle), free(self))[1])
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path)) as engine:
        assert engine._thread.drafter is None and freed
        out = await engine.generate(PROMPT, max_tokens=6)
    assert out.usage.draft_tokens == 0


async def test_cancel_mid_stream_frees_both_sequences(tiny_model_path: Path) -> None:
    """A stream cancelled while it drafts (its draft seeded from the draft's prefix cache): its
    sequence and its draft sequence are both freed, and the draft pool holds only the cache's
    blocks (within its bound): the cancelled lane's draft KV is not published."""
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path)) as engine:
        prompt = await long_prompt(engine)
        await engine.generate(prompt, max_tokens=4, ignore_eos=True)  # its draft KV goes to the cache
        _, cached_before, _ = await draft_kv(engine)
        stream = engine.stream(prompt, max_tokens=400, ignore_eos=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 12:
                snap = await snapshot(engine)
                assert snap.stats.live_sequences == 1 and snap.stats.draft_live_sequences == 1
                assert snap.stats.spec_draft_tokens > 0 and snap.stats.draft_cached_tokens > 0
                break
        await stream.aclose()
        snap = await wait_until(engine, lambda s: s.stats.live_sequences == 0, steps=50)
        assert snap.stats.draft_live_sequences == 0 and snap.stats.requests_cancelled == 1
        used, cached, bound = await draft_kv(engine)
    assert bound is not None and 0 < cached == cached_before <= bound
    assert used == cached  # no draft sequence holds a block


@pytest.mark.parametrize(("prefix_cache", "prefix_cache_mb"), [(True, None), (True, 0), (False, None)])
async def test_a_repeated_prompt_catches_up_on_the_draft_from_its_cache(
    tiny_model_path: Path, prefix_cache: bool, prefix_cache_mb: int | None
) -> None:
    """A long prompt served twice: the second request's draft sequence is seeded from the draft's
    own prefix cache (all the prompt's whole blocks but the last token's), so it feeds the draft
    model only the rest, in fewer draft steps; the tokens are the plain ones. Without a prefix
    cache, or with a bound of 0 (nothing kept once a request ends), it feeds the prompt again."""
    params = dict(max_tokens=16, ignore_eos=True)
    opts: dict[str, Any] = dict(prefix_cache=prefix_cache, prefix_cache_mb=prefix_cache_mb)
    async with Engine.open(tiny_model_path, **opts) as plain:
        prompt = await long_prompt(plain)
        want = await plain.generate(prompt, **params)
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path), **opts) as engine:
        first = await engine.generate(prompt, **params)
        fed1, steps1 = await draft_counts(engine)
        mid = await engine.stats()
        again = await engine.generate(prompt, **params)
        fed2, steps2 = await draft_counts(engine)
        stats = await engine.stats()
        used, cached, bound = await draft_kv(engine)
    assert first.token_ids == again.token_ids == want.token_ids
    assert first.usage.accepted_draft_tokens > 0 and again.usage.accepted_draft_tokens > 0
    assert mid.draft_cached_tokens == 0 and stats.draft_live_sequences == 0
    assert used == cached and (bound is None or cached <= bound)
    reused = stats.draft_cached_tokens
    if prefix_cache and prefix_cache_mb is None:
        assert reused == (LONG - 1) // 16 * 16  # every whole block of the prompt but the last token's
        # the second feeds the prompt's tail and its drafts (the first: the whole prompt and as many
        # drafts, the same tokens), and catches up in one draft step where the first took two
        assert fed2 - fed1 <= fed1 - reused + 8
        assert steps2 - steps1 < steps1
        assert cached > 0
    else:
        assert reused == 0 and cached == 0
        assert fed2 - fed1 >= fed1 - 16  # the prompt fed again


async def test_prefix_cache_with_a_draft_model(tiny_model_path: Path) -> None:
    """A prompt served again takes its prefix from the target's cache; the draft catches up from
    the lane's tokens. The plain output, drafts accepted, and no draft sequence left."""
    params = dict(max_tokens=24, ignore_eos=True)
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate(PROMPT, **params)
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path)) as engine:
        first = await engine.generate(PROMPT, **params)
        again = await engine.generate(PROMPT, **params)
        stats = await engine.stats()
    assert first.token_ids == again.token_ids == want.token_ids
    assert again.usage.cached_prompt_tokens > 0 and again.usage.accepted_draft_tokens > 0
    assert stats.live_sequences == 0 and stats.draft_live_sequences == 0


async def test_a_chats_next_turn_takes_its_history_from_the_draft_cache(tiny_model_path: Path) -> None:
    """A chat's second turn: its draft sequence starts from the draft's cache with at least the
    first turn's whole prompt (published with the reply when the first turn finished); the replies
    are the plain ones."""
    system = {"role": "system", "content": " ".join([PROMPT] * 5)}
    turn1: list[dict[str, str]] = [system, {"role": "user", "content": "tell me about the cat"}]
    params = dict(max_tokens=24, temperature=0)

    async def talk(engine: Engine) -> tuple[Any, Any, int]:
        first = await engine.chat(turn1, **params)
        before = (await engine.stats()).draft_cached_tokens
        history = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "and the mat?"}]
        second = await engine.chat(history, **params)
        return first, second, (await engine.stats()).draft_cached_tokens - before

    async with Engine.open(tiny_model_path) as plain:
        want1, want2, _ = await talk(plain)
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path)) as engine:
        got1, got2, reused = await talk(engine)
    assert (got1.token_ids, got2.token_ids) == (want1.token_ids, want2.token_ids)
    assert reused >= got1.usage.prompt_tokens // 16 * 16 > 0


async def test_a_full_draft_cache_never_costs_a_lane_its_drafts(tiny_model_path: Path) -> None:
    """A draft cache allowed the whole draft pool (`prefix_cache_mb` past it) and filled by earlier
    requests: two lanes then need most of the pool at once, and the engine evicts cached draft
    blocks to fit their steps. No draft step or sequence is refused, both lanes draft, the tokens
    are the plain ones, and at idle the draft pool holds only its cache."""
    opts: dict[str, Any] = dict(max_batch_size=2, max_context=96, prefix_cache_mb=1 << 20)
    params = dict(max_tokens=48, ignore_eos=True)
    async with Engine.open(tiny_model_path, **opts) as plain:
        ids = list(await plain.encode(PROMPT))
        fill = [[(t + i) % 200 for t in ids * 2] for i in range(6)]  # distinct 42-token prompts
        pair = [ids * 2, list(reversed(ids)) * 2]
        want = [await plain.generate(p, **params) for p in pair]
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path), **opts) as engine:
        for p in fill:
            await engine.generate(p, max_tokens=40, ignore_eos=True)
        _, full, bound = await draft_kv(engine)
        got: list[Any] = [None, None]

        async def one(i: int) -> None:
            got[i] = await engine.generate(pair[i], **params)

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
        used, cached, _ = await draft_kv(engine)
        d = drafter_of(engine)
        refused, live = await engine._call(lambda: (d.refused, d.live))
    # the cache held the pool but what two lanes of 90 tokens need (6 blocks of 16 each): they fit by eviction
    assert bound is not None and full > bound - 12
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.usage.accepted_draft_tokens > 0
    assert refused == 0 and live == 0
    assert used == cached <= bound


@pytest.mark.parametrize("prefix_cache", [True, False])
async def test_a_paused_lane_resumes_with_its_draft(tiny_model_path: Path, prefix_cache: bool) -> None:
    """One lane, a long request drafting in it, and newcomers that take it back (paused) one
    after the other: the long one resumes with the plain output; a paused lane's draft sequence
    is freed (the draft pool is the running lanes') and catches up when it runs again."""
    opts: dict[str, Any] = dict(max_batch_size=1, prefix_cache=prefix_cache, prefill_chunk=16)
    params = dict(max_tokens=120, ignore_eos=True, temperature=0.7, seed=3)
    async with Engine.open(tiny_model_path, **opts) as plain:
        want = await plain.generate(PROMPT, **params)
    async with Engine.open(tiny_model_path, speculation=draft(tiny_model_path), **opts) as engine:
        got: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def long() -> None:
                got.append(await engine.generate(PROMPT, **params))

            tg.start_soon(long)
            await wait_until(engine, lambda s: s.stats.draft_live_sequences == 1 and s.stats.spec_draft_tokens > 0)
            for _ in range(3):  # each newcomer takes the lane back
                await engine.generate("hi", max_tokens=3, temperature=0)
                while (await engine.stats()).waiting_requests:
                    await anyio.sleep(0.005)
        stats = await engine.stats()
        used, cached, bound = await draft_kv(engine)
    assert stats.requests_preempted >= 1
    assert got[0].token_ids == want.token_ids
    assert got[0].usage.accepted_draft_tokens > 0
    assert stats.live_sequences == 0 and stats.draft_live_sequences == 0
    # a paused lane's draft KV went to the draft's cache, and its resume took it from there
    assert (stats.draft_cached_tokens > 0) == prefix_cache
    assert used == cached and (bound is None or cached <= bound)


async def test_a_draft_with_a_shorter_window_stops_drafting_at_its_end(tiny_model_path: Path, tmp_path: Path) -> None:
    """A draft model whose context window (48) is shorter than the lanes the target runs (256): it
    drafts while a lane fits its window, then no more (as vLLM stops speculating past the draft's
    max_model_len). It was stepped every step past its window, each step failing after a catch-up
    feed from the start: the same tokens, at a draft prefill's cost a step."""
    window = 48
    short = build_tiny_model(tmp_path / "short.base", max_position_embeddings=window)  # the tiny model's weights
    opts: dict[str, Any] = dict(max_context=256, prefill_chunk=16)
    params = dict(max_tokens=150, ignore_eos=True)
    async with Engine.open(tiny_model_path, **opts) as plain:
        want = await plain.generate(PROMPT, **params)
    async with Engine.open(tiny_model_path, speculation=draft(short), **opts) as engine:
        got = await engine.generate(PROMPT, **params)
        drafter = engine._thread.drafter
        steps = getattr(drafter, "steps", None)
        stats = await engine.stats()
    assert got.token_ids == want.token_ids and len(got.token_ids) == 150
    assert got.usage.accepted_draft_tokens > 0  # it drafted inside its window
    assert steps is not None and steps < window, steps  # and was not run past it
    assert stats.live_sequences == 0 and stats.draft_live_sequences == 0


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash", "dspark"])
async def test_engine_speculators_are_refused_by_name_where_the_engine_lacks_them(
    tiny_model_path: Path, method: str
) -> None:
    """The reference engine has no MTP heads, EAGLE-3 or block drafters: asking for one is an
    error naming the method and what the engine lacks, never plain decoding in silence."""
    with pytest.raises(UnsupportedError, match=rf"speculation\.method='{method}'.*does not export"):
        await Engine.open(tiny_model_path, speculation=method)  # type: ignore[arg-type]


async def test_a_draft_model_path_may_be_a_path(tiny_model_path: Path) -> None:
    # as Engine.open takes the model's path: a pathlib.Path was refused as "must be a non-empty path"
    spec = SpeculationConfig(method="draft", draft_model=tiny_model_path)  # type: ignore[arg-type]
    assert spec == SpeculationConfig(method="draft", draft_model=str(tiny_model_path))
    async with Engine.open(tiny_model_path, speculation=spec) as engine:
        assert (await engine.generate(PROMPT, max_tokens=4)).usage.completion_tokens == 4
    with pytest.raises(InvalidConfigError, match=r"speculation\.draft_model must be a non-empty path"):
        SpeculationConfig(method="draft", draft_model=b"d.base")  # type: ignore[arg-type]


def test_draft_config_is_checked() -> None:
    with pytest.raises(InvalidConfigError, match=r"speculation\.draft_model is required"):
        SpeculationConfig(method="draft")
    with pytest.raises(InvalidConfigError, match=r"speculation\.draft_model.*method='draft'"):
        SpeculationConfig(draft_model="d.base")
    with pytest.raises(InvalidConfigError, match=r"speculation\.method"):
        SpeculationConfig(method="medusa")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # real weights: one backend is enough
async def test_smollm2_q4_drafts_for_its_f16_bundle(smollm2_path: Path, smollm2_f16_path: Path) -> None:
    """Real weights: the demo q4 bundle drafting for the f16 bundle of the same model gives the f16
    model's own greedy output, with most drafts accepted (the two differ only in rounding)."""
    prompt = "Explain why the sky is blue to a ten year old."
    async with Engine.open(smollm2_f16_path, max_batch_size=2) as plain:
        want = await plain.generate(prompt, max_tokens=48, ignore_eos=True)
    spec = SpeculationConfig(method="draft", draft_model=str(smollm2_path), adaptive=False)
    async with Engine.open(smollm2_f16_path, max_batch_size=2, speculation=spec) as engine:
        got = await engine.generate(prompt, max_tokens=48, ignore_eos=True)
        stats = await engine.stats()
    assert got.token_ids == want.token_ids
    assert got.usage.accepted_draft_tokens >= 0.5 * got.usage.draft_tokens > 0
    assert stats.draft_live_sequences == 0


def test_the_draft_length_pays_for_the_draft_models_steps() -> None:
    """The adaptive policy drafts only as far as the draft model's own steps pay: a draft as costly
    as the target (the target drafting for itself) is not run; a cheap one with a high acceptance
    drafts deep; a low acceptance drafts nothing."""
    assert best_depth([0.95], 4, 1.0) == 0
    assert best_depth([0.9], 4, 0.25) == 4
    assert 1 <= best_depth([0.7], 4, 0.4) < 4
    assert best_depth([0.2, 0.3], 4, 0.3) == 0
    assert best_depth([], 4, 0.1) == best_depth([0.9], 0, 0.1) == 0
    assert best_depth([0.9], 4, 0.25, fixed=0.0) > best_depth([0.9], 4, 0.25, fixed=2.0)  # a verify step's own cost


def test_drafting_measured_to_lose_stops_and_is_retried() -> None:
    """Whatever `best_depth` predicts, drafting whose steps made fewer tokens a second than plain
    steps (by the margin) stops; it is tried again every RETRY_EVERY asks, and measured anew."""
    gain = MeasuredGain()
    assert not gain.loses()  # nothing measured: the prediction stands
    for _ in range(5):
        gain.plain.add(1.0, 0.020)  # a lane's token every 20 ms
        gain.drafting.add(1.8, 0.040)  # 1.8 tokens in 40 ms: 0.9x
    assert gain.loses() and gain.vetoed == 1
    asked = [gain.loses() for _ in range(RETRY_EVERY - 1)]
    assert all(asked[:-1]) and not asked[-1]  # the retry
    for _ in range(3):
        gain.drafting.add(2.6, 0.040)  # the retry measures 1.3x: drafting pays again
    assert not gain.loses() and gain.vetoed == 0
    gain.drafting.add(1.05, 0.020)  # within the margin is not enough
    for _ in range(3):
        gain.drafting.add(1.05, 0.020)
    assert gain.loses()


def test_a_new_lane_starts_from_the_pooled_acceptance() -> None:
    """A new lane's prior is the engine's recent acceptance (a draft model of the target's weights
    is accepted on any prompt; a lane starting at a fixed 0.4 did not draft before it ended), kept
    within 0.05..0.95 so that its own drafts soon outweigh it."""
    policy = SpecPolicy()
    assert policy.new_lane().p == pytest.approx(0.4)
    for _ in range(50):
        policy.observe(4, False)
    good = policy.new_lane()
    assert good.p == pytest.approx(0.95)
    good.observe(0, True)
    good.observe(0, True)
    assert good.p < 0.5  # two misses of its own outweigh the prior
    for _ in range(200):
        policy.observe(0, True)
    assert policy.new_lane().p == pytest.approx(0.05)


async def test_the_row_policy_does_not_cut_a_draft_models_drafts(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model's drafts are as long as its own weighing says (`_weigh`: its steps and the verify
    rows counted): the row policy, which prices verify rows alone, is not asked again. It was, and at
    4 streams and up it dropped most drafts the draft model had spent its steps on."""
    monkeypatch.setattr(SpecPolicy, "ask", lambda *a, **k: False)
    monkeypatch.setattr(SpecPolicy, "depth", lambda *a, **k: 0)
    spec = draft(tiny_model_path, num_speculative_tokens=4)
    async with Engine.open(tiny_model_path, speculation=spec) as engine:
        got = await engine.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert got.usage.draft_tokens >= 20 and got.usage.accepted_draft_tokens >= 0.9 * got.usage.draft_tokens
