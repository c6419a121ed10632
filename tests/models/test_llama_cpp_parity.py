"""The reference engine against llama.cpp's recorded output on the same GGUF (issue 17's proof).

tests/data/llama_cpp/<model>.json is llama.cpp's side as `bench/llama_oracle.py --record` wrote it
(llama.cpp's version and commit, the texts and prompts, in the file): the token ids of each text,
the 5 chat prompts rendered by the model's template with their prompt ids, llama.cpp's first 32
greedy ids per prompt with its top-2 log-probabilities, and the perplexity of
bench/data/held_out.txt. Here the engine must give the same ids for every text and prompt, the
same greedy ids (free-running, and teacher-forced along llama.cpp's path: at every position but the
positions listed in NEAR_TIES, where the exact float64 forward must rate our token at least as high
as llama.cpp's), and a perplexity within 1% of llama.cpp's (or, where llama.cpp is itself further
than that from the exact forward, held to the exact value measured and listed in EXACT_PPL), without
llama.cpp being built.

SmolLM2-135M-Instruct Q4_1 runs as the demo bundle (q4: the GGUF's own Q4_1 blocks), Gemma 3 270M
Q4_K_M through Engine.open on the GGUF, both with the default conversion (auto: its K-quant blocks
kept) and with f16.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import oracle
import pytest
from gguf import GGUFReader
from oracle import LlamaForward, gguf_oracle

from aiobasert import Engine
from aiobasert._ffi import load_library
from aiobasert.models.cache import resolve_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import llama_oracle  # noqa: E402  (the bench's chunking and perplexity, so both compute it one way)

RECORDINGS = Path(__file__).resolve().parents[1] / "data" / "llama_cpp"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
GEMMA3 = "gemma-3-270m-q4_k_m"
PPL_TOLERANCE = 0.01  # issue 17: perplexity on held-out text within 1% of llama.cpp's

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    """These tests check numbers, not the event loop: one backend. Under trio they ran every forward
    (the float64 oracle's included) a second time, half of this file's ~17 minutes, the suite's
    longest; the SDK's trio path is tested across tests/sdk and tests/server."""
    return "asyncio"


class ExactForward:
    """The exact float64 forward over a GGUF's dequantized weights (tests/oracle.py's gguf_oracle) and the
    GGUF's header, read on first use and shared by this module's tests (the `exact` fixture): gguf-py reads
    Gemma 3's 262k-entry vocabulary in ~14 s each time, and both dtypes' free-running and teacher-forced
    runs ask about the same prefixes, each computed once. What it answers is kept in pytest's cache under
    a key of everything the answer depends on (the GGUF's bytes, the oracle's and this file's code, numpy's
    and gguf-py's versions), so a later run asks the oracle only what it has not answered for those."""

    def __init__(self, gguf: Path, cache: pytest.Cache | None) -> None:
        self.gguf, self._cache = gguf, cache
        self._rows: dict[tuple[int, ...], Any] = {}

    @functools.cached_property
    def reader(self) -> GGUFReader:
        return GGUFReader(self.gguf)

    @functools.cached_property
    def forward(self) -> LlamaForward:
        return gguf_oracle(self.reader)

    @functools.cached_property
    def _cache_key(self) -> str:
        import numpy

        key = hashlib.sha256(self.gguf.read_bytes())
        for code in (Path(oracle.__file__), Path(__file__)):
            key.update(code.read_bytes())
        key.update(f"numpy {numpy.__version__} gguf {importlib.metadata.version('gguf')}".encode())
        return f"aiobasert/exact-forward/{key.hexdigest()[:24]}"

    def _answer(self, question: str, compute: Callable[[], Any]) -> Any:
        if self._cache is None:
            return compute()
        answers = self._cache.get(self._cache_key, {})
        if question not in answers:
            answers[question] = compute()
            self._cache.set(self._cache_key, answers)
        return answers[question]

    def bos(self) -> list[int]:
        """llama_oracle.bos_added, from the header."""
        return list(self._answer("bos", lambda: llama_oracle.bos_of(self.reader.fields)))

    def logprobs_of(self, prefix: list[int], ids: list[int]) -> list[float]:
        """The exact log-probabilities of `ids` as the token after `prefix`."""

        def compute() -> list[float]:
            key = tuple(prefix)
            if key not in self._rows:
                self._rows[key] = exact_logprobs(self.forward.next_logits(prefix))
            return [float(self._rows[key][i]) for i in ids]

        return list(self._answer(json.dumps([prefix, ids]), compute))


Exact = Callable[[Path], ExactForward]


@pytest.fixture(scope="module")
def exact(request: pytest.FixtureRequest) -> Iterator[Exact]:
    """ExactForward of a GGUF, one per file for the module (its ~1 GB of float weights freed after)."""
    by_file: dict[Path, ExactForward] = {}

    def of(gguf: Path) -> ExactForward:
        if gguf not in by_file:
            by_file[gguf] = ExactForward(gguf, request.config.cache)
        return by_file[gguf]

    yield of
    by_file.clear()


def opened(model: Path, dtype: str = "auto") -> Any:
    """Engine.open with one lane, the exact f32 KV pool, and no grammar backend (none is asked for here:
    llguidance's view of Gemma 3's 262k vocabulary is seconds and ~300 MiB)."""
    return Engine.open(model, max_batch_size=1, dtype=dtype, kv_cache_dtype="f32", grammar_backend_at_open=False)  # type: ignore[arg-type]


def recording(name: str, gguf: Path) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((RECORDINGS / f"{name}.json").read_text())
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert rec["model"]["sha256"] == digest, f"{gguf} is not the file the recording was made on"
    return rec


async def check_tokens(engine: Engine, rec: dict[str, Any], exact: ExactForward) -> None:
    """Every text id for id (plain text; engine.encode adds the vocab's BOS where llama.cpp's
    add_special would, the recording has none), and each rendered chat prompt as llama-server's
    chat path tokenizes it (template markers parsed, the vocab's BOS added)."""
    bos = exact.bos()
    for t in rec["texts"]:
        assert await engine.encode(t["text"]) == bos + t["ids"], t["text"]
    for p in rec["prompts"]:
        assert await engine.encode(p["rendered"], special=True) == p["ids"], p["rendered"]


# Where llama.cpp's greedy choice is not ours, measured 2026-12-03 against llama.cpp 0c1e570 (AVX-512
# build): {(recording, dtype): {prompt index: {position on llama.cpp's greedy path: llama.cpp's own gap
# between its top-2 there, in nats}}}. At every one of them the exact float64 forward over the GGUF's
# dequantized weights (tests/oracle.py's gguf_oracle) must rate our token at least as high as
# llama.cpp's, less QUANT_SLACK where our activations are quantized too (the test re-checks it); logprobs
# below are (id, logprob) as llama.cpp / ours / exact give them.
# SmolLM2 Q4_1 as the q4 demo (the engine's log-probability of llama.cpp's token differs from
# llama.cpp's by 0.040 nats on average, p90 0.096, max 0.309, over the 136 positions); the exact
# forward picks our token at each:
#   prompt 0 pos 15: 26261 -2.0675, 28 -2.1010 / 28 -1.9205, 26261 -2.2330 / 28 -1.9081, 26261 -2.1919
#   prompt 3 pos 9:  492 -1.9451, 718 -2.1743 / 718 -2.0321, 492 -2.1180 / 718 -2.1287, 492 -2.1615
#   prompt 3 pos 27: 2 -0.7257, 198 -0.7315 / 198 -0.6033, 2 -0.8689 / 198 -0.6521, 2 -0.8103
# Gemma 3 270M Q4_K_M, f16 (weights dequantized, float activations; mean 0.041, p90 0.082, max 0.593
# nats). Not all near-ties in llama.cpp's own numbers: there llama.cpp is up to 0.57 nats off the
# exact forward, ours within 0.01; the exact forward picks our token at each:
#   prompt 1 pos 8:  85731 -3.4240, 217716 -3.4320 / 217716 -2.9925, 85731 -3.7300 / 217716 -2.9966, 85731 -3.7316
#   prompt 1 pos 10: 54973 -4.0950, 818 -4.5909 / 818 -4.5425, 106094 -4.5952 / 818 -4.5404, 54973 -4.6505
#   prompt 1 pos 30: 54973 -0.7750, 6974 -0.8006 / 6974 -0.7642, 54973 -0.8033 / 6974 -0.7638, 54973 -0.8039
#   prompt 3 pos 5:  221513 -3.4802, 148178 -3.5691 / 148178 -3.3549, 187013 -3.6049 / 148178 -3.3621, 221513 -3.6214
#   prompt 3 pos 7:  54973 -4.6273, 236769 -4.7957 / 8892 -4.9161, 236769 -4.9668 / 8892 -4.9145, 54973 -5.2208
# Gemma 3 270M Q4_K_M, auto (the default: the GGUF's own Q4_K / Q6_K blocks, activations quantized per
# 32 values as llama.cpp's Q8_0; llama.cpp quantizes them per 256, Q8_K). The same five positions
# plus one; exact log-probabilities of (ours, llama.cpp's) where the exact forward picks neither or theirs:
#   prompt 1 pos 8, 10, 30: ours is the exact forward's pick, as with f16
#   prompt 3 pos 5:  ours 187013, theirs 221513: exact -3.5978, -3.6214 (its own pick 148178, -3.3621)
#   prompt 3 pos 7:  ours 236769, theirs 54973:  exact -4.9634, -5.2208 (its own pick 8892, -4.9145)
#   prompt 3 pos 13: ours 107, theirs 221513:    exact -2.7425, -2.6821 (theirs is its pick: 0.060 nats)
# (positions past a prompt's first one are reached teacher-forced only). No other position may
# differ; a listed one that stops differing must be removed, a re-recording re-measured.
NEAR_TIES: dict[tuple[str, str], dict[int, dict[int, float]]] = {
    ("SmolLM2-135M-Instruct.Q4_1", "q4"): {0: {15: 0.0336}, 3: {9: 0.2292, 27: 0.0058}},
    ("gemma-3-270m-q4_k_m", "f16"): {1: {8: 0.0079, 10: 0.4959, 30: 0.0256}, 3: {5: 0.0888, 7: 0.1684}},
    ("gemma-3-270m-q4_k_m", "auto"): {
        1: {8: 0.0079, 10: 0.4959, 30: 0.0256},
        3: {5: 0.0888, 7: 0.1684, 13: 0.2580},
    },
}
# How much lower than llama.cpp's token the exact forward may rate ours where both engines quantize
# their activations (each then errs at near-ties, in different places): the largest seen, 0.060 nats
# (Gemma auto, prompt 3 pos 13), rounded up. Float activations (f16) get none.
QUANT_SLACK = {"q4": 0.07, "auto": 0.07, "f16": 0.0}


def their_gap(p: dict[str, Any], k: int) -> float:
    (_, first), (_, second) = p["top2"][k]
    return float(first - second)


def exact_logprobs(row: Any) -> Any:
    import numpy as np

    row = np.asarray(row, dtype=np.float64)
    return row - (np.log(np.exp(row - row.max()).sum()) + row.max())


# The widest gap between llama.cpp's top-2 at which the two engines' greedy picks were seen to part
# (Gemma 3 f16, prompt 1 pos 10: 0.4959 nats), rounded up.
NEAR_TIE_GAP = 0.5


class Divergences:
    """Judges a position where our greedy pick parts from llama.cpp's. NEAR_TIES lists where the
    AVX-512 kernels part, as measured (AVX2 computes the same bits); the portable set rounds differently and may
    part elsewhere, so every position is held to one rule: a near-tie in llama.cpp's own numbers
    (its top-2 within NEAR_TIE_GAP nats) where the exact float64 forward rates our token at least
    as high as llama.cpp's, less QUANT_SLACK where our activations are quantized. A listed position
    must still carry its listed gap (a re-recording re-measures NEAR_TIES)."""

    def __init__(self, key: tuple[str, str], exact: ExactForward) -> None:
        self.key, self.exact = key, exact

    def problem(self, i: int, p: dict[str, Any], k: int, ours: int, where: str) -> str | None:
        theirs, gap = p["greedy"][k], their_gap(p, k)
        listed = NEAR_TIES.get(self.key, {}).get(i, {})
        if k in listed and abs(gap - listed[k]) > 1e-3:
            return f"{where}: the recording's gap is not the listed {listed[k]}: re-measure NEAR_TIES"
        if gap > NEAR_TIE_GAP:
            return f"{where}: not a near-tie (llama.cpp's top-2 gap {gap:.4f} nats > {NEAR_TIE_GAP})"
        lp_ours, lp_theirs = self.exact.logprobs_of(p["ids"] + p["greedy"][:k], [ours, theirs])
        slack = QUANT_SLACK[self.key[1]]
        if lp_ours < lp_theirs - slack:
            return f"{where}: the exact forward rates ours {lp_ours:.4f}, llama.cpp's {lp_theirs:.4f} (slack {slack})"
        return None


def float_kernels() -> str:
    """The engine's float kernel set in this process ("avx512", "avx2-fma", "generic", ...)."""
    return load_library().baseRT_ref_kernels().decode().split()[0].removeprefix("float=")


def settle(problems: list[str], key: tuple[str, str]) -> None:
    """No problem, where NEAR_TIES was measured: the AVX-512 float kernels, or the AVX2 ones, which compute
    the same bits (mathops.c; tests/native/test_native_dot.py), or where activations are floats. The
    portable set rounds its products before adding them, and with quantized activations a last-bit
    difference upstream of the Q8 quantizer can flip a rounding there and the pick at a near-tie (AVX2,
    before it followed AVX-512's order, parted at SmolLM2 prompt 0 pos 9, 0.85 nats, and Gemma auto prompt 2
    pos 12, 0.58): there an expected failure, naming them, until that set is measured."""
    kernels = float_kernels()
    if problems and QUANT_SLACK[key[1]] and kernels == "generic":
        pytest.xfail(f"float kernels {kernels}, not the FMA ones NEAR_TIES was measured on: " + "; ".join(problems))
    assert problems == []


async def teacher_forced_report(
    engine: Engine, rec: dict[str, Any], key: tuple[str, str], exact: ExactForward
) -> list[str]:
    """Our greedy choice after every prefix of llama.cpp's greedy path, against its token there:
    equal everywhere but at near-ties the exact forward settles for ours (Divergences)."""
    problems = []
    judge = Divergences(key, exact)
    for i, p in enumerate(rec["prompts"]):
        for k, theirs in enumerate(p["greedy"]):
            prefix = p["ids"] + p["greedy"][:k]
            (ours,) = (await engine.generate(prefix, max_tokens=1, temperature=0.0)).token_ids
            if ours == theirs:
                continue
            top = await llama_oracle.top2_at(engine, prefix, theirs)
            where = (
                f"prompt {i} position {k}: llama.cpp chose {theirs}, ours {ours}; llama.cpp top-2 (id, logprob) "
                f"{p['top2'][k]}, ours {top['top2']}"
            )
            if (problem := judge.problem(i, p, k, ours, where)) is not None:
                problems.append(problem)
    return problems


async def free_running_report(
    engine: Engine, rec: dict[str, Any], key: tuple[str, str], exact: ExactForward, *, chat: bool
) -> list[str]:
    """Each prompt's own greedy run (on llama.cpp's prompt ids, or rendered by engine.chat) equals
    llama.cpp's up to its end or to a near-tie the exact forward settles for ours (Divergences),
    where the two runs part."""
    problems = []
    judge = Divergences(key, exact)
    for i, p in enumerate(rec["prompts"]):
        if chat:
            done = await engine.chat(p["messages"], max_tokens=rec["n_predict"], temperature=0.0)
            if done.usage.prompt_tokens != len(p["ids"]):
                n = done.usage.prompt_tokens
                problems.append(f"prompt {i}: engine.chat rendered {n} prompt tokens, llama.cpp {len(p['ids'])}")
                continue
        else:
            done = await engine.generate(p["ids"], max_tokens=rec["n_predict"], temperature=0.0)
        k = llama_oracle.first_divergence(p["greedy"], done.token_ids)
        if k is None:
            continue
        if k >= min(len(done.token_ids), len(p["greedy"])):
            problems.append(f"prompt {i}: {len(done.token_ids)} greedy tokens, llama.cpp {len(p['greedy'])}")
            continue
        where = (f"prompt {i}: greedy diverges at position {k}: llama.cpp {p['greedy'][k : k + 3]}, "
                 f"ours {done.token_ids[k : k + 3]}")  # fmt: skip
        if (problem := judge.problem(i, p, k, done.token_ids[k], where)) is not None:
            problems.append(problem)
    return problems


def perplexity(bundle: Path, rec: dict[str, Any], add_bos: bool) -> dict[str, Any]:
    """Ours over the recording's held-out text, llama-perplexity's chunking (the bench's code)."""
    pp = rec["perplexity"]
    text = (ROOT / pp["file"]).read_bytes()
    assert hashlib.sha256(text).hexdigest() == pp["sha256"], f"{pp['file']} changed since the recording"
    spec = {"model": str(bundle), "n_ctx": pp["n_ctx"], "add_bos": add_bos}
    return llama_oracle.ppl_worker(spec)


# Where llama.cpp's perplexity is not within PPL_TOLERANCE of the exact forward's, measured: the float64
# forward over the GGUF's dequantized weights (tests/oracle.py's gguf_oracle) on the same ids and chunks.
# Gemma 3 270M Q4_K_M: exact 8.1797, llama.cpp 8.4087 (2.8% above exact: its activations quantized per
# 256 values); ours 8.1810 with f16 (float activations), 8.2879 with auto (1.3%: activations quantized
# per 32). There ours is held to the exact value instead: within 0.1% with float activations, and with
# quantized ones nearer the exact value than llama.cpp is, and within half of llama.cpp's distance.
EXACT_PPL: dict[str, float] = {"gemma-3-270m-q4_k_m": 8.1797}


def check_perplexity(name: str, dtype: str, ours: dict[str, Any], rec: dict[str, Any]) -> None:
    theirs = rec["perplexity"]
    assert ours["ids_sha256"] == theirs["ids_sha256"], "the held-out text tokenizes differently"
    # Never worse than llama.cpp's by more than 1%, for every model; where it sits further below, see EXACT_PPL.
    assert ours["ppl"] <= theirs["ppl"] * (1 + PPL_TOLERANCE), (ours, theirs)
    if name in EXACT_PPL:
        exact = EXACT_PPL[name]
        assert abs(theirs["ppl"] / exact - 1) > PPL_TOLERANCE, "llama.cpp is near exact now: drop EXACT_PPL"
        bound = 0.001 if QUANT_SLACK[dtype] == 0 else abs(theirs["ppl"] / exact - 1) / 2
        assert abs(ours["ppl"] / exact - 1) <= bound, (ours["ppl"], exact, bound)
    else:
        assert abs(ours["ppl"] / theirs["ppl"] - 1) <= PPL_TOLERANCE, (ours, theirs)


# ---- SmolLM2-135M-Instruct Q4_1: the demo -------------------------------------------------------


async def test_smollm2_tokens_match_llama_cpp(smollm2_path: Path, smollm2_gguf: Path, exact: Exact) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    async with opened(smollm2_path) as engine:
        await check_tokens(engine, rec, exact(smollm2_gguf))


@pytest.mark.timeout(900)  # every position teacher-forced, the float64 forward at the listed ones
async def test_smollm2_greedy_matches_llama_cpp(smollm2_path: Path, smollm2_gguf: Path, exact: Exact) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    async with opened(smollm2_path) as engine:
        settle(
            await free_running_report(engine, rec, (SMOLLM2, "q4"), exact(smollm2_gguf), chat=False), (SMOLLM2, "q4")
        )
        settle(await teacher_forced_report(engine, rec, (SMOLLM2, "q4"), exact(smollm2_gguf)), (SMOLLM2, "q4"))


async def test_smollm2_chat_matches_llama_cpp(smollm2_path: Path, smollm2_gguf: Path, exact: Exact) -> None:
    """engine.chat renders with our own template: the same prompt length and greedy ids as llama.cpp's."""
    rec = recording(SMOLLM2, smollm2_gguf)
    async with opened(smollm2_path) as engine:
        settle(await free_running_report(engine, rec, (SMOLLM2, "q4"), exact(smollm2_gguf), chat=True), (SMOLLM2, "q4"))


def test_smollm2_perplexity_within_1_percent_of_llama_cpp(smollm2_path: Path, smollm2_gguf: Path) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    check_perplexity(SMOLLM2, "q4", perplexity(smollm2_path, rec, add_bos=False), rec)


# ---- Gemma 3 270M Q4_K_M (issue 17's real model) -------------------------------------------------

# Both conversions: the default (auto: the GGUF's K-quant blocks kept, quantized activations) and f16
# (dequantized weights, float activations), each with its measured near-ties above.
GEMMA3_DTYPES = pytest.mark.parametrize("dtype", ["auto", "f16"])


@GEMMA3_DTYPES
async def test_gemma3_tokens_match_llama_cpp(gemma3_gguf: Path, dtype: str, exact: Exact) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with opened(gemma3_gguf, dtype) as engine:
        await check_tokens(engine, rec, exact(gemma3_gguf))


@GEMMA3_DTYPES
@pytest.mark.timeout(900)  # every position teacher-forced, the float64 forward at the listed ones
async def test_gemma3_greedy_matches_llama_cpp(gemma3_gguf: Path, dtype: str, exact: Exact) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with opened(gemma3_gguf, dtype) as engine:
        settle(await free_running_report(engine, rec, (GEMMA3, dtype), exact(gemma3_gguf), chat=False), (GEMMA3, dtype))
        settle(await teacher_forced_report(engine, rec, (GEMMA3, dtype), exact(gemma3_gguf)), (GEMMA3, dtype))


@GEMMA3_DTYPES
async def test_gemma3_chat_matches_llama_cpp(gemma3_gguf: Path, dtype: str, exact: Exact) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with opened(gemma3_gguf, dtype) as engine:
        settle(await free_running_report(engine, rec, (GEMMA3, dtype), exact(gemma3_gguf), chat=True), (GEMMA3, dtype))


@GEMMA3_DTYPES
def test_gemma3_perplexity_within_1_percent_of_llama_cpp(gemma3_gguf: Path, dtype: str) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    bundle = resolve_model(gemma3_gguf, dtype=dtype, progress=False)
    check_perplexity(GEMMA3, dtype, perplexity(bundle, rec, add_bos=True), rec)
