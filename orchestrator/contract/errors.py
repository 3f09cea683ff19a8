"""One exception hierarchy for the CLI, turned into a message and an exit code in one place.

Exit codes (documented in docs/commands.md):

====  ==========================================================================================
0     success (dry run within budget, job SUCCEEDED, command done)
1     the job ended badly (FAILED, CANCELLED, OVER_BUDGET) or an unexpected internal error
2     invalid job spec, missing file, or bad command-line usage
3     the estimate is over ``budget.max_usd`` (nothing rented)
4     no offer fits the job's resources, or the plan does not fit the GPU's memory by the
      planner's bytes (the reason and what would fit are printed; nothing rented; ``--force``
      rents anyway, with a warning naming the risk)
5     a provider refused: missing credentials, quota, auth (nothing rented)
6     the job or run URI was not found / not reachable
130   interrupted (Ctrl-C) while nothing was left running
====  ==========================================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_INVALID = 2
EXIT_OVER_BUDGET = 3
EXIT_NO_OFFER = 4
EXIT_NO_FIT = 4
"""Same code as EXIT_NO_OFFER: nothing that can run was found (no offer, or no plan that fits memory)."""
EXIT_PROVIDER = 5
EXIT_NOT_FOUND = 6
EXIT_INTERRUPTED = 130


class DtrunError(Exception):
    """Base of every error the CLI reports as one clear line (no traceback)."""

    exit_code = EXIT_JOB_FAILED


class SpecError(DtrunError):
    """The job spec (or its file) is invalid. The message names the file and the field path."""

    exit_code = EXIT_INVALID


class UsageError(DtrunError):
    exit_code = EXIT_INVALID


class OverBudgetError(DtrunError):
    exit_code = EXIT_OVER_BUDGET


class NoOfferError(DtrunError):
    exit_code = EXIT_NO_OFFER


class ProviderRefused(DtrunError):
    exit_code = EXIT_PROVIDER


class NotFoundError(DtrunError):
    exit_code = EXIT_NOT_FOUND
