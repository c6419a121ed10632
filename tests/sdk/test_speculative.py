"""Speculative decoding (issue 36): drafts verified inside the fused step give token for token
the output of plain decoding, whatever the drafts are, and n-gram drafts are really accepted.

Each comparison runs the same requests on an engine without speculation and on engines that
speculate with (a) prompt lookup, verifying every proposal at full length, (b) an oracle that
proposes the reference continuation with random corruption (long accepted runs through stop
strings, stop ids and max_tokens, then a rejection), (c) a drafter proposing garbage (ids out
of the vocabulary included), (d) a draft model: the target's own weights (nearly every greedy
draft accepted) or other random weights with the same vocabulary (few accepted), each request run
twice (the second from the draft's prefix cache). All on the real reference engine; asyncio and
trio."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiobasert import Engine, InvalidConfigError, SamplingParams
from aiobasert._core.draft_model import DraftModelDrafter
from aiobasert._core.speculate import Drafter, DraftSource, LaneSpec, NgramDrafter, SpecPolicy, StepCost
from aiobasert.config import EngineConfig, SpeculationConfig

pytestmark = pytest.mark.anyio

BOUND = 60.0
FULL = SpeculationConfig(adaptive=False, num_speculative_tokens=5)


class Garbage(Drafter):
    """Proposes random ids, some outside the vocabulary: every one must cost speed only."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, lane: DraftSource, k: int) -> list[int]:
        return [self.rng.randrange(-2, self.vocab + 3) for _ in range(self.rng.randrange(0, k + 1))]


class Oracle(Drafter):
    """Proposes the reference continuation of the lane's prompt, corrupted at a random depth."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], seed: int) -> None:
        self.reference = reference
        self.rng = random.Random(seed)

    def propose(self, lane: DraftSource, k: int) -> list[int]:
        ref = self.reference.get(tuple(int(t) for t in lane.prompt))
        if ref is None:
            return []
        done = len(lane.generated)
        out = list(ref[done : done + k])
        if out and self.rng.random() < 0.5:
            out[self.rng.randrange(len(out))] ^= 1  # a wrong draft somewhere
        return out


Job = tuple[list[int], dict[str, Any]]
Outcome = list[tuple[Any, ...]]


async def run_all(engine: Engine, jobs: Sequence[Job], cut: Mapping[int, int] | None = None) -> list[Outcome]:
    """Every job at once (batched as the engine batches them): each one's tokens, as yielded.
    `cut`: job -> tokens after which its reader cancels it (mid-verify, where a step verifies)."""
    results: list[Outcome] = [[] for _ in jobs]
    cut = cut or {}

    async def one(i: int) -> None:
        ids, params = jobs[i]
        with anyio.CancelScope() as scope:
            async for tok in engine.stream(ids, **params):
                tops = [(t.id, t.logprob) for t in tok.top_logprobs] if tok.top_logprobs else None
                results[i].append((tok.id, tok.text, tok.index, tok.logprob, tops, tok.finish_reason))
                if len(results[i]) == cut.get(i):
                    scope.cancel()

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
    return results


words = st.sampled_from(["the", "cat", "sat", "on", "mat", "a", "b", "ab", " ", "\n", "x", "yz"])
prompt_text = st.lists(words, min_size=1, max_size=30).map(" ".join)
params_st = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 24)},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.3]),
        "seed": st.integers(0, 2**32),
        "top_k": st.integers(0, 20),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "min_p": st.sampled_from([0.0, 0.05]),
        "repeat_penalty": st.sampled_from([1.0, 1.3]),
        "presence_penalty": st.sampled_from([0.0, 0.5]),
        "frequency_penalty": st.sampled_from([0.0, 0.4]),
        "logit_bias": st.dictionaries(st.integers(0, 300), st.floats(-5, 5), max_size=3),
        "stop": st.lists(st.sampled_from(["a", "t", "ca", "e", " s", "zz"]), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 400), max_size=3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 3),
        "ignore_eos": st.booleans(),
    },
)


class SpecCase(NamedTuple):
    """One run of the property test, drawn whole before its coroutine runs (a draw inside it that overruns
    hypothesis's buffer raises StopTest, a BaseException, through anyio's runner task)."""

    texts: list[str]
    params: list[dict[str, Any]]
    batch: int
    chunk: int
    seed: int
    same: bool
    adaptive: bool
    cancel: tuple[int, int] | None


@st.composite
def spec_cases(draw: st.DrawFn) -> SpecCase:
    n_jobs = draw(st.integers(1, 4))
    texts = draw(st.lists(prompt_text, min_size=n_jobs, max_size=n_jobs, unique=True))
    params = [draw(params_st) for _ in range(n_jobs)]
    for p in params:  # a seeded request, so sampled output is reproducible
        p.setdefault("seed", 7)
    return SpecCase(
        texts,
        params,
        batch=draw(st.sampled_from([1, 2, 4])),  # 2 with 4 jobs: lanes are taken back (paused)
        chunk=draw(st.sampled_from([5, 64])),
        seed=draw(st.integers(0, 1000)),
        same=draw(st.booleans()),  # the draft model: the target's weights, or other ones
        adaptive=draw(st.booleans()),  # the draft model's policy (it drafts less, or not at all)
        # one reader may cancel its stream after a few tokens (more may be delivered before the
        # cancel lands): the others' output is unchanged, and its own is the plain output's start
        cancel=draw(st.none() | st.tuples(st.integers(0, n_jobs - 1), st.integers(1, 6))),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=spec_cases())
async def test_speculation_gives_the_plain_output(
    tiny_model_path: Path, second_tiny_model_path: Path, case: SpecCase
) -> None:
    texts, params, batch, chunk, seed, same, adaptive, cancel = case
    opts: dict[str, Any] = dict(max_batch_size=batch, max_context=96, prefill_chunk=chunk)
    opts["grammar_backend_at_open"] = False  # no grammar here: opens in ms, not half a second
    async with Engine.open(tiny_model_path, **opts) as plain:
        jobs = [(await plain.encode(t), p) for t, p in zip(texts, params, strict=True)]
        want = await run_all(plain, jobs)
    reference = {tuple(ids): [tok[0] for tok in out] for (ids, _), out in zip(jobs, want, strict=True)}
    draft = SpeculationConfig(
        method="draft", draft_model=str(tiny_model_path if same else second_tiny_model_path), adaptive=adaptive
    )
    cut = dict([cancel]) if cancel else {}
    for drafter in ("ngram", "oracle", "garbage", "draft"):
        async with Engine.open(tiny_model_path, speculation=draft if drafter == "draft" else FULL, **opts) as engine:
            if drafter == "oracle":
                engine._thread.drafter = Oracle(reference, seed)
            elif drafter == "garbage":
                engine._thread.drafter = Garbage(engine.info.vocab_size, seed)
            got = await run_all(engine, jobs, cut)
            # the draft model runs every job again, from its prefix cache (a cancelled one's draft KV was dropped)
            again = await run_all(engine, jobs) if drafter == "draft" else want
            stats = await engine.stats()
            assert engine._thread.drafter is not None  # never closed as failed: a drafter's bug is hidden so
            if drafter == "draft":  # no draft block held at idle but the draft cache's, within its bound
                d = engine._thread.drafter
                assert isinstance(d, DraftModelDrafter)
                used, cached = await engine._call(d.kv_blocks)
                assert used == cached and (d.model.bound is None or cached <= d.model.bound)
        expected = [out[: max(len(got[i]), cut[i])] if i in cut else out for i, out in enumerate(want)]
        assert got == expected and again == want, drafter
        assert stats.live_sequences == 0 and stats.kv_blocks_used == stats.prefix_blocks_cached
        assert stats.draft_live_sequences == 0  # every draft sequence went with its lane
        # a decode step with room for drafts: one lane at a time, or a budget no prompt chunk
        # fills (draft rows come out of the step's prefill budget); the draft model first catches
        # up with the lane's tokens at `chunk` a step (not in the step that admits the lane)
        roomy = batch == 1 or chunk == 64
        for (ids, _), out in zip(jobs, expected, strict=True):
            catch_up = -(-(len(ids) + len(out)) // chunk) if drafter == "draft" else 0
            if (drafter == "oracle" or (drafter == "draft" and not adaptive)) and roomy and len(out) > 2 + catch_up:
                assert stats.spec_draft_tokens > 0


async def test_an_echoed_prompt_is_drafted_and_accepted(tiny_model_path: Path) -> None:
    """The random tiny model loops, so its output repeats: prompt lookup drafts it and the drafts are
    accepted (counted in usage, stats and steps), the output unchanged."""
    prompt = "the cat sat on the mat the cat sat on the mat the cat"
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate(prompt, max_tokens=48, ignore_eos=True)
        plain_steps = (await plain.stats()).steps
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        got = await engine.generate(prompt, max_tokens=48, ignore_eos=True)
        stats = await engine.stats()
        off = await engine.generate(prompt, max_tokens=48, ignore_eos=True, speculation=False)
        after = await engine.stats()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.usage.accepted_draft_tokens > 0
    assert got.usage.draft_tokens >= got.usage.accepted_draft_tokens
    assert stats.spec_accepted_tokens == got.usage.accepted_draft_tokens
    assert stats.steps < plain_steps  # accepted drafts are tokens made without a step of their own
    # the per-request opt-out: the same tokens, no drafts
    assert off.token_ids == want.token_ids and off.usage.draft_tokens == 0
    assert after.spec_draft_tokens == stats.spec_draft_tokens


async def test_verify_rows_without_host_needs_are_sampled_in_the_engine(tiny_model_path: Path) -> None:
    """A verifying step samples its lanes that need no host rows (greedy, or seeded with penalties)
    in the engine, every verify row in one call, as the fused-sample path would: no row of theirs
    is sampled on the host. A lane that asks for logprobs still is. The tokens are the same."""
    prompt = "the cat sat on the mat the cat sat on the mat the cat"
    cases: list[dict[str, Any]] = [
        dict(max_tokens=40, ignore_eos=True),
        dict(max_tokens=40, ignore_eos=True, temperature=0.8, seed=3, presence_penalty=0.5, min_p=0.05),
        dict(max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2),
    ]
    async with Engine.open(tiny_model_path) as plain:
        want = [await plain.generate(prompt, **c) for c in cases]
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        runner = engine._thread.runner
        host_rows = 0
        sample_host_row = runner._sample_host_row

        def counted(lane: Any, i: int) -> Any:
            nonlocal host_rows
            host_rows += 1
            return sample_host_row(lane, i)

        runner._sample_host_row = counted  # type: ignore[method-assign]
        for case, ref in zip(cases, want, strict=True):
            host_rows = 0
            got = await engine.generate(prompt, **case)
            assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
            assert got.usage.draft_tokens > 0
            if case.get("logprobs"):
                assert host_rows >= len(got.token_ids) - 1  # every token after the first, from host rows
            else:
                assert host_rows == 0


class RefusingArgmax:
    """The library, but baseRT_batch_step_fused_rows_argmax answers UNSUPPORTED (a bundle the engine
    verifies through host logits only)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def baseRT_batch_step_fused_rows_argmax(self, *args: Any) -> int:
        self.calls += 1
        return 5  # BASERT_ERR_UNSUPPORTED


async def test_greedy_verify_steps_are_argmaxed_in_the_engine(tiny_model_path: Path) -> None:
    """A verify step whose lanes are all greedy with no host needs runs
    `baseRT_batch_step_fused_rows_argmax` (counted by the runner): no row is sampled, in the engine
    or on the host, and the tokens are the plain ones. A sampled lane or one asking for logprobs
    takes the logits rows instead. A refusal (UNSUPPORTED) is remembered: the logits rows from
    then on, the same tokens."""
    prompt = "the cat sat on the mat the cat sat on the mat the cat"
    greedy: dict[str, Any] = dict(max_tokens=40, ignore_eos=True)
    others: list[dict[str, Any]] = [
        dict(greedy, temperature=0.8, seed=3),
        dict(greedy, logprobs=True),
        dict(greedy, repeat_penalty=1.3),  # greedy penalties are sampled on the host
    ]
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate(prompt, **greedy)
        want_others = [await plain.generate(prompt, **c) for c in others]
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        runner = engine._thread.runner
        assert engine.capabilities.rows_argmax and runner.argmax_steps == 0
        sampled_rows = 0
        sample_rows, sample_host_row = runner.sample_rows, runner._sample_host_row

        def counted_rows(batch: Any) -> Any:
            nonlocal sampled_rows
            sampled_rows += 1
            return sample_rows(batch)

        def counted_host(lane: Any, i: int) -> Any:
            nonlocal sampled_rows
            sampled_rows += 1
            return sample_host_row(lane, i)

        runner.sample_rows = counted_rows  # type: ignore[method-assign]
        runner._sample_host_row = counted_host  # type: ignore[method-assign]
        got = await engine.generate(prompt, **greedy)
        assert got.token_ids == want.token_ids and got.usage.accepted_draft_tokens > 0
        steps = runner.argmax_steps
        assert steps > 0 and sampled_rows == 0
        for case, ref in zip(others, want_others, strict=True):
            out = await engine.generate(prompt, **case)
            assert out.token_ids == ref.token_ids and out.usage.draft_tokens > 0, case
        assert runner.argmax_steps == steps and sampled_rows > 0  # none of those was argmaxed
        refusing = RefusingArgmax(runner.lib)
        runner.lib = refusing  # type: ignore[assignment]
        again = await engine.generate(prompt, **greedy)
        assert again.token_ids == want.token_ids and again.usage.draft_tokens > 0
        assert refusing.calls == 1 and runner.argmax_refused and runner.argmax_steps == steps


class Broken(Garbage):
    """Raises in its hook before the plan, after a few steps of drafting garbage."""

    def __init__(self, vocab: int, after: int) -> None:
        super().__init__(vocab, seed=1)
        self.after = after
        self.closed = False

    def before_plan(self, lanes: Any, policy: SpecPolicy) -> None:
        self.after -= 1
        if self.after < 0:
            raise RuntimeError("a drafter's bug")

    def close(self) -> None:
        self.closed = True


async def test_a_drafter_that_fails_turns_speculation_off_and_loses_nothing(tiny_model_path: Path) -> None:
    """A drafter raising where it runs for all lanes at once (a draft model's steps) costs speed,
    never a request: it is closed, the streams go on plainly with their plain output, and the next
    requests are served (a failure there once failed the running lanes, then spun on the waiting
    ones with no reply)."""
    params = {"max_tokens": 24, "ignore_eos": True}
    async with Engine.open(tiny_model_path, max_batch_size=2) as plain:
        jobs = [(await plain.encode(f"fail {i}"), params) for i in range(3)]
        want = await run_all(plain, jobs)
    async with Engine.open(tiny_model_path, max_batch_size=2, speculation=FULL) as engine:
        broken = Broken(engine.info.vocab_size, after=5)
        engine._thread.drafter = broken
        assert await run_all(engine, jobs) == want  # bounded: run_all fails after BOUND
        assert broken.closed and engine._thread.drafter is None
        assert await run_all(engine, jobs[:1]) == want[:1]


async def test_a_draft_past_a_stop_is_neither_delivered_nor_kept(tiny_model_path: Path) -> None:
    """An oracle drafts the whole reference output at once: the stop comes inside an accepted run,
    and nothing after it is delivered or left in the KV (the published prefix is prompt + output)."""
    async with Engine.open(tiny_model_path) as plain:
        for text in ("a b a b a b a b", "the cat", "x yz x yz", "on a mat"):
            ids = await plain.encode(text)
            ref = await plain.generate(ids, max_tokens=30, ignore_eos=True)
            # a stop id that first comes a few tokens in: it ends an accepted run
            late = [t for j, t in enumerate(ref.token_ids) if j >= 3 and t not in ref.token_ids[:j]]
            if late:
                break
        stop_id = late[0]
        want = await plain.generate(ids, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        engine._thread.drafter = Oracle({tuple(ids): ref.token_ids}, 0)
        engine._thread.drafter.rng.random = lambda: 1.0  # type: ignore[method-assign]  # never corrupt
        got = await engine.generate(ids, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
        stats = await engine.stats()
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert got.usage.accepted_draft_tokens > 0
    assert stats.live_sequences == 0


async def test_json_schema_output_is_the_same_speculated(tiny_model_path: Path) -> None:
    """A grammar lane: each row is masked with the drafts before it accepted by the matcher."""
    params = dict(max_tokens=40, json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    async with Engine.open(tiny_model_path) as plain:
        ids = await plain.encode("json please")
        want = await plain.generate(ids, **params)
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        engine._thread.drafter = Oracle({tuple(ids): want.token_ids}, 1)
        got = await engine.generate(ids, **params)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert got.usage.accepted_draft_tokens > 0


async def test_n_choices_are_the_same_speculated(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate_n("a b a b a b", n=3, max_tokens=20, temperature=0.9, seed=11, logprobs=True)
    async with Engine.open(tiny_model_path, speculation=FULL) as engine:
        got = await engine.generate_n("a b a b a b", n=3, max_tokens=20, temperature=0.9, seed=11, logprobs=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]


# ---- the parts ----------------------------------------------------------------------------------


class _Lane:
    def __init__(self, prompt: list[int], generated: list[int]) -> None:
        self.prompt = prompt
        self.generated = generated
        self.speculation: LaneSpec | None = LaneSpec()


def test_ngram_drafter_proposes_what_followed_the_latest_match() -> None:
    d = NgramDrafter(2, 3)
    lane = _Lane([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8], [2, 3])
    assert d.propose(lane, 3) == [4, 7, 8]  # the latest [2, 3] was followed by 4, 7, 8
    lane.generated.append(4)
    assert d.propose(lane, 2) == [7, 8]  # the longest match first: [2, 3, 4]
    loop = _Lane([5, 6, 5, 6], [5])
    assert d.propose(loop, 4) == [6, 5, 6, 5]  # a loop continues with its period
    assert d.propose(_Lane([1, 2, 3], [4]), 4) == []


def _latest_match(seq: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by a scan: the longest suffix (n_max down to n_min) that occurred earlier,
    and what followed its latest earlier occurrence (its period repeated)."""
    total = len(seq)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        ends = [end for end in range(n, total) if seq[end - n : end] == seq[total - n :]]
        if ends:
            after = ends[-1]
            return [seq[after + i % (total - after)] for i in range(k)]
    return []


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=30),
    out=st.lists(st.integers(0, 4), max_size=30),
    every=st.integers(1, 5),
)
def test_the_incremental_ngram_index_finds_what_a_scan_finds(prompt: list[int], out: list[int], every: int) -> None:
    """The index is extended as the lane generates (asked every `every` tokens, as the policy
    probes a lane): each proposal is the one a scan of the whole context gives."""
    d = NgramDrafter(2, 4)
    lane = _Lane(prompt, [])
    for i, tok in enumerate(out):
        lane.generated.append(tok)
        if i % every == 0:
            assert d.propose(lane, 4) == _latest_match(prompt + lane.generated, 4, 2, 4)


def test_step_cost_fit_and_policy_depth() -> None:
    cost = StepCost()
    for rows in (1, 2, 5, 1, 8, 3):
        cost.add(rows, 0.010 + 0.001 * rows)
    fit = cost.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.010, rel=1e-6) and fit[1] == pytest.approx(0.001, rel=1e-6)
    assert cost.row_cost(1, 1) == pytest.approx(0.001 / 0.011)  # one stream: a row is nearly free
    wide = StepCost()
    for rows in (8, 16, 12, 9):
        wide.add(rows, 0.001 * rows)  # compute-bound: a row costs a token
    assert wide.row_cost(16, 16) == pytest.approx(1.0)


def _compute_bound() -> SpecPolicy:
    """A policy whose fitted step is 10 ms + 1 ms a row: at 16 lanes a row costs 16/26 of a token."""
    policy = SpecPolicy()
    for rows in (8, 16, 12, 9, 16, 20):
        policy.cost.add(rows, 0.010 + 0.001 * rows)
    return policy


def test_a_lane_no_draft_pays_for_is_only_probed() -> None:
    """Free text at a wide batch: the drafter is not run for the lane each step, only one step in
    `probe_every`, and not while its last proposal is still being scored as a shadow."""
    policy = _compute_bound()
    st = LaneSpec()  # the prior p = 0.4: below 1.5 x 16/26
    asked = [policy.ask(st, 16, 16) for _ in range(12)]
    assert asked == [False, False, False, True] * 3
    st.shadow = [5, 6]
    assert not any(policy.ask(st, 16, 16) for _ in range(8))
    st.shadow = []
    assert policy.ask(st, 16, 16)
    good = LaneSpec(prior_hits=30.0, prior_misses=0.5)  # a lane whose drafts are accepted: asked every step
    assert all(policy.ask(good, 16, 16) for _ in range(5))
    assert all(SpecPolicy(adaptive=False).ask(st, 16, 16) for _ in range(5))


def test_the_first_lane_to_draft_pays_the_verify_overhead() -> None:
    """A verifying step costs more than its rows (host sampling, rollbacks): the first lane to
    draft in a step drafts only when its expected accepted drafts cover that too."""
    policy = SpecPolicy()
    for rows in (1, 2, 5, 1, 8, 3):
        policy.cost.add(rows, 0.010 + 0.001 * rows)  # a row costs 1/11 of a token at one lane
    st = LaneSpec(prior_hits=1.0, prior_misses=1.0)  # p = 0.5
    assert policy.depth(st, 4, 1, 1) == 2  # 0.5^2 > 1.5 / 11 > 0.5^3
    assert policy.depth(st, 4, 1, 1, first=True) == 2  # 0.75 - 2/11 > 2/11 (the prior overhead, 2 rows)
    policy.cost.overhead_rows = 8.0
    assert policy.depth(st, 4, 1, 1, first=True) == 0  # 0.75 - 2/11 < 8/11
    assert policy.depth(st, 4, 1, 1) == 2  # a later lane shares a step that verifies anyway
    # measured on verifying steps, in rows, each counted at most 8 rows; back to the prior over plain ones
    cost = StepCost()
    for rows in (1, 2, 5, 1, 8, 3):
        cost.add(rows, 0.010 + 0.001 * rows)
    for _ in range(40):
        cost.add(4, 0.010 + 0.001 * 4 + 0.003, verified=True)
    assert cost.overhead_rows == pytest.approx(3.0, abs=1e-3)
    cost.add(4, 1.0, verified=True)
    assert cost.overhead_rows == pytest.approx(0.8 * 3.0 + 0.2 * 8.0, abs=1e-3)
    for _ in range(300):
        cost.add(2, 0.012)
    assert cost.overhead_rows == pytest.approx(cost.prior_overhead, abs=0.02)


def test_speculation_config_is_checked() -> None:
    assert EngineConfig(speculation=SpeculationConfig()).speculation == SpeculationConfig(method="ngram")
    for bad in (
        dict(num_speculative_tokens=0),
        dict(num_speculative_tokens=8),
        dict(prompt_lookup_min=3, prompt_lookup_max=2),
        dict(method="eagle"),
    ):
        with pytest.raises(InvalidConfigError, match="speculation"):
            SpeculationConfig(**bad)
    with pytest.raises(InvalidConfigError, match="speculation"):
        Engine.open("x.base", speculation=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculation"):
        SamplingParams(speculation=1).validate()  # type: ignore[arg-type]
