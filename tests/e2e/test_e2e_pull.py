"""`pull` over real SSH: from an emulated container (pct pull on the Proxmox host, then SFTP on the same
connection) and from a plain SSH host (SFTP), every file checked by size and SHA-256, nothing overwritten without
--force, nothing followed out of the run dir, host keys checked. ct0: the export and friends, ct1: a live log,
ct2: links and odd names where pct pull would follow them, ct3: names a staging file could collide with."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from e2e_bed import wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 4


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_export_from_a_container_checks_every_file_and_never_overwrites(bed, tmp_path, monkeypatch):
    ctid = bed.ct(0)
    secret = bed.work / "host-secret"          # outside every run dir; the job's export/leak points at it
    secret.write_text("not yours\n")
    doc = bed.launch(ctid, "--export", "700", "--leak", str(secret), name="pulled")
    run_dir = bed.tb.runs_dirs[ctid] / doc["run_id"]
    wait_for((run_dir / "exit_code").exists, "the job to write its files and end")
    to = tmp_path / "drafter"

    done = bed.proc("pull", "pulled", *bed.target(ctid), "--to", str(to), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    names = sorted(f["path"] for f in report["files"])
    assert names == ["export/config.json", "export/it's \"odd\" $(touch x).bin", "export/model.safetensors"]
    for f in report["files"]:
        src, dest = run_dir / f["path"], to / f["path"]
        assert dest.read_bytes() == src.read_bytes() and f["sha256"] == sha(src) and f["size"] == src.stat().st_size
    assert not (to / "export" / "leak").exists()            # a symlink out of the run dir is not followed
    assert sorted(p.name for p in (to / "export").iterdir()) == sorted(n.split("/")[1] for n in names)
    assert not (bed.work / "x").exists()                    # the odd name reached no shell

    # never overwrites: exit 5, one line naming the flag, the local file left as it was
    (to / "export" / "config.json").write_text("my edits\n")
    again = bed.cli("pull", "pulled", *bed.target(ctid), "--to", str(to))
    assert again.returncode == 5, again.stderr
    assert again.stderr.decode().splitlines() == [
        f"error: {to / 'export' / 'config.json'} exists (and 2 more); nothing was pulled",
        "hint: pass --force to overwrite, or --to another directory"]
    assert (to / "export" / "config.json").read_text() == "my edits\n"
    forced = bed.cli("pull", "pulled", *bed.target(ctid), "--to", str(to), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (to / "export" / "config.json").read_bytes() == (run_dir / "export" / "config.json").read_bytes()
    assert b"sizes and SHA-256 checked" in forced.stderr
    assert [p for p in to.rglob("*dflash-pull*")] == []     # no staging file or directory left behind

    # the newest checkpoint is step_10, not the lexically last step_2; the metrics file; the default --to
    ckpt = bed.cli("pull", doc["run_id"], *bed.target(ctid), "--what", "ckpt", "--to", str(tmp_path / "c"), "--json")
    assert [f["path"] for f in json.loads(ckpt.stdout)["files"]] == ["ckpt/step_10/drafter.pt"]
    monkeypatch.chdir(tmp_path)
    metrics = bed.cli("pull", "pulled", *bed.target(ctid), "--what", "metrics")
    assert metrics.returncode == 0, metrics.stderr
    assert (tmp_path / doc["run_id"] / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()
    # nothing was left on the Proxmox host's staging area
    assert [p for p in os.listdir("/var/tmp") if p.startswith("dflash-pull.")] == []


def test_pull_of_what_is_not_there_yet_is_exit_3_and_writes_nothing(bed, tmp_path):
    ctid = bed.ct(1)
    doc = bed.launch(ctid, "--gate", str(bed.gate("pull-live")), "--lines", "3", name="live")
    done = bed.cli("pull", "live", *bed.target(ctid), "--to", str(tmp_path / "x"))
    assert done.returncode == 3, done.stderr
    assert done.stderr.decode().splitlines()[0] == f"error: run {doc['run_id']} has no export on {bed.tb.host}/ct{ctid} yet"
    assert not (tmp_path / "x").exists()
    # a log still being written comes as the listed prefix, its hash checked
    log = bed.cli("pull", "live", *bed.target(ctid), "--what", "log", "--to", str(tmp_path / "l"), "--json")
    assert log.returncode == 0, log.stderr
    [f] = json.loads(log.stdout)["files"]
    got = (tmp_path / "l" / "output.log").read_bytes()
    assert got.startswith(b"job started\n") and len(got) == f["size"] and hashlib.sha256(got).hexdigest() == f["sha256"]
    bed.gate("pull-live").touch()


def test_pull_from_a_plain_ssh_host_goes_over_sftp_with_its_host_key_checked(bed, tmp_path):
    host_runs = bed.work / "host-runs"
    inv = bed.inventory_with("plain-ssh", transport="ssh", runs_dir=str(host_runs))
    done = bed.cli("launch", "job", "--host", bed.tb.host, "--name", "onhost", "--json", "--",
                   "--export", "64", inventory=inv)
    assert done.returncode == 0, done.stderr
    run_dir = host_runs / json.loads(done.stdout)["run_id"]
    wait_for((run_dir / "exit_code").exists, "the job to end")
    to = tmp_path / "plain"
    pulled = bed.cli("pull", "onhost", "--host", bed.tb.host, "--to", str(to), "--json", inventory=inv)
    assert pulled.returncode == 0, pulled.stderr
    assert (to / "export" / "model.safetensors").read_bytes() == (run_dir / "export" / "model.safetensors").read_bytes()
    unknown = bed.inventory_with("plain-unknown", transport="ssh", runs_dir=str(host_runs),
                                 known_hosts=bed.tb.sshd.empty_known_hosts())
    refused = bed.cli("pull", "onhost", "--host", bed.tb.host, "--to", str(tmp_path / "no"), inventory=unknown)
    assert refused.returncode == 77 and not (tmp_path / "no").exists()


def test_pull_from_a_container_never_follows_a_link_and_refuses_a_newline_name(bed, tmp_path):
    """pct pull opens a path inside the container and follows its links: the listing must not name one. A log or a
    metrics file linked elsewhere, a ckpt directory linked outside the run dir: exit 3, nothing pulled; a file whose
    name has a newline: exit 1, nothing pulled."""
    ctid = bed.ct(2)
    secret = bed.work / "ct2-secret"
    secret.write_text("not the run's\n")
    doc = bed.launch(ctid, "--export", "4", "--leak", str(secret), name="links")
    run_dir = bed.tb.runs_dirs[ctid] / doc["run_id"]
    wait_for((run_dir / "exit_code").exists, "the job to write its files and end")
    outside = bed.work / "ct2-elsewhere"
    os.rename(run_dir / "ckpt", outside)
    os.symlink(outside, run_dir / "ckpt")
    os.unlink(run_dir / "metrics.jsonl")
    os.symlink(secret, run_dir / "metrics.jsonl")
    os.rename(run_dir / "output.log", bed.work / "ct2-output.log")
    os.symlink(secret, run_dir / "output.log")
    where = f"{bed.tb.host}/ct{ctid}"
    for what, name in (("ckpt", "ckpt"), ("metrics", "metrics.jsonl"), ("log", "output.log")):
        done = bed.cli("pull", "links", *bed.target(ctid), "--what", what, "--to", str(tmp_path / what))
        assert done.returncode == 3, (what, done.stderr)
        assert done.stderr.decode().splitlines() == [
            f"error: run {doc['run_id']} has no {what} on {where} to pull: {name} is a symbolic link, and links "
            "are not followed"]
        assert not (tmp_path / what).exists()
    (run_dir / "export" / "new\nline.bin").write_bytes(b"x")
    done = bed.cli("pull", "links", *bed.target(ctid), "--to", str(tmp_path / "e"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.decode().splitlines()[0] == ("error: a file of the selection has a newline in its name; "
                                                    "nothing was pulled")
    assert not (tmp_path / "e").exists()
    assert [p for p in os.listdir("/var/tmp") if p.startswith("dflash-pull.")] == []


def test_pull_stages_privately_so_nothing_planted_is_written_through_and_every_name_pulls(bed, tmp_path):
    """Each file is fetched into a staging file created exclusively in a private directory beside its destination,
    then renamed into place: a link planted where a staging file could go is never written through nor moved into
    place, a run's file named like a staging file pulls like any other, and so does a name of 255 bytes."""
    ctid = bed.ct(3)
    doc = bed.launch(ctid, "--export", "4", name="staged")
    run_dir = bed.tb.runs_dirs[ctid] / doc["run_id"]
    wait_for((run_dir / "exit_code").exists, "the job to write its files and end")

    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    to = tmp_path / "log"
    to.mkdir()
    os.symlink(victim, to / ".output.log.dflash-pull")
    done = bed.cli("pull", "staged", *bed.target(ctid), "--what", "log", "--to", str(to))
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "mine\n"
    assert not (to / "output.log").is_symlink()
    assert (to / "output.log").read_bytes() == (run_dir / "output.log").read_bytes()

    extra = ["a", ".a.dflash-pull", "L" * 255]
    for name in extra:
        (run_dir / "export" / name).write_bytes(f"the bytes of {name}\n".encode())
    to = tmp_path / "e"
    done = bed.cli("pull", "staged", *bed.target(ctid), "--to", str(to), "--json")
    assert done.returncode == 0, done.stderr
    pulled = sorted(f["path"] for f in json.loads(done.stdout)["files"])
    assert all(f"export/{name}" in pulled for name in extra), pulled
    for rel in pulled:
        assert (to / rel).read_bytes() == (run_dir / rel).read_bytes(), rel
    assert sorted(p.name for p in (to / "export").iterdir()) == sorted(p.split("/")[1] for p in pulled)
