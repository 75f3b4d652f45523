"""~/.ssh/config with `Include`, read by dflash_ops.ssh.config: real files in a temporary HOME, and OpenSSH's own
`ssh -G -F FILE ALIAS` (prints the settings ssh would use, connects nowhere) as the judge of what the files mean.

`ssh -G` resolves `~` and relative Include paths against the passwd home, not $HOME, so the cases it judges use
absolute Include paths; the `~`/relative/glob cases are checked against the semantics written down by hand.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_ops import inventory
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.spec import Host
from dflash_ops.ssh import config, endpoint

LOGIN = pwd.getpwuid(os.getuid()).pw_name


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _ours(cfg: Path, alias: str, home: Path | None = None) -> tuple[str, str, str]:
    got = config.read(cfg, home=home or cfg.parent).lookup(alias)
    return got.get("hostname", alias), got.get("user", LOGIN), got.get("port", "22")


def _ssh_says(cfg: Path, alias: str) -> tuple[str, str, str]:
    done = subprocess.run(["ssh", "-G", "-F", str(cfg), alias], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    first: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        first.setdefault(key, value)
    return first["hostname"], first["user"], first["port"]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DFLASH_OPS_SSH_SYSTEM_CONFIG", "")  # this machine's /etc/ssh/ssh_config stays out
    (tmp_path / ".ssh").mkdir(mode=0o700)
    return tmp_path


def test_include_glob_relative_and_tilde_paths_in_sorted_order(home):
    ssh = home / ".ssh"
    _write(ssh / "config", f"Include config.d/* ~/more/extra.conf {home / 'abs.conf'}\nHost *\n  User fallback\n")
    _write(ssh / "config.d" / "20-b.conf", "Host pve\n  HostName 10.0.0.20\n  Port 2220\n")
    _write(ssh / "config.d" / "10-a.conf", "Host pve\n  HostName 10.0.0.10\n")  # sorts first: its HostName wins
    _write(ssh / "config.d" / ".hidden", "Host hidden\n  HostName 9.9.9.9\n")  # a glob skips dotfiles, as ssh's
    _write(home / "more" / "extra.conf", "Host tilde\n  HostName 10.0.0.30\n")
    _write(home / "abs.conf", "Host absolute\n  HostName 10.0.0.40\n  User abs\n")
    cfg = config.read()
    assert cfg.lookup("pve")["hostname"] == "10.0.0.10" and cfg.lookup("pve")["port"] == "2220"
    assert cfg.lookup("pve")["user"] == "fallback"
    assert cfg.lookup("tilde")["hostname"] == "10.0.0.30"
    assert (cfg.lookup("absolute")["hostname"], cfg.lookup("absolute")["user"]) == ("10.0.0.40", "abs")
    assert [cfg.has_alias(w) for w in ("pve", "tilde", "absolute", "hidden")] == [True, True, True, False]


def test_nested_includes_and_missing_files_are_skipped(home):
    ssh = home / ".ssh"
    _write(ssh / "config", "Include nothere.conf none.d/*.conf level1.conf\n")
    _write(ssh / "level1.conf", "Include sub/level2.conf\nHost one\n  HostName 10.1.0.1\n")
    _write(ssh / "sub" / "level2.conf", "Include ~/.ssh/also-missing\nHost two\n  HostName 10.1.0.2\n  Port 2202\n")
    cfg = config.read()
    assert cfg.lookup("one")["hostname"] == "10.1.0.1"
    assert (cfg.lookup("two")["hostname"], cfg.lookup("two")["port"]) == ("10.1.0.2", "2202")


def test_no_config_at_all_is_empty(home):
    assert config.read().lookup("pve") == {} and not config.read().has_alias("pve")
    assert endpoint.resolve_endpoint(Host(name="pve", transport="ssh", address="pve")) == ("pve", 22, "root", None)


def test_include_inside_a_host_block_applies_only_to_that_block_as_ssh_does(tmp_path):
    d = tmp_path
    _write(d / "pve.conf", "HostName 10.0.0.5\nUser ops\nHost stray\n  HostName 6.6.6.6\n")
    _write(d / "box.conf", "Host *\n  User boxuser\n")
    _write(d / "m.conf", "Port 2300\nHost *\n  HostName 10.0.0.77\n")
    cfg = _write(d / "config", f"Host pve\n  Include {d}/pve.conf\n  Port 2201\n"
                               f"Host box\n  Include {d}/box.conf\n"
                               f"Match originalhost mbox\n  Include {d}/m.conf\n"
                               f"Host *\n  User everyone\n")
    want = {
        "pve": ("10.0.0.5", "ops", "2201"),        # Port 2201 after the Include is pve's again
        "stray": ("stray", "everyone", "22"),      # `Host stray` sits inside the non-matching `Host pve`
        "box": ("box", "boxuser", "22"),           # the included `Host *` holds for box only
        "mbox": ("10.0.0.77", "everyone", "2300"),
        "other": ("other", "everyone", "22"),
    }
    for alias, expected in want.items():
        assert _ours(cfg, alias) == expected, alias
        assert _ssh_says(cfg, alias) == expected, alias
    parsed = config.read(cfg, home=d)
    assert parsed.has_alias("pve") and not parsed.has_alias("stray") and not parsed.has_alias("mbox")


def test_a_top_level_include_ends_with_its_file(tmp_path):
    """Lines after a top-level Include apply to every host, not to the last block of the included file."""
    _write(tmp_path / "hosts.conf", "Host h1\n  HostName 10.2.0.1\nHost h2\n  HostName 10.2.0.2\n")
    cfg = _write(tmp_path / "config", f"Include {tmp_path}/hosts.conf\nPort 2222\nUser deploy\n")
    for alias, expected in {"h1": ("10.2.0.1", "deploy", "2222"), "other": ("other", "deploy", "2222")}.items():
        assert _ours(cfg, alias) == expected == _ssh_says(cfg, alias)


def test_first_value_wins_across_files(tmp_path):
    _write(tmp_path / "early.conf", "Host pve\n  User early\n  Port 2200\n")
    _write(tmp_path / "late.conf", "Host pve\n  Port 2299\n  HostName 10.3.0.3\n")
    cfg = _write(tmp_path / "config", f"Host pve\n  HostName 10.3.0.1\n"
                                      f"Include {tmp_path}/early.conf {tmp_path}/late.conf\n"
                                      f"Host pve\n  User late\n")
    assert _ours(cfg, "pve") == ("10.3.0.1", "early", "2200") == _ssh_says(cfg, "pve")


def test_identity_files_accumulate_across_files_in_order(home):
    ssh = home / ".ssh"
    _write(ssh / "config", "Host pve\n  IdentityFile ~/.ssh/first\nInclude keys.conf\n")
    _write(ssh / "keys.conf", "Host pve\n  IdentityFile ~/.ssh/second\n  User ops\n")
    assert config.read().lookup("pve")["identityfile"] == [f"{home}/.ssh/first", f"{home}/.ssh/second"]
    assert endpoint.resolve_endpoint(Host(name="pve", transport="proxmox", address="pve")) == \
        ("pve", 22, "ops", f"{home}/.ssh/first")


def test_include_cycle_is_one_clear_config_error(tmp_path):
    _write(tmp_path / "a.conf", f"Host a\n  HostName 10.4.0.1\nInclude {tmp_path}/b.conf\n")
    _write(tmp_path / "b.conf", f"Include {tmp_path}/a.conf\n")
    cfg = _write(tmp_path / "config", f"Include {tmp_path}/a.conf\n")
    with pytest.raises(ConfigError) as info:
        config.read(cfg, home=tmp_path)
    assert info.value.exit_code == 78
    assert info.value.message == (f"{tmp_path}/b.conf:1: ssh config Include cycle: {tmp_path}/a.conf -> "
                                  f"{tmp_path}/b.conf -> {tmp_path}/a.conf")
    assert "\n" not in info.value.message
    refused = subprocess.run(["ssh", "-G", "-F", str(cfg), "a"], capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "recursive" in refused.stderr  # ssh refuses the same file set


def test_self_include_is_a_cycle(home):
    _write(home / ".ssh" / "config", "Include config\n")
    with pytest.raises(ConfigError, match="Include cycle"):
        config.read()


def test_include_depth_limit_is_sshs(tmp_path):
    def chain(n_includes: int) -> Path:
        d = tmp_path / f"chain{n_includes}"
        for i in range(n_includes):
            _write(d / f"f{i}", f"Include {d}/f{i + 1}\n")
        _write(d / f"f{n_includes}", "Host deep\n  HostName 10.5.0.1\n")
        return d / "f0"

    ok = chain(config.MAX_INCLUDE_DEPTH)
    assert _ours(ok, "deep")[0] == "10.5.0.1" == _ssh_says(ok, "deep")[0]
    too_deep = chain(config.MAX_INCLUDE_DEPTH + 1)
    with pytest.raises(ConfigError, match="nested more than 16 deep"):
        config.read(too_deep, home=tmp_path)
    refused = subprocess.run(["ssh", "-G", "-F", str(too_deep), "deep"], capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0


def test_unparsable_line_names_file_and_line(home):
    _write(home / ".ssh" / "config", "Include bad.conf\n")
    _write(home / ".ssh" / "bad.conf", "Host x\n  HostName 10.0.0.1\n  Port\n")
    with pytest.raises(ConfigError, match=r"bad\.conf:3: unparsable ssh config line 'Port'"):
        config.read()


def test_alias_only_in_an_included_file_is_an_address(home):
    _write(home / ".ssh" / "config", "Include config.d/*\n")
    _write(home / ".ssh" / "config.d" / "pve.conf", "Host pve-lab\n  HostName 10.6.0.1\n  User ops\n")
    assert inventory._looks_like_address("pve-lab", "pve-lab")
    found = inventory.resolve_host(inventory.Inventory(), "pve-lab", with_ct=True)
    assert (found.transport, found.address) == ("proxmox", "pve-lab")
    assert endpoint.resolve_endpoint(found) == ("10.6.0.1", 22, "ops", None)


def test_wildcards_and_negations_name_no_host(home):
    _write(home / ".ssh" / "config", "Include config.d/*\nHost *\n  User everyone\n")
    _write(home / ".ssh" / "config.d" / "w.conf", "Host pve* !secret gpu?\n  User ops\nHost secret !secret\n"
                                                 "Host *.lan\n  Port 2200\n")
    for word in ("random", "secret", "pve1", "gpu1", "pve*"):
        assert not inventory._looks_like_address(word, word), word
    with pytest.raises(UsageError, match="unknown host 'random'"):
        inventory.resolve_host(inventory.Inventory(), "random", with_ct=False)


def test_jump_host_endpoint_comes_from_the_spec_then_its_ssh_config_then_the_target(home):
    _write(home / ".ssh" / "config", "Include jumps.conf\n")
    _write(home / ".ssh" / "jumps.conf", "Host bastion\n  HostName 10.7.0.1\n  Port 2022\n  User jumper\n"
                                         "  IdentityFile ~/.ssh/jumpkey\n")
    key = _write(home / "keys" / "target", "")  # an inventory identity_file must exist (else exit 78)
    target = Host(name="t", transport="ssh", address="10.7.0.9", identity_file=str(key))

    def hop(jump: str) -> tuple:
        (only,) = endpoint.resolve_route(replace(target, jump=jump)).hops
        return only.address, only.port, only.user, only.identity

    assert hop("bastion") == ("10.7.0.1", 2022, "jumper", f"{home}/.ssh/jumpkey")
    assert hop("ops@bastion:2222") == ("10.7.0.1", 2222, "ops", f"{home}/.ssh/jumpkey")
    assert hop("ssh://ops@bastion:2222") == ("10.7.0.1", 2222, "ops", f"{home}/.ssh/jumpkey")
    assert hop("10.7.0.5") == ("10.7.0.5", 22, "root", str(key))
    with pytest.raises(UsageError, match="hop 2 'b;x' is not"):
        endpoint.resolve_route(replace(target, jump="a,b;x"))


def test_system_config_comes_after_the_users_with_includes_under_its_own_dir(home, tmp_path, monkeypatch):
    etc = tmp_path / "etc-ssh"
    system = _write(etc / "ssh_config", "Include ssh_config.d/*.conf\nHost *\n  User sysdefault\n  Port 2200\n")
    _write(etc / "ssh_config.d" / "lab.conf", "Host syslab\n  HostName 10.5.0.1\n  ProxyJump sysjump\n")
    _write(home / ".ssh" / "ssh_config.d" / "lab.conf", "Host syslab\n  HostName 10.6.6.6\n")  # not this one
    _write(home / ".ssh" / "config", "Host syslab\n  User mine\nHost other\n  ProxyCommand none\n")
    monkeypatch.setenv("DFLASH_OPS_SSH_SYSTEM_CONFIG", str(system))
    cfg = config.read()
    assert cfg.source == f"{home}/.ssh/config and {system}"
    got = cfg.lookup("syslab")
    # the user's User wins; the rest comes from the system file and the file it includes relative to etc-ssh/
    assert (got["hostname"], got["user"], got["port"], got["proxyjump"]) == ("10.5.0.1", "mine", "2200", "sysjump")
    assert "proxyjump" not in cfg.lookup("other")  # the user's `ProxyCommand none` came first
    assert cfg.has_alias("syslab") and not cfg.has_alias("sysdefault")
    assert inventory.resolve_host(inventory.Inventory(), "syslab", with_ct=False).address == "syslab"
    only_user = config.read(home / ".ssh" / "config")  # an explicit file is read alone, as `ssh -F` reads it
    assert only_user.lookup("syslab")["hostname"] == "syslab"

    monkeypatch.delenv("DFLASH_OPS_SSH_SYSTEM_CONFIG")
    assert config.system_config() == Path("/etc/ssh/ssh_config")


def test_a_broken_system_include_names_the_system_file(home, tmp_path, monkeypatch):
    etc = tmp_path / "etc-ssh"
    system = _write(etc / "ssh_config", "Include loop.conf\n")
    _write(etc / "loop.conf", "Include ssh_config\n")
    monkeypatch.setenv("DFLASH_OPS_SSH_SYSTEM_CONFIG", str(system))
    with pytest.raises(ConfigError, match=f"^{etc}/loop.conf:1: ssh config Include cycle: {system} -> "):
        config.read()


def test_match_exec_without_invoke_is_one_config_error_naming_the_fix(home):
    """paramiko evaluates `Match exec` with the optional package invoke; where it is missing (here: made unimportable
    before paramiko loads), a lookup is one ConfigError naming the fix, not an ImportError's traceback."""
    _write(home / ".ssh" / "config", 'Match exec "test -e /"\n  User someone\nHost pve1\n  HostName 10.1.2.6\n')
    probe = ("import sys; sys.modules['invoke'] = None\n"
             "from dflash_ops.errors import ConfigError\n"
             "from dflash_ops.ssh import config\n"
             "try:\n    config.read().lookup('pve1')\n"
             "except ConfigError as e:\n    print(e.exit_code, e.message, '|', e.hint)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(home)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("78 ") and "has a `Match exec` block" in done.stdout, done.stdout
    assert "| pip install invoke, or move that host out of the Match exec block" in done.stdout
