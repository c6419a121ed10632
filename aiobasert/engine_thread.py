"""The engine thread: the one thread that owns the model handle.

Every libbaseRT call of the model handle happens here. The thread loads and
configures the model, drains a thread-safe inbox (`_core.protocol` messages:
requests, cancellations, queries, calls, close), asks the batcher for the next
step, has the `_core.step.StepRunner` run ONE fused batch step over every
active lane, passes each lane's token through `_core.output.OutputProcessor`
(text, stops, finish), and hands the whole step's output to the event loop in
one wake-up. With nothing to do it blocks on the inbox: no spinning, and a new
request wakes it at once.

Each request has one record from its arrival to its end (`_core.request.Request`,
in `Requests`), whose status says where it is: preparing (`_core.prepare.Preparer`:
its prompt tokenized and its grammar compiled on the intake workers, never here),
waiting, running, paused, then finished with its reason. Prepared, it gets a lane.
An embedding is the same record of the pooling kind, with a lane as well
(`EmbedLane`): its input is fed chunk by chunk in those same steps and pooled from
hidden-state taps (`_core.embed.Embedder` decides that path), so it never stalls
the running streams, and it is admitted, released, ended and delivered as a
generation is. This module is the lanes' one writer: `_admit` (its sequence, when
the batcher gives it a lane), `_release` (all it holds in the engine) and `_end`
(its one way out, whatever the reason), each one function for every kind.

Teardown order matters: a lane's engine sequence is freed (rolled back first
when it was cancelled) before its bookkeeping is dropped, never after. A
request's trouble (bad input, a grammar that raises, a bug in its sampling)
costs that request only; the thread itself never dies of a request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from ctypes import byref, c_int
from typing import TYPE_CHECKING, Any

from . import _ffi
from ._core import loaded as _loaded
from ._core.draft_model import open_drafter
from ._core.embed import Embedder
from ._core.intake import Intake, Tokenizer
from ._core.loaded import LoadedModel
from ._core.model_file import ModelFile
from ._core.output import Detokenizer, OutputProcessor
from ._core.prepare import Preparer
from ._core.protocol import (
    Ask,
    Call,
    Cancel,
    Close,
    Constraint,
    Decode,
    Done,
    Embed,
    EvictPrefixCache,
    Message,
    Notify,
    Prepared,
    Query,
    Release,
    Reserve,
    Stats,
    StreamOutput,
    Submit,
)
from ._core.request import Request, RequestStatus
from ._core.speculate import Drafter, SpecPolicy
from ._core.step import EmbedLane, Lane, Requests, RowResult, Sampled, StepRunner, TapPooler, internal_error
from .batcher import Batcher
from .chat import default_template
from .config import EngineConfig
from .errors import (
    AioBaseRTError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
)
from .types import EngineStats, ModelInfo, Token

if TYPE_CHECKING:  # numpy (embeddings): imported on first use only
    import numpy as np

_FAIRNESS_ENV = "AIOBASERT_ADMISSION"
"""Set to fifo for plain FIFO admission without preemption: the baseline of bench/fair_admission.py."""


log = logging.getLogger("aiobasert")


class EngineThread:
    """Owns the model handle; everything below runs on this thread only."""

    def __init__(self, lib: _ffi.Library, model_path: str, cfg: EngineConfig, notify: Notify) -> None:
        self.lib = lib
        self.model_path = model_path  # the resolved `.base` bundle
        self.cfg = cfg
        self._notify = notify  # LoopWaker.call_soon: fire-and-forget onto the loop
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="aiobasert-engine", daemon=True)
        self._model: int | None = None
        self.requests = Requests()  # every request the thread holds, from its arrival to its end
        self._dirty: dict[str, Lane | EmbedLane] = {}  # lanes with output for this step's delivery
        self._closing = False
        self._abort = False
        self._load_cancelled = threading.Event()  # set by a cancelled Engine.open: the load stops at its next phase
        self.intake: Intake | None = None
        self._reserved = 0  # queue places held for fan-outs about to be submitted (Reserve / Release)
        self.steps = 0
        self.models_freed = 0
        self.live_sequences = 0
        self.ended: Counter[RequestStatus] = Counter()
        """Generations ended, by their final status (`EngineStats.requests_finished` & co.)."""
        self.thread_id: int | None = None
        spec = cfg.speculation
        self.drafter: Drafter | None = None
        """Where draft tokens come from (speculative decoding, `EngineConfig.speculation`); None: off."""
        self.spec_policy = SpecPolicy(adaptive=spec.adaptive if spec is not None else True)
        self.spec_drafted = 0
        self.spec_accepted = 0
        self._step_drafts = 0
        """Draft tokens planned so far in the step being planned (`_draft`)."""

    # ---- loop-side API (thread-safe) --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def post(self, msg: Message) -> None:
        self._inbox.put(msg)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def cancel_load(self) -> None:
        """Nobody will hold this engine (its open was cancelled): the load ends at its next phase."""
        self._load_cancelled.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def finished(self) -> int:
        """Generations that ended on a stop or at their length."""
        return self.ended[RequestStatus.FINISHED_STOPPED] + self.ended[RequestStatus.FINISHED_LENGTH]

    @property
    def cancelled(self) -> int:
        """Generations cancelled (their reader left) or aborted by the close."""
        return self.ended[RequestStatus.FINISHED_ABORTED]

    @property
    def failed(self) -> int:
        """Generations that failed once they had a lane."""
        return self.ended[RequestStatus.FINISHED_ERROR]

    # ---- main loop: load, then serve ------------------------------------------------------

    def _main(self) -> None:
        self.thread_id = threading.get_ident()
        self.lib.bind_thread()
        try:
            # loaded here, on this thread: the handle is this thread's from now on
            self._take(_loaded.load(self.lib, self.model_path, self.cfg, self._load_cancelled))
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.stopped.set_result(None)
            return
        self.ready.set_result(self.loaded.info)
        try:
            self._serve()
        finally:
            try:
                self._shutdown()
            finally:
                self.stopped.set_result(None)

    def _take(self, model: LoadedModel) -> None:
        """Serve `model`: the parts that serve it are built from what it is and can do
        (`model.caps`, asked once at load; none of them asks the library again). The model's
        file is opened for the host here, once (`ModelFile`), and handed to what reads it."""
        lib, cfg, handle, caps = self.lib, self.cfg, model.handle, model.caps
        self.loaded = model
        self._model = handle
        try:
            self.drafter = open_drafter(lib, model, cfg)  # a draft model loads here, beside the target
            self.detok = Detokenizer(lib, handle)
            self.output = OutputProcessor(lib, handle, self.detok)
            self.runner = StepRunner(
                lib,
                handle,
                caps,
                vocab_size=model.vocab_size,
                stride=model.logits_stride,
                # a verify lane leaves 1 + drafts logits rows (at most 8 a lane: the engine's scratch)
                max_rows=model.max_batch_size * (8 if self._speculating(caps) else 1),
                token_text=self.detok.token_text,
            )
            self.batcher = Batcher(
                max_batch_size=model.max_batch_size,
                max_context=model.max_context,
                prefill_budget=model.prefill_budget,
                max_queue=cfg.max_queue,
                page_size=model.page_size,
                prefix_cache=caps.prefix_cache,
                tap_budget=caps.tap_capacity or None,
                fair=os.environ.get(_FAIRNESS_ENV, "fair") != "fifo",
                kv_blocks=model.kv_blocks,
            )
            if cfg.speculation is not None:
                self.batcher.max_drafts = cfg.speculation.num_speculative_tokens
            # a GGUF without a template (Gemma 3 270M): its family's, by the vocabulary
            # the config's template (`--chat-template`) over the model's own
            self.chat_template = cfg.chat_template or model.chat_template or default_template(model.special_tokens)
            self.tokenizer = Tokenizer.borrow(lib, handle, model.path)  # the model handle's own, this thread only
            model_file = ModelFile(model.path)
            self.prep = Preparer(
                lib,
                model_file,
                caps=caps,
                grammar_reset=model.grammar_reset,
                vocab_size=model.vocab_size,
                max_context=model.max_context,
                intake=model.intake,
                # an engine without a separate tokenizer handle: prepared here, between steps
                inline=self.tokenizer if model.intake is None else None,
                post=self.post,
            )
            self.embedder = Embedder(
                lib,
                handle,
                model_file,
                dim=model.info.dim,
                n_layers=model.info.n_layers,
                norm_eps=model.norm_eps,
                vocab_size=model.vocab_size,
                max_context=model.max_context,
                tap_budget=caps.tap_capacity or None,
            )
            if model.intake is not None and cfg.grammar_backend_at_open and self.prep.host_grammar_installed():
                _loaded.check_cancelled(self._load_cancelled, "the engine's configuration")
                self.prep.build_host_grammar(model.intake)
            _loaded.check_cancelled(self._load_cancelled, "the load")
        except BaseException:
            self._free_model()
            if model.intake is not None:
                model.intake.close()
            raise
        self.intake = model.intake

    def _speculating(self, caps: Any) -> bool:
        """Speculation is configured and the engine verifies several rows a lane; an engine
        without `baseRT_batch_step_fused_logits_rows` decodes plainly (the same tokens)."""
        if self.drafter is not None and not caps.multi_row_verify:
            self.drafter.close()  # a draft model, loaded for nothing
            self.drafter = None
        return self.drafter is not None

    def _serve(self) -> None:
        while self._step():
            pass

    # ---- one step -----------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step, as vLLM v1's `EngineCore.step` (schedule -> execute -> update):

        1. drain the inbox: requests, cancels, queries, close (blocks when idle);
        2. plan: the batcher admits waiting requests (`_admit` creates their
           sequences) and picks each running lane's row (`plan.StepPlan`);
        3. run: `StepRunner.run` = prepare -> ONE fused forward -> collect;
        4. apply: each lane's `RowResult` is applied here, the lanes' one writer
           (tokens through `OutputProcessor`, finish, failure, freeing);
        5. deliver: everything the step produced reaches the loop in one wake-up.

        False once the engine is closed (drained, or aborted)."""
        idle = not self.batcher.has_runnable_work()
        self._drain(block=idle and not (self._closing and not self.requests))
        # a drain serves the requests still being prepared too; an abort has answered them
        if self._closing and (self._abort or not self.requests):
            return False
        if self.batcher.has_runnable_work():
            self.steps += 1
            try:
                draft = self._draft if self.drafter is not None else None
                self._step_drafts = 0
                if self.drafter is not None:  # a draft model's steps, all lanes at once
                    self._before_plan(self.drafter)
                plan = self.batcher.plan(self._admit, release=self._release_kv, draft=draft)
                if plan.rows:
                    began = time.perf_counter()
                    results = self.runner.run([(self.requests.of(r.lane), r) for r in plan.rows])
                    for result in results:
                        self._apply(result)
                    if draft is not None:  # what a row costs (verify rows' sampling and rollback included)
                        self.spec_policy.cost.add(
                            sum(r.tokens for r in plan.rows), time.perf_counter() - began, plan.drafts > 0
                        )
            except Exception as exc:  # last resort: a bug outside any one lane costs the running lanes
                self._fail_running(internal_error("in the engine step", exc), waiting=True)
        self._deliver()
        return True

    def _apply(self, result: RowResult) -> None:
        """Apply one lane's part of the step (the engine thread is the only writer of a lane)."""
        lane, row = result.lane, result.row
        if lane.state.status.is_finished:  # ended earlier in this step
            return
        if result.error is not None:
            self._end(lane.state, RequestStatus.FINISHED_ERROR, error=result.error)
            return
        if row.kind != "decode":
            lane.state.prefilled += row.tokens
        if isinstance(lane, EmbedLane):
            if result.pooled is not None:
                lane.add(result.pooled)
            self._pooled(lane)
        elif result.sampled is not None:
            self._apply_token(lane, result.sampled)
            if row.drafts:
                self._verify(lane, row.drafts, result.first_row, result.verified)

    def _draft_caps(self) -> list[tuple[Lane, int]]:
        """The running generation lanes and how many drafts each may feed (`Batcher.draft_cap`)."""
        lanes = (self.requests.lane(st.rid) for st in self.batcher.running)
        return [(lane, self.batcher.draft_cap(lane.state)) for lane in lanes if isinstance(lane, Lane)]

    def _draft(self, state: Request, cap: int, rows: int, lanes: int) -> int:
        """How many drafts a decode lane feeds this step (`Batcher.schedule` asks), and which
        (`Lane.drafts`): the drafter's proposal, cut where the policy says a row stops paying."""
        lane = self.requests.lane(state.rid)
        if not isinstance(lane, Lane) or lane.speculation is None or self.drafter is None:
            return 0
        weighed = self.drafter.weighed
        if not weighed and not self.spec_policy.ask(lane.speculation, rows, lanes):
            return 0  # its shadow (if any) is still scored as it generates
        try:
            proposal = self.drafter.propose(lane, cap)[:cap]
        except Exception:  # a drafter's bug costs speed, never a request
            return 0
        vocab = self.loaded.vocab_size
        for i, tok in enumerate(proposal):  # an id the engine would refuse would fail the whole step
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                proposal = proposal[:i]
                break
        first = not self._step_drafts  # the first lane to draft in the step pays its verify overhead
        k = len(proposal) if weighed else self.spec_policy.depth(lane.speculation, len(proposal), rows, lanes, first)
        self._step_drafts += k
        lane.drafts = proposal[:k]
        lane.speculation.shadow = [] if k else proposal  # a proposal not verified is scored for free
        return k

    def _verify(self, lane: Lane, fed: int, first_row: int, verified: tuple[int, ...] | None = None) -> None:
        """The rest of a verify row, after its first token was applied: draft j is accepted
        when the token chosen at its row equals it, and then row j + 1 gives the next token
        (chosen with the accepted drafts counted as generated, exactly as a plain step would
        choose it); the first mismatch (or the lane's end) stops it, and the sequence is rolled
        back to what was accepted: no KV past the output, none past a stop."""
        drafts, lane.drafts = lane.drafts[:fed], []
        spec = lane.speculation
        assert spec is not None
        # counted as they happen: the lane's usage is written when a token in the run ends it
        spec.drafted += fed
        spec.verified += 1
        self.spec_drafted += fed
        accepted = 0
        for j, tok in enumerate(drafts):
            if lane.state.status.is_finished or lane.generated[-1] != tok:
                break
            accepted += 1
            spec.accepted += 1
            self.spec_accepted += 1
            if verified is not None:  # sampled in the engine with drafts[:j + 1] counted as generated
                self._apply_token(lane, Sampled(verified[j]))
                continue
            try:
                sampled = self.runner.verify_row(lane, first_row + j + 1)
            except AioBaseRTError as exc:
                self._end(lane.state, RequestStatus.FINISHED_ERROR, error=exc)
                break
            self._apply_token(lane, sampled)
        spec.observe(accepted, accepted < fed)
        self.spec_policy.observe(accepted, accepted < fed)
        if not lane.state.status.is_finished and lane.seq is not None:
            self._rollback_drafts(lane)

    def _rollback_drafts(self, lane: Lane) -> None:
        """Drop the KV of drafts that were fed but not accepted: the sequence holds the prompt
        and the output but its last token (which is fed next), as after a plain step."""
        assert lane.seq is not None
        keep = len(lane.prompt) + len(lane.generated) - 1
        rc = self.lib.baseRT_sequence_rollback(lane.seq, keep)
        if rc != 0:
            self._end(lane.state, RequestStatus.FINISHED_ERROR, error=self.lib.last_error("baseRT_sequence_rollback"))

    def _apply_token(self, lane: Lane, sampled: Sampled) -> None:
        try:
            out = self.output.process(lane, sampled.token, sampled.logprob, sampled.top_logprobs)
        except AioBaseRTError as exc:
            self._end(lane.state, RequestStatus.FINISHED_ERROR, error=exc)
            return
        except Exception as exc:  # a bug in one lane's output costs that lane only
            self._end(lane.state, RequestStatus.FINISHED_ERROR, error=internal_error("processing the output", exc))
            return
        if not lane.generated:
            lane.first_token_at = time.monotonic()
            lane.first_token_step = self.steps
        lane.generated.append(out.token.id)
        lane.state.generated += 1
        if lane.speculation is not None:
            lane.speculation.on_token(out.token.id)
        self._emit(lane, out.token)
        if out.finish is not None:
            self._end(lane.state, RequestStatus.finished(out.finish))

    def _fail_running(self, exc: AioBaseRTError, *, waiting: bool = False) -> None:
        """End the running requests with `exc`; with `waiting`, where none was running (the step
        failed before any lane ran, and would again every step while they wait: a busy loop no
        reply ends), the waiting ones too."""
        ended = list(self.batcher.running)
        if waiting and not ended:
            ended = [*self.batcher.waiting, *self.batcher.paused]
        for req in ended:
            self._end(req, RequestStatus.FINISHED_ERROR, error=exc)

    def _before_plan(self, drafter: Drafter) -> None:
        """The drafter's work before the plan; a drafter that fails there is closed and the engine
        decodes on without speculation (drafts only change speed: no request is lost to one)."""
        try:
            drafter.before_plan(self._draft_caps, self.spec_policy)
        except Exception:
            log.exception("the drafter failed; speculative decoding is off for this engine from here on")
            self.drafter = None
            try:
                drafter.close()
            except Exception:
                log.exception("closing the failed drafter")

    # ---- the inbox: each message by its type -------------------------------------------------

    def _drain(self, *, block: bool) -> None:
        try:
            msg = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        """One inbox message, by its type."""
        if isinstance(msg, Submit):
            self._on_submit(msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(msg)
        elif isinstance(msg, Embed):
            self._on_embed(msg)
        elif isinstance(msg, Prepared):
            self._on_prepared(msg)
        elif isinstance(msg, Ask):
            self._run_for(msg.done, lambda: self._answer(msg.query))
        elif isinstance(msg, Call):
            self._run_for(msg.done, msg.fn)
        elif isinstance(msg, Release):
            self._reserved -= msg.count
        else:
            self._on_close(msg)

    def _run_for(self, done: Done, fn: Callable[[], Any]) -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        self._notify(done, result, error)

    def _answer(self, query: Query) -> Any:
        """A query's answer, read between two steps."""
        if isinstance(query, Stats):
            return self.stats()
        if isinstance(query, EvictPrefixCache):
            return self.evict_prefix_cache()
        if isinstance(query, Decode):
            return self.decode_ids(query.ids)
        if isinstance(query, Reserve):
            return self._reserve(query.count)
        return self.encode_text(query.text, special=query.special)

    def _reserve(self, count: int) -> int:
        """Hold `count` queue places, all or none: the last of them must still fit."""
        if self._closing:
            raise EngineClosedError("the engine is closing")
        try:
            self.batcher.check_room(self.prep.preparing + self._reserved + count - 1)
        except EngineOverloadedError:
            b = self.batcher
            free = max(0, b.max_batch_size - len(b.running))
            room = b.max_queue + free - len(b.waiting) - len(b.paused) - self.prep.preparing - self._reserved
            raise EngineOverloadedError(
                f"request queue has room for {max(0, room)} of this request's {count} generations; retry later"
            ) from None
        self._reserved += count
        return count

    def _on_cancel(self, msg: Cancel) -> None:
        """The request's reader left: it ends now, wherever it is (still prepared: its
        preparation's result is dropped when it returns)."""
        req = self.requests.get(msg.rid)
        if req is not None and not req.status.is_finished:
            self._end(req, RequestStatus.FINISHED_ABORTED, tell=False)

    def _on_prepared(self, msg: Prepared) -> None:
        req = self.prep.returned(msg.msg.rid)
        if req.status.is_finished:  # answered while it was prepared: it held its queue place until now
            self.requests.pop(req.rid)
        if isinstance(msg.msg, Submit):
            self._enqueue(req, msg.msg, msg.result, msg.error)
        else:
            self._enqueue_embed(req, msg.msg, msg.result, msg.error)

    def _on_close(self, msg: Close) -> None:
        self._closing = True
        # Lanes nobody can read any more are cancelled; the others run to
        # their own end (bounded by max_tokens / the context: no lane ever
        # waits for its reader).
        for lane in self.requests.lanes():
            if not lane.sink.alive():
                self._end(lane.state, RequestStatus.FINISHED_ABORTED, tell=False)
        if msg.abort:
            self._abort = True
            self._abort_all()

    def _abort_all(self) -> None:
        """End every live request now, those still being prepared included (an abort waits for no
        compile): a generation with its "aborted" finish, an embedding with EngineClosedError."""
        for req in self.requests.live():
            if req.status is RequestStatus.PREPARING:
                closed = EngineClosedError("the engine was closed before the request started")
                prep = self.prep.message(req.rid)
                if prep is not None:
                    self._notify(prep.answer, closed)
            else:
                closed = EngineClosedError("the engine was closed before the embedding finished")
            self._end(req, RequestStatus.FINISHED_ABORTED, error=closed)

    # ---- requests in, through their preparation (`_core.prepare`), out as lanes ---------------

    def _arrive(self, rid: str, *, embed: bool) -> Request | AioBaseRTError:
        """A request's record, PREPARING, once its queue place is held; why it is refused when the
        engine closes or its queue is full."""
        if self._closing:
            return EngineClosedError("the engine is closing")
        try:  # refused before any work is spent on it; its queue slot is held while it is prepared
            self.batcher.check_room(self.prep.preparing + self._reserved)
        except EngineOverloadedError as exc:
            return exc
        req = Request(rid=rid, prompt_len=0, max_new_tokens=0, embed=embed)
        self.requests.add(req)
        return req

    def _on_submit(self, msg: Submit) -> None:
        """A request goes to its preparation, refused first when the engine closes or its queue is full."""
        req = self._arrive(msg.rid, embed=False)
        if not isinstance(req, Request):
            self._notify(msg.answer, req)
            return
        checked = self.prep.submit(msg, req)
        if checked is not None:  # a prompt of ids, nothing to prepare: straight into the FIFO
            ids, error = checked
            self._enqueue(req, msg, (ids, None), error)

    def _enqueue(self, req: Request, msg: Submit, prepared: Any, error: BaseException | None) -> None:
        """A prepared request joins the FIFO queue (or is answered with its error). A request
        answered while it was prepared (cancelled, or an abort) is finished: its result is dropped."""
        spec = msg.spec
        dropped = req.status.is_finished
        constraint: Constraint | None = None
        try:
            if error is not None:
                if dropped:  # nobody to tell
                    return
                raise error
            if prepared is None:  # its reader had left before the work began
                if not dropped:
                    self._end(req, RequestStatus.FINISHED_ABORTED, tell=False)
                return
            prompt, constraint = prepared
            if constraint is not None:
                self.prep.adopt(constraint)
            if self._closing and self._abort:
                raise EngineClosedError("the engine was closed before the request started")
            if dropped or not msg.sink.alive():  # cancelled while it was prepared: nobody to serve
                if constraint is not None:
                    self.prep.close_constraint(constraint, spec.cost.grammar_key)
                if not dropped:
                    self._end(req, RequestStatus.FINISHED_ABORTED, tell=False)
                return
            max_new = self.batcher.resolve_max_tokens(len(prompt), spec.params.max_tokens)
            lane = Lane(spec, msg.sink, msg.ticket, prompt, max_new, constraint, state=req)
            lane.submitted_step = self.steps
            if self.drafter is not None and spec.params.speculation:
                lane.speculation = self.spec_policy.new_lane()
            self.batcher.enqueue(req, reserved=True)
        except BaseException as exc:
            if constraint is not None:  # refused after its grammar was built: free it
                self.prep.close_constraint(constraint, spec.cost.grammar_key)
            err = exc if isinstance(exc, AioBaseRTError) else internal_error("at intake", exc)
            self._notify(msg.answer, err)
            if not dropped:
                self._end(req, RequestStatus.FINISHED_ERROR)
            if not isinstance(exc, Exception):
                raise
            return
        self.requests.attach(lane)

    # ---- embeddings in, as lanes (`_core.embed`: their paths) -------------------------------

    def _on_embed(self, msg: Embed) -> None:
        """A text input is tokenized by the intake workers first; ids go straight on."""
        req = self._arrive(msg.rid, embed=True)
        if not isinstance(req, Request):
            self._notify(msg.answer, req)
            return
        if isinstance(msg.source, str):
            self.prep.submit_embed(msg, msg.source, req)
        else:
            self._enqueue_embed(req, msg, list(msg.source), None)

    def _enqueue_embed(self, req: Request, msg: Embed, ids: Sequence[int] | None, error: BaseException | None) -> None:
        """Validate an embedding and queue it as a lane (or, without taps, run it now)."""
        if req.status.is_finished:  # cancelled or aborted while it was tokenized: already answered
            return
        try:
            if error is not None:
                raise error
            if self._closing and self._abort:
                raise EngineClosedError("the engine was closed before the embedding started")
            assert ids is not None
            if not ids:
                raise InvalidRequestError("cannot embed an empty input")
            if len(ids) > self.loaded.max_context:
                raise InvalidRequestError(
                    f"input of {len(ids)} tokens exceeds the context window of {self.loaded.max_context} tokens"
                )
            if self._embed_path() is None:  # one atomic forward, between two steps (as before taps)
                self._notify(msg.done, self.embedder.embed(ids), None)
                self._end(req, RequestStatus.FINISHED_STOPPED)
                return
            lane = EmbedLane(msg.rid, ids, self.loaded.info.dim, msg.done, msg.client, state=req)
            self.batcher.enqueue(req, reserved=True)
        except BaseException as exc:
            err = exc if isinstance(exc, AioBaseRTError) else internal_error("at intake", exc)
            self._notify(msg.answer, err)
            self._end(req, RequestStatus.FINISHED_ERROR)
            if not isinstance(exc, Exception):
                raise
            return
        self.requests.attach(lane)

    def _embed_path(self) -> TapPooler | None:
        """The tapped (chunked) embedding path the step runner pools with, or None for one baseRT_embed call."""
        pooler = self.embedder.path()
        self.runner.pooler = pooler
        return pooler

    def _pooled(self, lane: EmbedLane) -> None:
        """An embedding's chunk was pooled: once all of its input is, it ends with its mean."""
        if lane.state.prefilling:
            return
        if lane.finite:
            self._end(lane.state, RequestStatus.FINISHED_STOPPED, result=lane.mean())
            return
        # The tapped hidden state overflowed f16: this input needs the f32 path (its sequence freed first).
        self._free_sequence(lane, keep_kv=False)
        try:
            result = self.embedder.embed(lane.ids)
        except AioBaseRTError as exc:
            self._end(lane.state, RequestStatus.FINISHED_ERROR, error=exc)
            return
        self._end(lane.state, RequestStatus.FINISHED_STOPPED, result=result)

    # ---- queries answered between steps (engine thread) ----------------------------------

    def encode_text(self, text: str, *, special: bool) -> list[int]:
        return self.tokenizer.encode_text(text, special=special)[:]

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        return self.tokenizer.encode_pieces(pieces)[:]

    def token_bytes(self, tok: int) -> bytes:
        return self.detok.token_bytes(tok)

    def decode_ids(self, ids: Sequence[int]) -> str:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.loaded.vocab_size:
                raise InvalidRequestError(f"{t!r} is not a token id of this model (vocab {self.loaded.vocab_size})")
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def stats(self) -> EngineStats:
        ms = _ffi.BaseRTMemoryStats()
        if not self.lib.baseRT_model_memory_stats(self._model, byref(ms)):
            raise self.lib.last_error("baseRT_model_memory_stats")
        cached = c_int(0)
        if self.loaded.prefix_stats:
            self.lib.baseRT_prefix_cache_stats(self._model, None, None, None, byref(cached))
        live = Counter(req.status for req in self.requests.records())
        return EngineStats(
            steps=self.steps,
            active_lanes=live[RequestStatus.RUNNING],
            waiting_requests=live[RequestStatus.WAITING] + live[RequestStatus.PAUSED],
            live_sequences=self.live_sequences,
            live_grammars=self.prep.live_grammars,
            kv_blocks_total=int(ms.kv_cache_blocks_total),
            kv_blocks_used=int(ms.kv_cache_blocks_used),
            prefix_blocks_cached=int(cached.value),
            requests_finished=self.finished,
            requests_cancelled=self.cancelled,
            requests_failed=self.failed,
            kv_cache_bytes=int(ms.kv_cache_capacity_bytes),
            engine_bytes=int(ms.runtime_allocated_bytes),
            requests_preempted=self.batcher.preemptions,
            paused_requests=live[RequestStatus.PAUSED],
            requests_recomputed=self.batcher.recomputes,
            spec_draft_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
            draft_live_sequences=self.drafter.live if self.drafter is not None else 0,
            draft_cached_tokens=self.drafter.reused if self.drafter is not None else 0,
        )

    def evict_prefix_cache(self) -> int:
        if self.drafter is not None:  # a draft model's cache goes too (its blocks not counted)
            self.drafter.evict_cache()
        if not self.loaded.prefix_evict:
            return 0
        return int(self.lib.baseRT_prefix_evict(self._model, 1 << 30))

    # ---- a request's life: admitted, released, ended (one function each, every kind) -----

    def _admit(self, req: Request) -> None:
        """A request was given a lane (`Batcher.plan`): its engine sequence, before its first row
        (a paused one resumes with the sequence it kept; one whose KV was released gets a new one,
        seeded from the prefix cache where the batcher says so)."""
        lib, model = self.lib, self._model
        lane = self.requests.of(req)
        if lane.seq is not None:  # a paused request resumes: its sequence and KV were kept
            return
        resumed = lane.admitted_step >= 0  # recomputed: its first admission's timing and usage stay
        if not resumed:
            lane.admitted_step = self.steps
            lane.admitted_at = time.monotonic()
        match = None
        if self.batcher.should_match_prefix(req):
            match = lib.baseRT_prefix_match(model, lane.fed_array(), req.kv_target)
            if not match.handle:
                match = None
        seq = lib.baseRT_sequence_create(model)
        if not seq:
            err = lib.last_error("baseRT_sequence_create")
            if match is not None:
                lib.baseRT_prefix_release(model, match.handle)
            self._end(req, RequestStatus.FINISHED_ERROR, error=err)
            return
        lane.seq = seq
        self.live_sequences += 1
        if match is not None:  # a generation (an embedding pools every row: it matches no prefix)
            rc = lib.baseRT_sequence_seed_prefix(seq, match.blocks, match.n_blocks, match.matched_tokens)
            if rc == 0:
                lane.prefix_handle = int(match.handle)
                req.prefilled = int(match.matched_tokens)
                if not resumed:
                    lane.cached = req.prefilled
            else:
                lib.baseRT_prefix_release(model, match.handle)

    def _bound_prefix_cache(self) -> None:
        """Evict the least recently used cached prefixes past the bound (`EngineConfig.prefix_cache_mb`)
        after a lane's blocks went to the cache or back to the pool; blocks a live request shares
        with the cache stay until it ends."""
        bound = self.loaded.prefix_bound
        if bound is None:
            return
        cached = c_int(0)
        self.lib.baseRT_prefix_cache_stats(self._model, None, None, None, byref(cached))
        if cached.value > bound:
            self.lib.baseRT_prefix_evict(self._model, cached.value - bound)

    def _release_kv(self, state: Request) -> None:
        """A paused request's KV must make room (`Batcher._make_room`): it goes to the prefix
        cache (so its recompute prefills little) and its sequence is freed; the request keeps
        its output, stream and grammar state, and resumes from prompt + output."""
        self._free_sequence(self.requests.of(state), keep_kv=True)

    def _free_sequence(self, lane: Lane | EmbedLane, *, keep_kv: bool) -> None:
        """Free a lane's engine sequence and its prefix-cache lock. `keep_kv`: its KV goes to the
        prefix cache where the batcher publishes it (else it is rolled back first)."""
        lib, model = self.lib, self._model
        if lane.seq is not None:
            kv = lane.kv_tokens() if keep_kv else None  # a C array: no request-sized Python list here
            if kv is not None and lane.speculation is not None:  # ended on an accepted draft: drop the rest
                lib.baseRT_sequence_rollback(lane.seq, len(kv))
            if kv is not None and self.batcher.should_publish_prefix(lane.state, len(kv)):
                lib.baseRT_prefix_insert(model, kv, len(kv), lane.seq)  # best effort
            else:
                lib.baseRT_sequence_rollback(lane.seq, 0)
            lib.baseRT_sequence_free(lane.seq)
            lane.seq = None
            self.live_sequences -= 1
        if self.drafter is not None and lane.speculation is not None:
            # its draft sequence goes with it, its KV to the draft's prefix cache when the lane's goes to the target's
            self.drafter.release(lane.speculation, publish=keep_kv and not lane.state.cancelled)
        if lane.prefix_handle:
            lib.baseRT_prefix_unlock(model, lane.prefix_handle)
            lane.prefix_handle = 0

    def _emit(self, lane: Lane, token: Token) -> None:
        lane.pending.append(token)
        lane.ticket.delivered += 1
        self._dirty[lane.rid] = lane

    def _release(self, lane: Lane | EmbedLane) -> None:
        """Return everything an ended request's lane holds in the engine: its sequence (a
        generation's KV that stopped or ran to its length may serve a later prompt; a cancelled,
        aborted or failed one's, and an embedding's, is dropped) and its grammar."""
        self._free_sequence(lane, keep_kv=lane.state.status.finish_reason in ("stop", "length"))
        # bounded when a request ends: a paused request's KV is its sequence's, not the cache's
        self._bound_prefix_cache()
        if lane.constraint is not None:
            constraint, lane.constraint = lane.constraint, None
            self.prep.close_constraint(constraint, lane.grammar_key)

    def _end(
        self,
        req: Request,
        status: RequestStatus,
        *,
        error: BaseException | None = None,
        result: np.ndarray | None = None,
        tell: bool = True,
    ) -> None:
        """The one way a request ends, wherever it is and whatever the reason (`status`): out
        of the batcher's queues, finished, its lane released, its end handed to the loop with
        the step's other output (a generation's final or error, an embedding's `result` or
        `error`; nothing when not `tell`: its reader left), and forgotten. A request without a
        lane (still prepared, or refused at intake) is answered by its caller; one whose
        preparation is still out stays held, finished, until it returns (its queue place).

        Generations are counted by their final status; one refused at intake is refused, not
        failed (it never had a lane)."""
        lane = self.requests.lane(req.rid)
        if self.batcher.holds(req):
            self.batcher.remove(req)
        req.move(status)
        if not req.embed and (lane is not None or status is not RequestStatus.FINISHED_ERROR):
            self.ended[status] += 1
        if lane is not None:
            self._release(lane)
            if tell:
                if isinstance(lane, EmbedLane):
                    lane.result, lane.error = result, error
                elif status is RequestStatus.FINISHED_ERROR:
                    lane.error = error
                else:
                    lane.final = self.output.final(lane, status.finish_reason or "aborted", self.steps)
                self._dirty[lane.rid] = lane
        if not self.prep.holds(req.rid):
            self.requests.pop(req.rid)

    def _deliver(self) -> None:
        """One wake-up of the loop for everything this step produced."""
        if not self._dirty:
            return
        batch = [lane.output() for lane in self._dirty.values()]
        self._dirty = {}
        self._notify(_deliver_batch, batch)

    def _shutdown(self) -> None:
        self._abort_all()
        self._deliver()
        self.prep.grammars.close()  # the kept engine grammars, before the workers free the handles they came from
        if self.intake is not None:
            # The workers end after their current job (each frees its own tokenizer
            # handle, independent of the model): an abort waits for no compile.
            self.intake.close()
        self._free_model()

    def _free_model(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        if self._model is not None:
            self.lib.baseRT_free_model(self._model)
            self._model = None
            self.models_freed += 1


def _deliver_batch(batch: list[StreamOutput]) -> None:
    """Runs on the event loop: hand each stream its part of one step."""
    for output in batch:
        output.deliver()
