"""A progress line for a step that reports no progress of its own (reading a GGUF's metadata,
loading a model into the engine): the elapsed seconds, refreshed by a small thread, shown
only once the step has taken longer than a second, so quick steps print nothing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["ticking"]


@contextlib.contextmanager
def ticking(desc: str, *, enabled: bool = True, after_s: float = 1.0) -> Iterator[None]:
    """Show ``desc: 3.2 s`` on stderr while the block runs, once it has run for `after_s`."""
    if not enabled:
        yield
        return
    started = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        if done.wait(after_s):
            return
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # only once the step has been slow

        with tqdm(total=None, bar_format="{desc}", file=sys.stderr) as bar:
            while True:
                bar.set_description_str(f"{desc}: {time.monotonic() - started:.1f} s")
                if done.wait(0.2):
                    break

    thread = threading.Thread(target=tick, name="aiobasert-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
