"""The progress bar of `tierzero bench-io` and `tierzero train`: tqdm on stderr.

On a terminal tqdm redraws the bar in place; anywhere else (a pipe, a log file) every update is
a line of its own, so a log keeps each step instead of one line of carriage returns.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

BAR_FORMAT = "[{bar:24}] {n_fmt}/{total_fmt} {desc}"
ASCII = ".#"
"""Bar characters: empty, full."""


class Progress:
    """`total` steps, `initial` of them already done; `advance(text)` after each step."""

    def __init__(self, total: int, *, enabled: bool = True, initial: int = 0) -> None:
        self._lines = enabled and not sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=initial, file=sys.stderr, disable=not enabled or self._lines,
                         bar_format=BAR_FORMAT, ascii=ASCII)
        self._done, self._total, self._start = initial, total, time.perf_counter()

    def advance(self, text: str) -> None:
        """One more step done; `text` says how it went."""
        self._done += 1
        if self._lines:
            line = tqdm.format_meter(self._done, self._total, time.perf_counter() - self._start,
                                     bar_format=BAR_FORMAT, ascii=ASCII, prefix=text)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        else:
            self._bar.set_description_str(text, refresh=False)
            self._bar.update()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
