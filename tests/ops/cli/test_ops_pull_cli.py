"""pull on this machine (the local transport reads the files), its checks, and its refusal of unsafe listings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops import inventory
from dflash_ops.errors import RemoteFailed
from dflash_ops.runs import lifecycle, pull
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
        lifecycle.pull_files(s, run, "export", tmp_path / "out")
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "export/../../x", "a//b", "./a", "a\x1bb", ""])
def test_an_unsafe_path_in_a_listing_is_refused_before_anything_is_written(name):
    listing = f"DFLASH_ROOT /r/x\nDFLASH_FILE 1 {'0' * 64} {name}\n"
    with pytest.raises(RemoteFailed):
        pull.parse_manifest(listing)


def test_the_cli_choices_are_the_selections():
    from dflash_ops.cli.pull import What

    assert {w.value for w in What} == set(pull.WHAT)
