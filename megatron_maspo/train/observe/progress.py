"""What a person watching ``maspo train`` sees: a bar over RL steps with ETA, and a live bar inside
each long phase (generation, grading, update), on rank 0 and only when the console is a terminal.

Elsewhere (CI, a log file, ranks > 0) nothing here draws, and the trainer prints its one plain line
per step as before; phases run through :meth:`Progress.iterate` (the warm start) print a plain status
line on rank 0 every ``status_every_s`` instead, so a pipe is not silent for a minute. Components report through plain callables, so the rollout engine, the grader
and the actor depend on nothing in this module::

    with Progress(total=steps, initial=done, enabled=rank == 0) as progress:
        warm_start(progress)               # phases before the first step draw on their own
        progress.begin_steps()             # the step bar (and its ETA clock) starts here
        with progress.phase("generate", total=P * G, unit="seq") as advance:
            engine.generate(prompts, params, progress=advance)   # advance(k): k more sequences done
        progress.step_done("step 3/60 | reward +0.12 | ...")

While the bars are up, log records go through ``tqdm.write`` so they print above the bars instead of
tearing them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

Advance = Callable[[int], None]
"""A progress hook: ``advance(k)`` reports ``k`` more units of the current phase done."""


def _noop(_: int = 1) -> None:
    pass


def is_terminal(stream: IO[str]) -> bool:
    """True when ``stream`` is an interactive terminal (bars would be redrawn in place)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class Progress(contextlib.AbstractContextManager):
    """Step bar plus one transient bar per phase; a no-op unless ``enabled`` and the stream is a TTY.

    Args:
        total: RL steps of the run.
        initial: steps already done (a resumed run's bar starts there; its ETA counts only new steps).
        enabled: the caller's switch (rank 0 and ``logging.progress``).
        stream: where bars draw; stderr by default, so stdout stays the per-step lines.
    """

    def __init__(self, *, total: int, initial: int = 0, enabled: bool = True,
                 stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.active = enabled and is_terminal(self.stream)
        self.enabled = enabled
        self.status_every_s = 10.0
        """Without a terminal: seconds between plain status lines of an :meth:`iterate` phase."""
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._total, self._initial = total, initial

    def open(self) -> None:
        """Route console log records through ``tqdm.write`` (until :meth:`close`)."""
        if self.active and self._redirect is None:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())

    def __enter__(self) -> Progress:
        self.open()
        return self

    def begin_steps(self) -> None:
        """Put up the step bar. Called after the warm start, so the ETA counts only RL steps."""
        if self.active and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, initial=self._initial, desc="RL steps", unit="step",
                             file=self.stream, dynamic_ncols=True, position=0, leave=True,
                             bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, "
                                        "{rate_fmt}]")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the step bar on screen, restore the log handlers; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None, unit: str = "it") -> Iterator[Advance]:
        """A live bar for one phase of the current step, removed when the phase ends.

        Yields:
            the ``advance(k)`` hook to hand to the component doing the work (a no-op when inactive).
        """
        if not self.active:
            yield _noop
            return
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"  {name}", unit=unit, file=self.stream, dynamic_ncols=True,
                   position=0 if self._bar is None else 1, leave=False)
        try:
            yield bar.update
        finally:
            bar.close()

    def iterate(self, iterable: Any, name: str, total: int | None = None, unit: str = "it") -> Iterator:
        """``iterable`` with a phase bar advanced once per item (e.g. the SFT warm start's steps)."""
        if not self.active:
            yield from self._plain_status(iterable, name.strip(), total if total is not None else _len(iterable),
                                          unit)
            return
        with self.phase(name, total if total is not None else _len(iterable), unit) as advance:
            for item in iterable:
                yield item
                advance(1)

    def step_done(self, line: str | None) -> None:
        """Advance the step bar; ``line`` (the per-step summary) prints on stdout in either mode."""
        if line is not None:
            if self.active:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stdout)
            else:
                print(line, file=sys.stdout, flush=True)
        if self._bar is not None:
            self._bar.update(1)


    def _plain_status(self, iterable: Any, name: str, total: int | None, unit: str) -> Iterator:
        """``iterable``, printing ``name: k/total unit`` now and then (no terminal, rank 0 only)."""
        import time

        t0 = last = time.monotonic()
        of = f"/{total}" if total is not None else ""
        if self.enabled:
            print(f"{name}: 0{of} {unit} ...", file=self.stream, flush=True)
        for k, item in enumerate(iterable, 1):
            yield item
            now = time.monotonic()
            if self.enabled and now - last >= self.status_every_s:
                print(f"{name}: {k}{of} {unit} ({now - t0:.0f} s)", file=self.stream, flush=True)
                last = now


def _len(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None
