"""Errors a user fixes by changing what they typed: the CLI prints them as one line and exits 2.

Everything else (a ``ValueError`` deep inside a run, a failing collective) keeps its traceback: it
is a bug or an environment problem, and the traceback is what a person needs to find it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration: a ``--set`` override, a recipe, a saved config.yaml or a command-line flag.

    The message names the key (or flag) and what it accepts.
    """


class InputError(ValueError):
    """A user-given input (checkpoint folder, safetensors file) cannot be used as it is.

    The message names the file and, where there is one, the tensor.
    """


class MissingPathError(FileNotFoundError):
    """A path the user gave (``--resume DIR``, ``data.source``, ``--config``) does not exist."""


class StackError(RuntimeError):
    """The installed GPU stack is a known-broken combination (``megatron_maspo/stack.py``)."""



class GraderError(RuntimeError):
    """The reward's grader failed on too much of one batch (wrong return type, hangs, raises).

    The message names the grader, the counts and the setting that allows more.
    """


class StorageError(OSError):
    """The run directory cannot hold what the run writes: not writable, or its disk is (nearly) full.

    The message names the path and the bytes needed or free.
    """


class WeightVerifyError(RuntimeError):
    """An engine holds weights other than the trainer exported (``rollout/digest.py``): a bug or a broken
    engine, not the user's input, so it keeps its traceback; its message is one line naming the tensor,
    the engine and the weight version."""


class MissingExtraError(ImportError):
    """An optional dependency a command needs is not installed; the message names the pip extra."""


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InputError, MissingPathError, GraderError,
                                                StorageError, MissingExtraError, StackError)
"""What ``maspo`` turns into a one-line message with exit status 2."""
