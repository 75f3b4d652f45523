"""Strict validation of every name that reaches a remote shell (defence in depth: values are quoted anyway)."""

from __future__ import annotations

import re
import secrets
import time

from dflash_ops.errors import UsageError

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RUN_ID_RE = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})-(?P<stamp>[0-9]{8}T[0-9]{6})-(?P<tag>[0-9a-f]{4})")
CTID_RE = re.compile(r"[1-9][0-9]{0,8}")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HOST_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The most any seconds value takes (a week), on the command line and in the inventory and runbooks: bounded, so
# `inf`, `nan` and 1e400 are refused like any bad value, never reaching a remote script's wait arithmetic or a
# socket timeout (one past what time_t holds raises OverflowError).
SECONDS_MAX = 7 * 24 * 3600.0
# A login name, as `--host user@...` and the inventory's `user:` take it.
USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")
# A DNS label (RFC 1035: 1-63 characters, no hyphen at either end), and a name of them at most 253 long: the
# resolver's IDNA codec raises UnicodeError (not an OSError) for an empty or longer label, so none gets that far.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = rf"(?=[A-Za-z0-9.-]{{1,253}}(?![A-Za-z0-9.-])){_LABEL}(?:\.{_LABEL})*"
# user@host:port, host a DNS name, IPv4, or [IPv6]; no shell metacharacters anywhere.
ADDRESS_RE = re.compile(
    rf"(?:(?P<user>{USER_RE.pattern})@)?"
    rf"(?P<host>{_DNS_NAME}|\[[0-9A-Fa-f:.]+\])"
    r"(?::(?P<port>[0-9]{1,5}))?"
)

# A rendezvous address other nodes connect to: a DNS name, IPv4 or IPv6 (bare or in brackets); no user, no port,
# no IPv6 scope id (`%eth0`: it names an interface of one machine, and would reach torchrun's endpoint parser).
RDZV_NAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_IP_CHARS_RE = re.compile(r"[0-9A-Fa-f:.]+")
DIGITS_RE = re.compile(r"[0-9]+")


def is_digits(value: str) -> bool:
    """ASCII digits only (str.isdigit also takes "²" and other digits that int() refuses)."""
    return DIGITS_RE.fullmatch(value) is not None


def rdzv_address(value: str) -> str:
    """`value` as a rendezvous host (IPv6 without brackets), else UsageError: a plain IP address or host name."""
    import ipaddress

    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if _IP_CHARS_RE.fullmatch(bare):
        try:
            return str(ipaddress.ip_address(bare))
        except ValueError:
            pass
    # brackets only around an IP; a name's last label is never all digits (10.0.0.256 is no name)
    name = bare == value and len(value) <= 253 and RDZV_NAME_RE.fullmatch(value)
    if name and not is_digits(value.split(".")[-1]):
        return value
    raise UsageError(f"invalid rendezvous address {value!r}", hint="a DNS name or an IP address, without a port")


def run_name(value: str) -> str:
    """Return `value` if it is a valid run name, else raise UsageError. A name with a run id's shape is refused:
    `stop ID` (and every command taking a run) finds a run by its id or by its name, so a run named after another's
    id would be found in its place."""
    if not RUN_NAME_RE.fullmatch(value):
        raise UsageError(f"invalid run name {value!r}",
                         hint="use 1-64 characters from A-Z a-z 0-9 . _ - starting with a letter or digit")
    if is_run_id(value):
        raise UsageError(f"invalid run name {value!r}: it has the shape of a run id",
                         hint="a run is found by its id or its name; choose a name without the -YYYYMMDDTHHMMSS-xxxx "
                              "ending")
    return value


def run_id(value: str) -> str:
    if not RUN_ID_RE.fullmatch(value):
        raise UsageError(f"invalid run id {value!r}", hint="a run id looks like NAME-20260101T120000-ab12")
    return value


def is_run_id(value: str) -> bool:
    return RUN_ID_RE.fullmatch(value) is not None


def ctid(value: str | int) -> str:
    """Proxmox container ids are integers 1..999999999; returned as the canonical string."""
    text = str(value)
    if not CTID_RE.fullmatch(text):
        raise UsageError(f"invalid container id {text!r}", hint="a container id is a positive integer, e.g. 200")
    return text


def env_key(value: str) -> str:
    if not ENV_KEY_RE.fullmatch(value):
        raise UsageError(f"invalid environment variable name {value!r}")
    return value


def env_assignment(item: str) -> tuple[str, str]:
    """`KEY=VALUE` (as given to `launch --env`) -> (KEY, VALUE); the value is kept verbatim, `=` and all."""
    key, sep, value = item.partition("=")
    if not sep:
        raise UsageError(f"--env {item!r}: expected KEY=VALUE", hint="e.g. --env CUDA_VISIBLE_DEVICES=0,1")
    return env_key(key), value


def new_run_id(name: str, now: float | None = None, tag: str | None = None) -> str:
    """`<name>-<UTC yyyymmddTHHMMSS>-<4 hex>` (docs/contracts.md section 2)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{run_name(name)}-{stamp}-{tag or secrets.token_hex(2)}"
