"""Embeddings: which path pools them, and the single-call path. On the engine thread only.

An embedding is a lane (`step.EmbedLane`): its input is fed chunk by chunk in the engine's
steps and pooled from hidden-state taps (`step.TapPooler`), so it never stalls the running
streams. That path is trusted once, on the first embedding (`Embedder.path`): the engine must
offer taps, the bundle must carry the final norm weight that baseRT_embed applies (read from
the engine's `ModelFile`), and a probe pooled from taps must match baseRT_embed. Otherwise every
input takes one baseRT_embed call (`Embedder.embed`), whose result is the reference.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from ctypes import c_float, c_int
from typing import TYPE_CHECKING, Any

from .. import _ffi
from ..errors import EngineError, ErrorCode
from .model_file import ModelFile
from .step import TapPooler

if TYPE_CHECKING:  # numpy: imported on first use only
    import numpy as np

EMBED_TAPS_ENV = "AIOBASERT_EMBED_TAPS"
"""Set to 0 to embed with one baseRT_embed call per input (the engine then
stalls for the whole forward): the comparison baseline of bench/embed_stall.py."""
_UNDECIDED = object()


class Embedder:
    """One engine's embedding paths (see the module docstring)."""

    def __init__(
        self,
        lib: _ffi.Library,
        model: int,
        model_file: ModelFile,
        *,
        dim: int,
        n_layers: int,
        norm_eps: float,
        vocab_size: int,
        max_context: int,
        tap_budget: int | None,
    ) -> None:
        self.lib = lib
        self.model = model
        self.model_file = model_file
        self.dim = dim
        self.n_layers = n_layers
        self.norm_eps = norm_eps
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.tap_budget = tap_budget
        self.pooler: Any = _UNDECIDED  # TapPooler, or None for the single-call path

    def path(self) -> TapPooler | None:
        """The tapped (chunked) embedding path, or None for one baseRT_embed call.

        Decided once, on the first embedding: the engine must offer taps, the
        bundle must carry the final norm weight that baseRT_embed applies, and a
        probe pooled from taps must match baseRT_embed. Any doubt keeps the
        single call, whose result is the reference. A probe the engine could not
        run right now (no free KV for it) decides nothing: this input takes the
        single call and the next one probes again."""
        if self.pooler is _UNDECIDED:
            pooler = None
            if os.environ.get(EMBED_TAPS_ENV, "1") != "0":
                try:
                    pooler = self._probe_taps()
                except EngineError:  # the engine refused the probe's steps for now
                    return None
                except Exception:
                    pooler = None
            self.pooler = pooler
        return self.pooler  # type: ignore[no-any-return]

    def _probe_taps(self) -> TapPooler | None:
        cap = self.tap_budget  # set where the engine and this model have taps (`Capabilities.taps`)
        if cap is None:
            return None
        import numpy as np

        weight = np.asarray(self.model_file.bundle().tensor("final_norm.weight"), dtype=np.float32).reshape(-1)
        if weight.shape != (self.dim,):
            return None
        pooler = TapPooler(weight, self.norm_eps, self.n_layers, cap)
        probe = [(7 * i + 3) % self.vocab_size for i in range(min(12, cap, self.max_context))]
        want = self.embed(probe).astype(np.float64)
        got = self._tapped_once(probe, pooler)
        if got is None or not np.isfinite(got).all():
            return None
        # A wrong norm or tap is off by O(1); f16 rounding by ~1e-4.
        if np.linalg.norm(got - want) > 1e-2 * max(float(np.linalg.norm(want)), 1e-30):
            return None
        return pooler

    def _tapped_once(self, ids: list[int], pooler: TapPooler) -> np.ndarray | None:
        """Pool `ids` through one tapped step on a scratch sequence (the probe)."""
        lib, model = self.lib, self.model
        seq = lib.baseRT_sequence_create(model)
        if not seq:
            raise lib.last_error("baseRT_sequence_create")
        try:
            n = len(ids)
            one = c_int * 1
            rc = lib.baseRT_batch_step_fused_logits_rows_taps(
                model,
                (ctypes.c_void_p * 1)(seq),
                1,
                _ffi.u32_array(ids),
                one(n),
                one(1),
                one(pooler.hidden_index),
                1,
                one(n),
            )
            if rc == ErrorCode.OUT_OF_MEMORY:
                raise lib.last_error("baseRT_batch_step_fused_logits_rows_taps")
            if rc != 0 or lib.baseRT_read_tap_rows(model, 0, n, pooler.rows.ctypes.data) != self.dim:
                return None
            return pooler.pooled_sum(pooler.rows[:n]) / n
        finally:
            lib.baseRT_sequence_rollback(seq, 0)
            lib.baseRT_sequence_free(seq)

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """One baseRT_embed call: the whole forward at once (the engine steps nothing meanwhile)."""
        import numpy as np

        arr = _ffi.u32_array(ids)
        out = np.zeros(self.dim, dtype=np.float32)
        n = self.lib.baseRT_embed(self.model, arr, len(ids), out.ctypes.data_as(ctypes.POINTER(c_float)), self.dim)
        if n <= 0:
            raise self.lib.last_error("baseRT_embed")
        return out[:n]
