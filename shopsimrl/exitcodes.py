"""Process exit codes of every ``shopsimrl`` command, in one place.

Schedulers act on these codes, so they are part of the public contract: the Helm chart's
``podFailurePolicy`` marks an index failed without retry on ``BAD_INPUT`` and ``FINGERPRINT_MISMATCH``, the
Job retries an index (up to ``backoffLimitPerIndex``) on any other non-zero code, and
``shopsimrl status`` names them when it reports pod failures.

======  =======================  ==========================================================
code    name                     meaning
======  =======================  ==========================================================
0       OK                       done; every episode of the shard (or run) completed
1       EPISODES_FAILED          finished, but some episodes ended as failures
2       BAD_INPUT                bad config, split file or flags; fix the input first
                                 (Kubernetes: ``FailIndex``)
3       RETRYABLE                interrupted and safe to retry: SIGTERM, object store lost,
                                 model or environment not ready in time
42      FINGERPRINT_MISMATCH     the run already exists with another fingerprint; retrying
                                 can never help (Kubernetes: ``FailIndex``)
======  =======================  ==========================================================
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """Exit status of a ``shopsimrl`` process; see the module docstring for the table."""

    OK = 0
    EPISODES_FAILED = 1
    BAD_INPUT = 2
    RETRYABLE = 3
    # Deliberately far from the small codes Python, shells and typer use on their own (1, 2,
    # 126-255), so a crash can never be mistaken for "never retry".
    FINGERPRINT_MISMATCH = 42
