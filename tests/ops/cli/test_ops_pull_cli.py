"""pull on this machine (the local transport reads the files), its checks, and its refusal of unsafe listings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops import inventory
from dflash_ops.errors import RemoteFailed
from dflash_ops.runs import lifecycle, manifest, pull
from dflash_ops.ssh import transport


def _finished_run(ops_env) -> Path:
    done = ops_env.sub("launch", "job", "--json", "--", "--lines", "1")
    assert done.returncode == 0, done.stderr
    run_dir = Path(json.loads(done.stdout)["run_dir"])
    ops_env.wait_for(run_dir / "exit_code")
    (run_dir / "export").mkdir()
    (run_dir / "export" / "config.json").write_text('{"block_size": 16}\n')
    (run_dir / "export" / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    return run_dir


def test_pull_on_this_machine_copies_and_checks(ops_env, tmp_path):
    run_dir = _finished_run(ops_env)
    done = ops_env.sub("pull", run_dir.name, "--to", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / "export" / name).read_bytes() == (run_dir / "export" / name).read_bytes()
    assert f"{tmp_path / 'out' / 'export' / 'model.safetensors'}  250.0 KiB  sha256 " in done.stdout
    assert "2 file(s), 250.0 KiB" in done.stderr


class TamperingTransport(transport.LocalTransport):
    """A real local transport whose fetched bytes are changed in flight (what a hash check is for)."""

    def fetch(self, remote, local, size):
        digest = super().fetch(remote, local, size)
        data = bytearray(Path(local).read_bytes())
        data[0] ^= 1
        Path(local).write_bytes(bytes(data))
        return digest[:-1] + ("0" if digest[-1] != "0" else "1")


def test_bytes_that_do_not_match_their_listed_hash_are_not_kept(ops_env, tmp_path):
    run_dir = _finished_run(ops_env)
    target = inventory.resolve_target(inventory.Inventory(), None, None)
    s = lifecycle.Session(target, TamperingTransport())
    [run] = [r for r in lifecycle.list_runs(s) if r.run_id == run_dir.name]
    with pytest.raises(RemoteFailed, match="is not the listed"):
        pull.pull_files(s, run, "export", tmp_path / "out")
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "export/../../x", "a//b", "./a", "a\x1bb", ""])
def test_an_unsafe_path_in_a_listing_is_refused_before_anything_is_written(name):
    listing = f"DFLASH_ROOT /r/x\nDFLASH_FILE 1 {'0' * 64} {name}\n"
    with pytest.raises(RemoteFailed):
        manifest.parse_manifest(listing)


def test_the_cli_choices_are_the_selections():
    from dflash_ops.cli.pull import What

    assert {w.value for w in What} == set(manifest.WHAT)


def test_pull_never_follows_a_link_and_says_so(ops_env, tmp_path):
    """A log, a metrics file or a checkpoint directory that is a symbolic link (to a file or a directory outside
    the run dir) is not pulled: exit 3 naming the link; a link inside a selection is left out, named on stderr."""
    run_dir = _finished_run(ops_env)
    secret = tmp_path / "secret"
    secret.write_text("not the run's\n")
    outside = tmp_path / "outside-ckpt" / "step_99"
    outside.mkdir(parents=True)
    (outside / "drafter.pt").write_text("not the run's either\n")
    (run_dir / "output.log").unlink()
    (run_dir / "output.log").symlink_to(secret)
    (run_dir / "metrics.jsonl").symlink_to(secret)
    (run_dir / "ckpt").symlink_to(outside.parent)
    for what, name in (("log", "output.log"), ("metrics", "metrics.jsonl"), ("ckpt", "ckpt")):
        done = ops_env.sub("pull", run_dir.name, "--what", what, "--to", str(tmp_path / what))
        assert done.returncode == 3, (what, done.stderr)
        assert done.stderr.splitlines() == [
            f"error: run {run_dir.name} has no {what} on local to pull: {name} is a symbolic link, and links are "
            "not followed"], done.stderr
        assert not (tmp_path / what).exists()
    (run_dir / "ckpt").unlink()
    (run_dir / "ckpt" / "step_3").mkdir(parents=True)
    (run_dir / "ckpt" / "step_3" / "drafter.pt").write_text("weights at step 3\n")
    (run_dir / "ckpt" / "step_99").symlink_to(outside)              # the newest step is a link: skipped
    (run_dir / "export" / "leak").symlink_to(secret)
    ckpt = ops_env.sub("pull", run_dir.name, "--what", "ckpt", "--to", str(tmp_path / "c"), "--json")
    assert ckpt.returncode == 0, ckpt.stderr
    doc = json.loads(ckpt.stdout)
    assert [f["path"] for f in doc["files"]] == ["ckpt/step_3/drafter.pt"] and doc["links"] == ["ckpt/step_99"]
    export = ops_env.sub("pull", run_dir.name, "--to", str(tmp_path / "e"))
    assert export.returncode == 0, export.stderr
    assert "not pulled: export/leak (a symbolic link: links are not followed)" in export.stderr.splitlines()
    assert sorted(p.name for p in (tmp_path / "e" / "export").iterdir()) == ["config.json", "model.safetensors"]


def test_a_file_whose_name_has_a_newline_refuses_the_pull(ops_env, tmp_path):
    run_dir = _finished_run(ops_env)
    (run_dir / "export" / "two\nlines.bin").write_bytes(b"x")
    done = ops_env.sub("pull", run_dir.name, "--to", str(tmp_path / "out"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == ["error: a file of the selection has a newline in its name; nothing was pulled",
                                        "hint: rename it in the run dir, then pull again"]
    assert not (tmp_path / "out").exists()


def test_a_local_error_is_one_line(ops_env, tmp_path):
    run_dir = _finished_run(ops_env)
    too_long = tmp_path / ("n" * 256)
    done = ops_env.sub("pull", run_dir.name, "--to", str(too_long))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [f"error: cannot use {too_long / 'export' / 'config.json'}: File name too long"]
    (tmp_path / "full").write_text("a file where a directory must go\n")
    done = ops_env.sub("pull", run_dir.name, "--to", str(tmp_path / "full"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [f"error: cannot create {tmp_path / 'full' / 'export'}: Not a directory"]
