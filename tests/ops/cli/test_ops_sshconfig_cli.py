"""The real CLI process with a ~/.ssh/config split over `Include`d files: aliases found there are hosts, their
HostName/Port/User reach the SSH command, and a broken Include is one `error:` line with exit 78 (config)."""

from __future__ import annotations

import json
from pathlib import Path


def _ssh_dir(env) -> Path:
    ssh = env.root / "home" / ".ssh"
    (ssh / "config.d").mkdir(parents=True, exist_ok=True)
    return ssh


def test_alias_from_an_included_file_reaches_the_ssh_command(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*.conf\nHost *\n  User nobody-default\n")
    (ssh / "config.d" / "lab.conf").write_text("Host gpubox\n  HostName 10.9.8.7\n  Port 2200\n  User bob\n")
    done = ops_env.sub("launch", "job", "--host", "gpubox", "--ct", "200", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ssh bob@10.9.8.7:2200: ")

    inv = ops_env.root / "inv.yaml"  # an inventory `address:` may name the alias too
    inv.write_text("hosts:\n  lab:\n    transport: ssh\n    address: gpubox\n    user: alice\n")
    named = ops_env.sub("--inventory", str(inv), "launch", "job", "--host", "lab", "--dry-run")
    assert named.returncode == 0, named.stderr
    assert named.stdout.startswith("ssh alice@10.9.8.7:2200: ")  # the inventory's user wins over ssh config


def test_host_star_does_not_make_a_word_a_host(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*\nHost *\n  User everyone\n")
    (ssh / "config.d" / "w.conf").write_text("Host pve* !pve-old\n  Port 2200\n")
    for word in ("randomword", "pve-old", "pve1"):
        done = ops_env.sub("runs", "--host", word)
        assert done.returncode == 2, (word, done.stderr)
        assert done.stderr.startswith(f"error: unknown host {word!r}")


def test_include_cycle_is_exit_78_with_one_line(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Host gpubox\n  HostName 10.9.8.7\nInclude config.d/loop.conf\n")
    (ssh / "config.d" / "loop.conf").write_text("Include ~/.ssh/config\n")
    done = ops_env.sub("runs", "--host", "gpubox")
    assert done.returncode == 78, done.stderr
    first, *rest = done.stderr.splitlines()
    assert first == (f"error: {ssh}/config.d/loop.conf:1: ssh config Include cycle: {ssh}/config -> "
                     f"{ssh}/config.d/loop.conf -> {ssh}/config")
    assert rest == ["hint: remove the Include that leads back to a file already being read"]
    as_json = ops_env.sub("runs", "--host", "10.1.2.3", "--json")  # an address still resolves through the config
    assert as_json.returncode == 78
    assert json.loads(as_json.stdout)["error"]["code"] == "config"


def test_proxyjump_routes_are_the_jump_hosts_unless_the_inventory_names_some(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*\n")
    (ssh / "config.d" / "j.conf").write_text(
        "Host gpubox\n  HostName 10.9.8.7\n  ProxyJump bastion\n"
        "Host direct\n  HostName 10.9.8.8\n  ProxyCommand none\n  ProxyJump bastion\n"
        "Host viacmd\n  HostName 10.9.8.8\n  ProxyJump none\n  ProxyCommand nc %h %p\n"
        "Host twohops\n  HostName 10.9.8.9\n  ProxyJump bastion,ssh://ops@other:2200\n"
        "Host chained\n  HostName 10.9.8.10\n  ProxyJump gpubox,other\n")
    expected = {"gpubox": "ssh root@10.9.8.7:22 (via bastion): ",
                "direct": "ssh root@10.9.8.8:22: ",  # `ProxyCommand none` came first: the ProxyJump is ignored
                # but `ProxyJump none` does not shut a later ProxyCommand out (as `ssh -G` shows)
                "viacmd": "ssh root@10.9.8.8:22 (via ProxyCommand: nc 10.9.8.8 22): ",
                "twohops": "ssh root@10.9.8.9:22 (via bastion,ssh://ops@other:2200): ",
                # only the FIRST hop's own ProxyJump applies (ssh reaches `other` with `ssh -J gpubox`)
                "chained": "ssh root@10.9.8.10:22 (via bastion,gpubox,other): "}
    for alias, line in expected.items():
        dry = ops_env.sub("launch", "job", "--host", alias, "--dry-run")
        assert dry.returncode == 0 and dry.stdout.startswith(line), (alias, dry.stdout, dry.stderr)

    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  lab:\n    transport: ssh\n    address: gpubox\n"
                   "    jump: ops@10.0.0.2:2222,ssh://[fd00::1]\n")
    named = ops_env.sub("--inventory", str(inv), "launch", "job", "--host", "lab", "--dry-run")
    assert named.returncode == 0, named.stderr
    assert named.stdout.startswith("ssh root@10.9.8.7:22 (via ops@10.0.0.2:2222,ssh://[fd00::1]): ")


def test_loops_long_chains_and_bad_hops_are_one_line_exit_2(ops_env):
    ssh = _ssh_dir(ops_env)
    nine = ",".join(f"h{i}" for i in range(9))
    (ssh / "config").write_text(
        "Host ring-a\n  ProxyJump ring-b\nHost ring-b\n  ProxyJump ring-c\nHost ring-c\n  ProxyJump ring-a\n"
        "Host self\n  ProxyJump self\nHost twice\n  ProxyJump a,b,a\n"
        f"Host nine\n  ProxyJump {nine}\n"
        "Host deep\n  ProxyJump d1,x1,x2,x3\nHost d1\n  ProxyJump d2,y1,y2,y3\nHost d2\n  ProxyJump z1\n"
        "Host bad\n  ProxyJump ok,b;touch /tmp/x\n")
    expected = {
        "ring-a": "error: ssh config ProxyJump loop: ring-a -> ring-b -> ring-c -> ring-a",
        "self": "error: ssh config ProxyJump loop: self -> self",
        "twice": "error: ProxyJump route to 'twice' visits 'a' twice (a,b,a -> twice): a loop",
        "nine": f"error: ssh config ProxyJump {nine!r} of 'nine': 9 jump hosts, more than 8",
        "deep": "error: ProxyJump route to 'deep' has 9 jump hosts (z1,d2,y1,y2,y3,d1,x1,x2,x3), more than 8",
        "bad": "error: ssh config ProxyJump 'ok,b;touch /tmp/x' of 'bad': hop 2 'b;touch /tmp/x' is not "
               "[user@]host[:port] or ssh://[user@]host[:port]",
    }
    for alias, line in expected.items():
        done = ops_env.sub("launch", "job", "--host", alias, "--dry-run")
        assert done.returncode == 2, (alias, done.stderr)
        assert done.stderr.splitlines()[0] == line, alias
        assert "Traceback" not in done.stderr

    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  lab:\n    transport: ssh\n    address: 10.1.1.1\n    jump: a,,b\n")
    bad = ops_env.sub("--inventory", str(inv), "runs", "--host", "lab")
    assert bad.returncode == 78
    assert bad.stderr.splitlines()[0] == (f"error: {inv}:5: host 'lab': jump: hop 2 '' is not [user@]host[:port] or "
                                          "ssh://[user@]host[:port] (jump is user@host:port, or a comma list of "
                                          "them, first hop first)")


def test_system_ssh_config_is_read_after_the_users(ops_env):
    etc = ops_env.root / "etc-ssh"
    (etc / "ssh_config.d").mkdir(parents=True)
    (etc / "ssh_config").write_text("Include ssh_config.d/*.conf\nHost *\n  User sysuser\n")
    (etc / "ssh_config.d" / "lab.conf").write_text("Host syslab\n  HostName 10.5.0.1\n  ProxyJump a,b\n")
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Host syslab\n  Port 2201\n  ProxyJump c\n")
    ops_env.env["DFLASH_OPS_SSH_SYSTEM_CONFIG"] = str(etc / "ssh_config")
    done = ops_env.sub("launch", "job", "--host", "syslab", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ssh sysuser@10.5.0.1:2201 (via c): ")  # first value wins across both files

    (etc / "ssh_config.d" / "bad.conf").write_text("Include ssh_config\n")  # relative to etc-ssh/, not to ssh_config.d/
    broken = ops_env.sub("launch", "job", "--host", "syslab", "--dry-run")
    assert broken.returncode == 78
    assert broken.stderr.startswith(f"error: {etc}/ssh_config.d/bad.conf:1: ssh config Include cycle: ")


def test_a_bad_ssh_config_port_is_exit_78_naming_the_ssh_config(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*\n")
    (ssh / "config.d" / "p.conf").write_text(
        "Host word\n  HostName 10.9.8.7\n  Port abc\nHost huge\n  HostName 10.9.8.7\n  Port 99999\n"
        "Host zero\n  HostName 10.9.8.7\n  Port 0\nHost viabad\n  HostName 10.9.8.7\n  ProxyJump word\n")
    hint = "hint: fix that Port line in ~/.ssh/config (or /etc/ssh/ssh_config, or a file they include)"
    for alias, port, args in [("word", "abc", ["runs", "--host", "word"]),      # a ValueError traceback before
                              ("huge", "99999", ["launch", "job", "--host", "huge", "--dry-run"]),  # accepted before
                              ("zero", "0", ["trust-host", "zero"]),
                              ("word", "abc", ["launch", "job", "--host", "viabad", "--dry-run"])]:  # a jump host's
        done = ops_env.sub(*args)
        assert done.returncode == 78, (args, done.stderr)
        assert done.stderr.splitlines() == [
            f"error: ssh config: Port {port!r} of {alias!r} is not a port number (1..65535)", hint], args


def test_a_hostname_no_resolver_takes_is_unreachable_in_one_line(ops_env):
    """HostName comes from ssh config unchecked; an empty or over-long label made the resolver raise UnicodeError."""
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text(f"Host dots\n  HostName a..b\nHost long\n  HostName {'a' * 64}.example\n")
    for alias, name in (("dots", "a..b"), ("long", "a" * 64 + ".example")):
        done = ops_env.sub("runs", "--host", alias)
        assert done.returncode == 69, done.stderr
        assert done.stderr.splitlines()[0] == (f"error: cannot connect to root@{name}:22: {name!r} is not a valid "
                                               "host name")
        trust = ops_env.sub("trust-host", alias)
        assert trust.returncode == 69, trust.stderr
        assert trust.stderr.splitlines() == [f"error: cannot connect to {name}:22: {name!r} is not a valid host name"]
