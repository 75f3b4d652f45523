"""The closed set of domain errors. Exit codes are docs/contracts.md section 4 (130, Ctrl-C while tailing, is
not an error: `cli/tail.py` exits with it directly).

Every failure a user can cause or meet is one of these; the CLI renders them in one place
(`cli._common.rendered_errors`). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class OpsError(Exception):
    """A failure with a stable code, an exit code and an optional hint naming the fix."""

    code = "error"
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.detail = detail  # extra lines (a log tail, a remote stderr), shown after the message


class RemoteFailed(OpsError):
    """A remote command failed unexpectedly; the message shows the command, its code and last lines."""

    code, exit_code = "remote_failed", 1


class UsageError(OpsError):
    """Bad argument, unknown host / container / runbook, invalid name."""

    code, exit_code = "usage", 2


class RunNotFound(OpsError):
    code, exit_code = "run_not_found", 3


class RunFailed(OpsError):
    """The run exited non-zero, or did not prove itself alive at launch."""

    code, exit_code = "run_failed", 4


class Refused(OpsError):
    """A run of that name is alive, or the inductor cache is in use."""

    code, exit_code = "refused", 5


class HostUnreachable(OpsError):
    """Connect failed or timed out, or an established connection dropped."""

    code, exit_code = "unreachable", 69


class AuthFailed(OpsError):
    """Authentication failed, or the host key is unknown, changed or revoked, or vouched for only by a CA."""

    code, exit_code = "auth_failed", 77


class ConfigError(OpsError):
    """Malformed inventory or runbook YAML, or a missing / wrong field (file:line in the message)."""

    code, exit_code = "config", 78
