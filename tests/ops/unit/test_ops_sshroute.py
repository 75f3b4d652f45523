"""Routes to a host (dflash_ops.ssh.routing): jump lists, ProxyJump vs ProxyCommand precedence judged by OpenSSH's
own `ssh -G` (it prints the raw proxyjump / proxycommand it would use, connects nowhere), token expansion with
every value quoted, and the chain a first hop's own ProxyJump builds. Real config files, read by ssh.config."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from dflash_ops.errors import UsageError
from dflash_ops.ssh import config, routing
from dflash_ops.ssh.routing import Endpoint, Hop

TARGET = Endpoint(address="10.0.0.9", port=22, user="root", identity="/keys/t", name="t")


def _ssh_says(cfg: Path, alias: str) -> tuple[str, str] | None:
    done = subprocess.run(["ssh", "-G", "-F", str(cfg), alias], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("proxyjump", "proxycommand"):
            return ("jump" if key == "proxyjump" else "command", value)
    return None


@pytest.mark.parametrize("text", [
    "Host x\n  ProxyCommand nc %h %p\n  ProxyJump a,b\n",
    "Host x\n  ProxyJump ssh://u@a:2,b\n  ProxyCommand nc %h %p\n",
    "Host x\n  ProxyCommand none\nHost *\n  ProxyJump a\n",
    "Host x\n  ProxyJump none\nHost *\n  ProxyCommand nc %h %p\n",
    "Host *\n  ProxyCommand=ssh -W '[%h]:%p' bastion # not a comment for ssh\n  ProxyJump b\n",
    "Host y\n  ProxyJump a\nHost x\n  User u\n",
])
def test_proxyjump_and_proxycommand_first_found_wins_as_ssh_says(tmp_path, text):
    cfg = tmp_path / "config"
    cfg.write_text(text)
    ours = routing.proxy_setting(config.read(cfg, home=tmp_path).lookup("x"))
    assert ours == _ssh_says(cfg, "x")


def test_paramiko_never_expands_proxy_tokens_itself(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text("Host x\n  HostName 10.1.1.1\n  ProxyCommand printf %s %h ~ %%\n")
    assert config.read(cfg, home=tmp_path).lookup("x")["proxycommand"] == "printf %s %h ~ %%"


def test_jump_lists_parse_hops_in_order_with_ssh_uris():
    assert routing.parse_jump("a, ops@b:2200,ssh://c,ssh://u@[fd00::1]:22/", "jump") == (
        Hop("a", "a"), Hop("ops@b:2200", "b", "ops", 2200), Hop("ssh://c", "c"),
        Hop("ssh://u@[fd00::1]:22/", "fd00::1", "u", 22))
    for bad, hop in (("a,,b", "hop 2 ''"), ("a,b:99999", "hop 2 'b:99999' has an invalid port"),
                     ("ssh://a/path", "hop 1 'ssh://a/path' is not"), ("$(id)", "hop 1 '$(id)' is not"),
                     ("scp://a", "hop 1 'scp://a' is not")):
        with pytest.raises(UsageError, match=r"^jump: " + __import__("re").escape(hop)):
            routing.parse_jump(bad, "jump")
    with pytest.raises(UsageError, match="9 jump hosts, more than 8"):
        routing.parse_jump(",".join("abcdefghi"), "jump")


def test_proxy_command_tokens_are_quoted_values_and_unknown_ones_refused():
    to = Endpoint(address="gpu.lan", port=2022, user="ops", identity=None, name="gpu")
    cmd = routing.expand_proxy_command("ssh -W '[%h]:%p' -l %r bastion # %n 100%%", to, "gpu")
    assert cmd == "ssh -W '[gpu.lan]:2022' -l ops bastion # gpu 100%"
    assert shlex.split(routing.expand_proxy_command("nc %h %p", to, "gpu")) == ["nc", "gpu.lan", "2022"]
    for bad, message in (("nc %h %x", "unknown token %x"), ("nc %h %", "unknown token % in")):
        with pytest.raises(UsageError, match=message):
            routing.expand_proxy_command(bad, to, "gpu")
    hostile = Endpoint(address="a;touch /tmp/p", port=22, user="ops", identity=None, name="h")
    with pytest.raises(UsageError, match=r"refusing to put %h = 'a;touch /tmp/p' into a shell command"):
        routing.expand_proxy_command("nc %h %p", hostile, "h")


def test_first_hops_own_route_applies_and_later_hops_own_do_not(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text("Host t\n  ProxyJump a,b\n"
                   "Host a\n  HostName 10.0.0.1\n  User ua\n  ProxyJump ssh://z@pre:2200\n"
                   "Host b\n  HostName 10.0.0.2\n  ProxyJump ignored\n"  # ignored as a later hop
                   "Host pre\n  HostName 10.0.0.3\n  IdentityFile /keys/pre\n  ProxyCommand nc %h %p\n"
                   "Host viacmd\n  HostName 10.0.0.4\n  User c\n  ProxyCommand ssh -W %h:%p -l %r jumpbox\n")
    lookup = config.read(cfg, home=tmp_path).lookup
    route = routing.resolve("t", TARGET, None, lookup)
    assert [(h.name, h.label, h.identity) for h in route.hops] == [
        ("ssh://z@pre:2200", "z@10.0.0.3:2200", "/keys/pre"), ("a", "ua@10.0.0.1:22", "/keys/t"),
        ("b", "root@10.0.0.2:22", "/keys/t")]
    assert route.proxy_command == "nc 10.0.0.3 2200"  # pre's own ProxyCommand carries the first connection
    assert route.describe() == "ProxyCommand: nc 10.0.0.3 2200, then ssh://z@pre:2200,a,b"

    direct = routing.resolve("viacmd", Endpoint("10.0.0.4", 22, "c", None, "viacmd"), None, lookup)
    assert direct == routing.Route(proxy_command="ssh -W 10.0.0.4:22 -l c jumpbox")
    # an inventory `jump:` wins over the target's own ssh config; that first hop's own ProxyJump still applies
    assert [h.name for h in routing.resolve("viacmd", TARGET, "b", lookup).hops] == ["ignored", "b"]
    assert [h.name for h in routing.resolve("viacmd", TARGET, "10.0.0.2,b", lookup).hops] == ["10.0.0.2", "b"]
    assert routing.resolve("nowhere", TARGET, None, lookup) == routing.Route()
