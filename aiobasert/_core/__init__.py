"""The private machinery of one engine, below the engine thread (aiobasert/engine_thread.py,
whose `_step` is one engine step: drain -> plan -> run -> apply -> deliver). Nothing here imports
from the package above it (tests/test_layering.py).

- `protocol`: the messages between the event loop and the thread (requests, tickets, queries).
- `prepare`: a request's preparation (its prompt's ids, its grammar) and the requests being prepared.
- `intake`: the worker threads that tokenize prompts and compile grammars, off the engine thread,
  in lanes by cost.
- `cost`: what preparing a request may cost, measured and bounded before it is paid.
- `grammar_cache`: compiled grammars by the digest of their source.
- `schema`: the JSON Schema policy every grammar shares (objects closed).
- `model_file`: the model's bundle as the host reads it (its tokenizer, its final norm), parsed once.
- `embed`: which path pools embeddings (hidden-state taps, or one baseRT_embed call).
- `request`: the engine thread's record of one request (`Request`), which the batcher reads and writes.
- `plan`: what one step does (`PlannedRow`, `StepPlan`): plain data the batcher fills.
- `step`: one fused batch step (prepare -> forward -> collect) and the lanes it runs.
- `output`: a sampled token becomes stream output (text, stops, finish).
- `wakeup`: hands each step's output back to the loop that opened the engine.
- `grammar`: constrained decoding (the engine's grammars, llguidance on the host).
- `stopping`: stop strings, never split or leaked.

The base layer below it (beside errors.py, types.py, config.py) holds `aiobasert/_ffi.py` (+
`_ffi_api.pyi`: the ctypes mirror of the C ABI, typed) and `aiobasert/_lazy_numpy.py` (numpy
imported on first use, never seen half imported).

Nothing here is public."""
