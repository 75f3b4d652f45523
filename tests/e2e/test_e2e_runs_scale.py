"""Many finished runs in an emulated container, over the real sshd: `stop NAME` finds the live run by its directory
name, `runs` lists the live run and the newest others, `runs --prune --yes` removes finished runs only."""
from __future__ import annotations

import json

import pytest

from e2e_bed import marked_processes

pytestmark = pytest.mark.ssh
CONTAINERS = 1


def _finished(root, n: int) -> list[str]:
    ids = []
    for i in range(n):
        rid = f"old-20260101T{i // 3600:02d}{i // 60 % 60:02d}{i % 60:02d}-{i:04x}"
        (root / rid).mkdir()
        (root / rid / "output.log").write_text("done\n")
        (root / rid / "exit_code").write_text("0\n")
        ids.append(rid)
    return ids


def test_many_finished_runs_stop_by_name_listing_and_prune_in_a_container(bed):
    ctid = bed.ct(0)
    root = bed.tb.runs_dirs[ctid]
    live = bed.launch(ctid, "--gate", str(bed.gate("scale")), name="live")
    old = _finished(root, 300)

    listed = bed.cli("runs", *bed.target(ctid), "--json", "--limit", "5")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)] == old[-5:] + [live["run_id"]]
    assert b"and 295 older run(s) not listed" in listed.stderr

    dry = bed.cli("runs", "--prune", "--keep", "2", *bed.target(ctid), "--json")
    assert dry.returncode == 0 and json.loads(dry.stdout)["runs"] == old[:-2]
    done = bed.cli("runs", "--prune", "--keep", "2", "--yes", *bed.target(ctid), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed"] == old[:-2]
    assert sorted(p.name for p in bed.run_dirs(ctid)) == sorted(old[-2:] + [live["run_id"]])

    stop = bed.cli("stop", "live", *bed.target(ctid), "--grace", "5", "--json")
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["run_id"] == live["run_id"]
    assert marked_processes(bed.container(0), live["run_id"]) == []
