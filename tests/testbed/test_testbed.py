"""The test bed is real: a strict paramiko client against the loopback sshd, and pct exec into emulated containers.

These tests use paramiko directly (not the CLI), so a harness bug cannot hide behind a CLI bug or the reverse.
"""
from __future__ import annotations

import hashlib
import shlex
import socket
import threading
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from support import procfs
from support.sshclient import connect, run

pytestmark = pytest.mark.ssh

HOSTILE = [
    "it's \"quoted\" $HOME `whoami` ; echo PWNED && $(id) \\ back\nnewline",
    "x'; echo INJECTED; echo '",
    "",
    "  leading and trailing  ",
    "*",
    "-n",
    "--",
    "~root",
    "a\tb",
    "héllo ✓",
    "$((1+1)) !! \\$ '\"'",
]


def pct_command(ct, *argv: str) -> str:
    """The one command string the CLI will send: `pct exec CTID -- argv…` joined for the remote login shell."""
    return shlex.join([str(ct.pct), "exec", str(ct.ctid), "--", *argv])


def wait_for(predicate, *, timeout_s: float = 120.0, what: str) -> None:
    """Poll `predicate` until true; fail naming `what` at the deadline (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def detach_script(workdir: Path, job: str, *, env: dict[str, str] | None = None) -> str:
    """The launch recipe (runs/launch_scripts.py): a bash script that detaches `job` and prints its PID."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
    return (
        f"cd {shlex.quote(str(workdir))} || exit 1; {exports}"
        f"nohup setsid bash -c {shlex.quote(job)} > job.log 2>&1 < /dev/null & echo $!"
    )


def detach(ct, workdir: Path, job: str, *, env: dict[str, str] | None = None) -> str:
    """`pct exec CTID -- bash -c <detach_script>` as one command string for the remote login shell."""
    return pct_command(ct, "bash", "-c", detach_script(workdir, job, env=env))


# ------------------------------------------------------------------------------------------------ sshd
def test_connects_with_pinned_key_and_runs_a_command(sshd):
    with connect(sshd) as client:
        result = run(client, "echo hello; id -un")
    assert result.exit_code == 0
    assert result.stdout.decode().split() == ["hello", sshd.user]
    assert sshd.known_hosts.read_text() == sshd.host_key_line + "\n"
    assert sshd.host_key_line.startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")


def test_unknown_host_key_is_refused(sshd):
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(sshd, known_hosts=sshd.empty_known_hosts())


def test_changed_host_key_is_refused(sshd, tmp_path):
    other = paramiko.Ed25519Key.from_private_key_file(str(sshd.client_key))  # any ed25519 key but the host's
    wrong = tmp_path / "known_hosts.wrong"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} ssh-ed25519 {other.get_base64()}\n")
    with pytest.raises(paramiko.BadHostKeyException):
        connect(sshd, known_hosts=wrong)


def test_host_tools_are_on_the_session_path(sshd, host_tools):
    host_tools("fake-tool-for-test", "#!/bin/sh\necho fake tool ran with \"$@\"\n")
    with connect(sshd) as client:
        result = run(client, "fake-tool-for-test a1")
    assert (result.exit_code, result.stdout) == (0, b"fake tool ran with a1\n")


def test_restart_keeps_port_and_host_key_and_drops_connections(sshd, container, tmp_path):
    port, key_line = sshd.port, sshd.host_key_line
    client = connect(sshd)
    job_pid = int(run(client, detach(container, tmp_path, "exec sleep 600")).stdout)
    sshd.restart()
    assert (sshd.port, sshd.host_key_line) == (port, key_line)
    wait_for(lambda: not client.get_transport().is_active(), what="the old connection to drop")
    client.close()
    with connect(sshd) as again:  # same pinned known_hosts still matches
        assert run(again, pct_command(container, "kill", "-0", str(job_pid))).exit_code == 0


def test_fresh_sshd_is_independent(sshd, fresh_sshd):
    assert fresh_sshd.port != sshd.port
    assert fresh_sshd.host_key_line.split()[2] != sshd.host_key_line.split()[2]
    with pytest.raises(paramiko.BadHostKeyException):
        connect(fresh_sshd, known_hosts=_rewrite_port(sshd, fresh_sshd.port))
    with connect(fresh_sshd) as client:
        assert run(client, "true").exit_code == 0


def _rewrite_port(sshd, port: int) -> Path:
    """sshd's pinned key, filed under another port: the key a client expects at that port, but the wrong one."""
    path = sshd.workdir / f"known_hosts.port{port}"
    path.write_text(sshd.host_key_line.replace(f"]:{sshd.port} ", f"]:{port} ") + "\n")
    return path


# ------------------------------------------------------------------------------------------------ pct
@pytest.mark.parametrize(("script", "expected"), [("true", 0), ("exit 7", 7), ("kill -9 $$", 137),
                                                   ("kill -TERM $$", 143)])
def test_pct_exec_passes_exit_status_through(sshd, container, script, expected):
    with connect(sshd) as client:
        result = run(client, pct_command(container, "bash", "-c", script))
    assert result.exit_code == expected
    assert result.stderr == b""  # no "Killed" notice from the shim's own shell


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_strings_round_trip_byte_exact(sshd, container, value):
    with connect(sshd) as client:
        via_script = run(client, pct_command(container, "bash", "-c", f"printf '%s' {shlex.quote(value)}"))
        via_argv = run(client, pct_command(container, "printf", "%s", value))
    assert via_script.stdout == value.encode()
    assert via_argv.stdout == value.encode()


def test_pct_exec_passes_stdin_through(sshd, container):
    payload = b"line one\n\x00binary\xff\nlast"
    with connect(sshd) as client:
        stdin, stdout, _stderr = client.exec_command(pct_command(container, "sha256sum"), timeout=30)
        stdin.write(payload)
        stdin.channel.shutdown_write()
        digest = stdout.read().split()[0].decode()
        assert stdout.channel.recv_exit_status() == 0
    assert digest == hashlib.sha256(payload).hexdigest()


def test_shim_adds_no_parse_of_its_own(sshd, container):
    """Exactly one parse (the login shell's) before argv: an eval-based mock would expand `$HOME` and split `a b`."""
    with connect(sshd) as client:
        result = run(client, f"{shlex.quote(str(container.pct))} exec {container.ctid} -- printf '%s|' 'a b' '$HOME'")
    assert result.stdout == b"a b|$HOME|"


def test_container_has_its_own_pid_uts_and_proc(sshd, container):
    with connect(sshd) as client:
        result = run(client, pct_command(container, "bash", "-c", "echo $$; hostname; cat /proc/1/cmdline | tr '\\0' ' '"))
        host_name = run(client, "hostname").stdout.decode().strip()
    pid, hostname, init_cmdline = result.stdout.decode().splitlines()
    assert hostname == f"ct{container.ctid}"
    assert host_name != hostname and host_name == socket.gethostname()  # the host's name is untouched
    assert "ct_init.py" in init_cmdline
    assert int(pid) < 100  # a fresh PID namespace, not the host's numbering


def test_missing_container_is_an_error(sshd, container):
    missing = container.ctid + 1
    with connect(sshd) as client:
        exec_result = run(client, shlex.join([str(container.pct), "exec", str(missing), "--", "true"]))
        status_result = run(client, shlex.join([str(container.pct), "status", str(missing)]))
    for result in (exec_result, status_result):
        assert result.exit_code != 0
        assert f"'nodes/pve/lxc/{missing}.conf' does not exist" in result.stderr.decode()


def test_stopped_container_is_an_error_and_reports_stopped(sshd, container):
    status = shlex.join([str(container.pct), "status", str(container.ctid)])
    with connect(sshd) as client:
        assert run(client, status).stdout == b"status: running\n"
        container.stop()
        exec_result = run(client, pct_command(container, "true"))
        assert run(client, status).stdout == b"status: stopped\n"
    assert exec_result.exit_code != 0
    assert exec_result.stderr.decode().strip() == f"container '{container.ctid}' not running!"


def test_usage_errors(sshd, container):
    with connect(sshd) as client:
        no_command = run(client, shlex.join([str(container.pct), "exec", str(container.ctid), "--"]))
        bad_vmid = run(client, shlex.join([str(container.pct), "exec", "12;x", "--", "true"]))
    assert no_command.exit_code != 0 and no_command.stderr == b"missing command\n"
    assert bad_vmid.exit_code != 0 and b"valid VM ID" in bad_vmid.stderr


def test_keep_env_0_clears_the_environment(sshd, container):
    with connect(sshd) as client:
        kept = run(client, shlex.join([str(container.pct), "exec", str(container.ctid), "--", "env"]))
        cleared = run(client, shlex.join([str(container.pct), "exec", str(container.ctid), "--keep-env", "0",
                                          "--", "env"]))
    assert b"SSH_CONNECTION=" in kept.stdout
    assert sorted(cleared.stdout.decode().split()) == sorted(
        ["container=lxc", "HOME=/root", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])


# ------------------------------------------------------------------------------------------------ detached jobs
def test_detached_job_survives_disconnect_and_is_reaped(sshd, container, tmp_path):
    go, out = tmp_path / "go", tmp_path / "out"
    job = f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done; echo finished > {shlex.quote(str(out))}"
    client = connect(sshd)
    started = time.monotonic()
    launch = run(client, detach(container, tmp_path, job))
    print(f"launch over ssh returned in {time.monotonic() - started:.2f}s")
    client.close()

    job_pid = int(launch.stdout)
    host_pid = container.host_pid(job_pid)
    assert host_pid is not None and host_pid != job_pid
    assert procfs.nspid(host_pid) == (host_pid, job_pid)
    assert procfs.ppid(host_pid) == container.init_pid  # re-parented to the container's PID 1
    ids = container.pct_exec("ps", "-o", "pid=,pgid=,sid=", "-p", str(job_pid)).stdout.split()
    assert ids == [str(job_pid)] * 3  # setsid: the job leads its own session and group

    go.touch()
    wait_for(out.exists, what="the job to finish")
    wait_for(lambda: procfs.state(host_pid) is None, what="the job to be reaped")  # gone, not <defunct>
    assert out.read_text() == "finished\n"


def test_container_view_of_proc_supports_kill_0_and_environ(sshd, container, tmp_path):
    marker = "run-20260101T000000-beef"
    with connect(sshd) as client:
        job_pid = int(run(client, detach(container, tmp_path, "exec sleep 600",
                                         env={"DFLASH_OPS_RUN_ID": marker})).stdout)
        alive = run(client, pct_command(container, "kill", "-0", str(job_pid)))
        environ = run(client, pct_command(container, "cat", f"/proc/{job_pid}/environ"))
    assert alive.exit_code == 0
    assert f"DFLASH_OPS_RUN_ID={marker}".encode() in environ.stdout.split(b"\0")
    host_pid = container.host_pid(job_pid)
    assert container.container_pid(host_pid) == job_pid
    assert container.container_pid(container.init_pid) == 1


def test_stop_kills_everything_inside(container, tmp_path):
    job_pid = int(container.pct_exec("bash", "-c", detach_script(tmp_path, "exec sleep 600")).stdout)
    host_pid = container.host_pid(job_pid)
    init_pid = container.init_pid
    container.stop()
    assert procfs.state(init_pid) is None
    wait_for(lambda: not procfs.is_alive(host_pid), what="the job to die with its container")


# ------------------------------------------------------------------------------------------------ scale + inventory
def test_eight_containers_start_fast_and_answer_in_parallel(sshd, containers):
    started = time.monotonic()
    cts = containers(8)
    print(f"8 containers started in {time.monotonic() - started:.3f}s")
    results: dict[int, bytes] = {}

    def ask(ct) -> None:
        with connect(sshd) as client:
            results[ct.ctid] = run(client, pct_command(ct, "hostname")).stdout

    threads = [threading.Thread(target=ask, args=(ct,)) for ct in cts]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"8 parallel ssh + pct exec in {time.monotonic() - started:.3f}s")
    assert results == {ct.ctid: f"ct{ct.ctid}\n".encode() for ct in cts}
    assert len({Path(f"/proc/{ct.init_pid}/ns/pid").readlink() for ct in cts}) == 8


def test_inventory_describes_a_reachable_host(testbed, repo_root):
    tb = testbed(2)
    doc = yaml.safe_load(tb.inventory.read_text())
    assert doc["hosts"]["local"] == {"transport": "local"}
    entry = doc["hosts"][tb.host]
    assert entry["transport"] == "proxmox" and entry["address"] == "127.0.0.1"
    assert sorted(entry["containers"]) == [ct.ctid for ct in tb.containers]
    for ctid, ct_entry in entry["containers"].items():
        assert Path(ct_entry["runs_dir"]).is_dir() and Path(ct_entry["runs_dir"]) == tb.runs_dirs[ctid]
        assert ct_entry["env"]["PYTHONPATH"] == str(repo_root)

    # Connect with nothing but what the inventory says.
    client = paramiko.SSHClient()
    client.load_host_keys(entry["known_hosts"])
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(entry["address"], port=entry["port"], username=entry["user"], key_filename=entry["identity_file"],
                   allow_agent=False, look_for_keys=False, timeout=10)
    with client:
        ctid, ct_entry = next(iter(entry["containers"].items()))
        probe = shlex.join([entry["pct"], "exec", str(ctid), "--", ct_entry["python"], "-c",
                            "import sys, yaml; print(sys.version_info[:2] >= (3, 11))"])
        result = run(client, probe)
    assert (result.exit_code, result.stdout) == (0, b"True\n")
