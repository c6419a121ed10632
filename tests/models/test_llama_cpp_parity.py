"""The reference engine against llama.cpp's recorded output on the same GGUF (issue 17's proof).

tests/data/llama_cpp/<model>.json is llama.cpp's side as `bench/llama_oracle.py --record` wrote it
(llama.cpp's version and commit, the texts and prompts, in the file): the token ids of each text,
the 5 chat prompts rendered by the model's template with their prompt ids, llama.cpp's first 32
greedy ids per prompt with its top-2 log-probabilities, and the perplexity of
bench/data/held_out.txt. Here the engine must give the same ids for every text and prompt, the
same greedy ids (free-running, and teacher-forced along llama.cpp's path: at every position but the
positions listed in NEAR_TIES), and a perplexity within 1% of llama.cpp's (or, where llama.cpp is
itself further than that from the exact float64 forward, within 0.1% of the exact value measured and
listed in EXACT_PPL), without llama.cpp being built.

SmolLM2-135M-Instruct Q4_1 runs as the demo bundle (q4: the GGUF's own Q4_1 blocks), Gemma 3 270M
Q4_K_M through Engine.open on the GGUF (the engine's default conversion).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from oracle import gguf_oracle

from aiobasert import Engine
from aiobasert.models.cache import resolve_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import llama_oracle  # noqa: E402  (the bench's chunking and perplexity, so both compute it one way)

RECORDINGS = Path(__file__).resolve().parents[1] / "data" / "llama_cpp"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
GEMMA3 = "gemma-3-270m-q4_k_m"
PPL_TOLERANCE = 0.01  # issue 17: perplexity on held-out text within 1% of llama.cpp's

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


def recording(name: str, gguf: Path) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((RECORDINGS / f"{name}.json").read_text())
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert rec["model"]["sha256"] == digest, f"{gguf} is not the file the recording was made on"
    return rec


async def check_tokens(engine: Engine, rec: dict[str, Any], gguf: Path) -> None:
    """Every text id for id (plain text; engine.encode adds the vocab's BOS where llama.cpp's
    add_special would, the recording has none), and each rendered chat prompt as llama-server's
    chat path tokenizes it (template markers parsed, the vocab's BOS added)."""
    bos = llama_oracle.bos_added(gguf)
    for t in rec["texts"]:
        assert await engine.encode(t["text"]) == bos + t["ids"], t["text"]
    for p in rec["prompts"]:
        assert await engine.encode(p["rendered"], special=True) == p["ids"], p["rendered"]


# Where llama.cpp's greedy choice is not ours, measured 2026-12-03 against llama.cpp 0c1e570 (AVX-512
# build): {recording: {prompt index: {position on llama.cpp's greedy path: llama.cpp's own gap
# between its top-2 there, in nats}}}. At every one of them the exact float64 forward over the GGUF's
# dequantized weights (tests/oracle.py's gguf_oracle) picks OUR token, and the test re-checks that;
# logprobs below are (id, logprob) as llama.cpp / ours / exact give them.
# SmolLM2 Q4_1 as the q4 demo (the engine's log-probability of llama.cpp's token differs from
# llama.cpp's by 0.040 nats on average, p90 0.096, max 0.309, over the 136 positions):
#   prompt 0 pos 15: 26261 -2.0675, 28 -2.1010 / 28 -1.9205, 26261 -2.2330 / 28 -1.9081, 26261 -2.1919
#   prompt 3 pos 9:  492 -1.9451, 718 -2.1743 / 718 -2.0321, 492 -2.1180 / 718 -2.1287, 492 -2.1615
#   prompt 3 pos 27: 2 -0.7257, 198 -0.7315 / 198 -0.6033, 2 -0.8689 / 198 -0.6521, 2 -0.8103
# Gemma 3 270M Q4_K_M as Engine.open converts it today (f16; mean 0.041, p90 0.082, max 0.593 nats).
# Not all near-ties in llama.cpp's own numbers: there llama.cpp is up to 0.57 nats off the exact
# forward, ours within 0.01:
#   prompt 1 pos 8:  85731 -3.4240, 217716 -3.4320 / 217716 -2.9925, 85731 -3.7300 / 217716 -2.9966, 85731 -3.7316
#   prompt 1 pos 10: 54973 -4.0950, 818 -4.5909 / 818 -4.5425, 106094 -4.5952 / 818 -4.5404, 54973 -4.6505
#   prompt 1 pos 30: 54973 -0.7750, 6974 -0.8006 / 6974 -0.7642, 54973 -0.8033 / 6974 -0.7638, 54973 -0.8039
#   prompt 3 pos 5:  221513 -3.4802, 148178 -3.5691 / 148178 -3.3549, 187013 -3.6049 / 148178 -3.3621, 221513 -3.6214
#   prompt 3 pos 7:  54973 -4.6273, 236769 -4.7957 / 8892 -4.9161, 236769 -4.9668 / 8892 -4.9145, 54973 -5.2208
# (positions past a prompt's first one are reached teacher-forced only). No other position may
# differ; a listed one that stops differing must be removed, a re-recording re-measured.
NEAR_TIES: dict[str, dict[int, dict[int, float]]] = {
    "SmolLM2-135M-Instruct.Q4_1": {0: {15: 0.0336}, 3: {9: 0.2292, 27: 0.0058}},
    "gemma-3-270m-q4_k_m": {1: {8: 0.0079, 10: 0.4959, 30: 0.0256}, 3: {5: 0.0888, 7: 0.1684}},
}


def their_gap(p: dict[str, Any], k: int) -> float:
    (_, first), (_, second) = p["top2"][k]
    return float(first - second)


async def teacher_forced_report(engine: Engine, rec: dict[str, Any], name: str, gguf: Path) -> list[str]:
    """Our greedy choice after every prefix of llama.cpp's greedy path, against its token there:
    equal everywhere but the listed positions, where the exact forward must pick our token."""
    problems = []
    exact = None
    for i, p in enumerate(rec["prompts"]):
        allowed = NEAR_TIES.get(name, {}).get(i, {})
        for k, theirs in enumerate(p["greedy"]):
            prefix = p["ids"] + p["greedy"][:k]
            (ours,) = (await engine.generate(prefix, max_tokens=1, temperature=0.0)).token_ids
            if ours == theirs and k not in allowed:
                continue
            top = await llama_oracle.top2_at(engine, prefix, theirs)
            where = (
                f"prompt {i} position {k}: llama.cpp chose {theirs}, ours {ours}; llama.cpp top-2 (id, logprob) "
                f"{p['top2'][k]}, ours {top['top2']}"
            )
            if ours == theirs:
                problems.append(f"{where}: listed in NEAR_TIES but equal now: remove it")
            elif k not in allowed:
                problems.append(f"{where}: not listed in NEAR_TIES")
            elif abs(their_gap(p, k) - allowed[k]) > 1e-3:
                problems.append(f"{where}: the recording's gap is not the listed {allowed[k]}: re-measure NEAR_TIES")
            else:
                exact = exact or gguf_oracle(gguf)
                row = exact.logits(prefix)[-1]
                if int(row.argmax()) != ours:
                    problems.append(f"{where}: the exact forward picks {int(row.argmax())}, not ours")
    return problems


async def free_running_report(engine: Engine, rec: dict[str, Any], name: str, *, chat: bool) -> list[str]:
    """Each prompt's own greedy run (on llama.cpp's prompt ids, or rendered by engine.chat) equals
    llama.cpp's up to its end or to a listed near-tie, where the two runs part."""
    problems = []
    for i, p in enumerate(rec["prompts"]):
        if chat:
            done = await engine.chat(p["messages"], max_tokens=rec["n_predict"], temperature=0.0)
            if done.usage.prompt_tokens != len(p["ids"]):
                n = done.usage.prompt_tokens
                problems.append(f"prompt {i}: engine.chat rendered {n} prompt tokens, llama.cpp {len(p['ids'])}")
        else:
            done = await engine.generate(p["ids"], max_tokens=rec["n_predict"], temperature=0.0)
        k = llama_oracle.first_divergence(p["greedy"], done.token_ids)
        if k is not None and k not in NEAR_TIES.get(name, {}).get(i, {}):
            problems.append(
                f"prompt {i}: greedy diverges at position {k} (not a listed near-tie): llama.cpp "
                f"{p['greedy'][k : k + 3]}, ours {done.token_ids[k : k + 3]}"
            )
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
# Gemma 3 270M Q4_K_M: exact 8.1797, ours (f16 conversion) 8.1810, llama.cpp 8.4087 (2.8% above
# exact: its quantized activations). There ours is held to the exact value instead, within 0.1%.
EXACT_PPL: dict[str, float] = {"gemma-3-270m-q4_k_m": 8.1797}


def check_perplexity(name: str, ours: dict[str, Any], rec: dict[str, Any]) -> None:
    theirs = rec["perplexity"]
    assert ours["ids_sha256"] == theirs["ids_sha256"], "the held-out text tokenizes differently"
    if name in EXACT_PPL:
        assert abs(theirs["ppl"] / EXACT_PPL[name] - 1) > PPL_TOLERANCE, "llama.cpp is near exact now: drop EXACT_PPL"
        assert abs(ours["ppl"] / EXACT_PPL[name] - 1) <= 0.001, (ours, EXACT_PPL[name])
    else:
        assert abs(ours["ppl"] / theirs["ppl"] - 1) <= PPL_TOLERANCE, (ours, theirs)


# ---- SmolLM2-135M-Instruct Q4_1: the demo -------------------------------------------------------


async def test_smollm2_tokens_match_llama_cpp(smollm2_path: Path, smollm2_gguf: Path) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    async with Engine.open(smollm2_path, max_batch_size=1) as engine:
        await check_tokens(engine, rec, smollm2_gguf)


@pytest.mark.timeout(900)  # every position teacher-forced, the float64 forward at the listed ones
async def test_smollm2_greedy_matches_llama_cpp(smollm2_path: Path, smollm2_gguf: Path) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    async with Engine.open(smollm2_path, max_batch_size=1) as engine:
        assert await free_running_report(engine, rec, SMOLLM2, chat=False) == []
        assert await teacher_forced_report(engine, rec, SMOLLM2, smollm2_gguf) == []


async def test_smollm2_chat_matches_llama_cpp(smollm2_path: Path, smollm2_gguf: Path) -> None:
    """engine.chat renders with our own template: the same prompt length and greedy ids as llama.cpp's."""
    rec = recording(SMOLLM2, smollm2_gguf)
    async with Engine.open(smollm2_path, max_batch_size=1) as engine:
        assert await free_running_report(engine, rec, SMOLLM2, chat=True) == []


def test_smollm2_perplexity_within_1_percent_of_llama_cpp(smollm2_path: Path, smollm2_gguf: Path) -> None:
    rec = recording(SMOLLM2, smollm2_gguf)
    check_perplexity(SMOLLM2, perplexity(smollm2_path, rec, add_bos=False), rec)


# ---- Gemma 3 270M Q4_K_M (issue 17's real model) -------------------------------------------------

# The near-ties below were measured on the f16 conversion. The K-quant blocks kept as they are
# (dtype "auto", the default since the K-quant types landed) diverge from llama.cpp at other
# near-ties (e.g. prompt 3 pos 5, a three-way tie within 0.11 nats where neither engine picks the
# exact forward's token): to be re-measured with its own rule, so this file pins f16 for now.
GEMMA3_DTYPE = "f16"


async def test_gemma3_tokens_match_llama_cpp(gemma3_gguf: Path) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with Engine.open(gemma3_gguf, max_batch_size=1, dtype=GEMMA3_DTYPE) as engine:
        await check_tokens(engine, rec, gemma3_gguf)


@pytest.mark.timeout(900)  # every position teacher-forced, the float64 forward at the listed ones
async def test_gemma3_greedy_matches_llama_cpp(gemma3_gguf: Path) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with Engine.open(gemma3_gguf, max_batch_size=1, dtype=GEMMA3_DTYPE) as engine:
        assert await free_running_report(engine, rec, GEMMA3, chat=False) == []
        assert await teacher_forced_report(engine, rec, GEMMA3, gemma3_gguf) == []


async def test_gemma3_chat_matches_llama_cpp(gemma3_gguf: Path) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    async with Engine.open(gemma3_gguf, max_batch_size=1, dtype=GEMMA3_DTYPE) as engine:
        assert await free_running_report(engine, rec, GEMMA3, chat=True) == []


def test_gemma3_perplexity_within_1_percent_of_llama_cpp(gemma3_gguf: Path) -> None:
    rec = recording(GEMMA3, gemma3_gguf)
    bundle = resolve_model(gemma3_gguf, dtype=GEMMA3_DTYPE, progress=False)
    check_perplexity(GEMMA3, perplexity(bundle, rec, add_bos=True), rec)
