"""The runs listing and the lookup of one run, against real run dirs of the local host: the listing (one process
scan, one `find`, builtins per run) reads every state as a run's own probe (dflash_state) does; `stop/tail NAME`
find the newest run of that name by its directory name alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops import inventory, names, wire
from dflash_ops.errors import RunNotFound
from dflash_ops.runs import lifecycle, parse, read_scripts


def _run(runs: Path, rid: str, *, exit_code: str | None = "0", log: str = "done\n", pid: str | None = "999999999",
         stopped: bool = False, meta: bool = True) -> str:
    d = runs / rid
    d.mkdir(parents=True)
    if meta:
        (d / "run.json").write_text(json.dumps({"run_id": rid, "name": rid.rsplit("-", 2)[0], "argv": ["x"],
                                                "started_at": 1.0e9}, indent=1))   # newlines: read onto one line
    if pid is not None:
        (d / "pid").write_text(pid + "\n")
    (d / "output.log").write_text(log)
    if exit_code is not None:
        (d / "exit_code").write_text(exit_code + "\n")
    if stopped:
        (d / "stopped").write_text("")
    return rid


def _session():
    return lifecycle.Session.of(inventory.resolve_target(inventory.load_inventory(None), "local", None))


def test_the_listing_reads_every_state_as_the_runs_own_probe_does(ops_env):
    live = json.loads(ops_env.sub("launch", "job", "--json", "--", "--hold").stdout)
    runs = ops_env.runs_dir
    made = [_run(runs, "a-20260101T000000-0001"),
            _run(runs, "a-20260101T000001-0002", exit_code="3", log="x\ny\n"),
            _run(runs, "b-20260101T000002-0003", exit_code="143", log=wire.STOPPED_PREFIX + '{"step": 7}\n'),
            _run(runs, "b-20260101T000003-0004", exit_code=None, stopped=True, pid="garbage"),
            _run(runs, "c-20260101T000004-0005", exit_code=None, pid=None, meta=False)]
    (runs / "not a run-20260101T000005-0006").mkdir()
    (runs / "c-20260101T000006-0007").write_text("a file, no run dir")
    s = _session()
    listed = {r.run_id: r for r in lifecycle.list_runs(s)}
    assert set(listed) == set(made) | {live["run_id"]}
    for rid, r in listed.items():
        raw = parse.probe(s.run(read_scripts.probe_script(f"{runs}/{rid}"), "probe").stdout).raw
        assert (r.pid, r.exit_code, r.ended_at, r.log_size, r.stopped) == \
               (raw.pid, raw.exit_code, raw.ended_at, raw.log_size, raw.stopped), rid
        assert r.state == parse.state_of(raw, r.stopped_step), rid
    assert listed[live["run_id"]].state == "running"
    assert [listed[m].state for m in made] == ["exited", "exited", "stopped", "killed", "lost"]
    assert listed["b-20260101T000002-0003"].stopped_step == 7
    assert listed["a-20260101T000000-0001"].started_at == 1.0e9    # run.json read whole, across its newlines


def test_a_name_finds_its_newest_run_by_directory_name_and_no_other_names_run(ops_env):
    runs = ops_env.runs_dir
    for rid in ("a-20260101T000000-ffff", "a-20260301T000000-0000", "a-20260301T000000-0001",
                "a-b-20270101T000000-0000", "zz-20250101T000000-0000", "b-20280101T000000-0000"):
        _run(runs, rid)
    (runs / "a-20290101T000000-0000").write_text("a file named like a newer run")
    (runs / "b x-20300101T000000-0000").mkdir()       # newer, but no valid run id
    s = _session()
    assert lifecycle.find_run(s, "a").run_id == "a-20260301T000000-0001"
    assert lifecycle.find_run(s, "a-b").run_id == "a-b-20270101T000000-0000"
    assert lifecycle.find_run(s, "zz-20250101T000000-0000").name == "zz"
    assert lifecycle.find_run(s, None).run_id == "b-20280101T000000-0000"
    with pytest.raises(RunNotFound):
        lifecycle.find_run(s, "c")
    with pytest.raises(RunNotFound):
        lifecycle.find_run(s, "a-20290101T000000-0000")


def test_stop_by_name_among_many_finished_runs_stops_the_live_one(ops_env):
    for i in range(300):
        _run(ops_env.runs_dir, names.new_run_id("job", 1.0e9 + i, f"{i:04x}"))
    live = json.loads(ops_env.sub("launch", "job", "--json", "--", "--hold").stdout)
    done = ops_env.sub("stop", "job", "--json", "--grace", "5")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run_id"] == live["run_id"]
    assert not ops_env.pid_alive(live["pid"])


def _ids(runs: Path) -> set[str]:
    return {p.name for p in runs.iterdir() if names.is_run_id(p.name)}


def test_prune_lists_by_default_and_with_yes_removes_finished_runs_only(ops_env, tmp_path):
    runs = ops_env.runs_dir
    live = json.loads(ops_env.sub("launch", "job", "--json", "--", "--hold").stdout)
    old = [_run(runs, f"old-2026010{i}T000000-000{i}") for i in range(1, 6)]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not a run's")
    (runs / "lnk-20260101T000000-0009").symlink_to(outside)      # a link is never removed, nor what it points at
    before = _ids(runs)
    dry = ops_env.sub("runs", "--prune", "--keep", "1", "--json")
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)
    assert listed["dry_run"] and set(listed["runs"]) >= set(old[:4]) and old[4] not in listed["runs"]
    assert live["run_id"] not in listed["runs"] and listed["removed"] == []
    assert _ids(runs) == before                                   # a dry run removes nothing
    done = ops_env.sub("runs", "--prune", "--keep", "1", "--yes")
    assert done.returncode == 0, done.stderr
    assert _ids(runs) == {live["run_id"], old[4], "lnk-20260101T000000-0009"}
    assert (outside / "keep.txt").read_text() == "not a run's"
    assert ops_env.pid_alive(live["pid"])


def test_the_prune_script_itself_spares_a_live_run_whatever_it_is_asked(ops_env):
    live = json.loads(ops_env.sub("launch", "job", "--json", "--", "--hold").stdout)
    gone = _run(ops_env.runs_dir, "gone-20260101T000000-0001")
    done = lifecycle.prune(_session(), [live["run_id"], gone, "absent-20260101T000000-0002"])
    assert done.removed == (gone,) and done.spared == (live["run_id"],)
    assert (ops_env.runs_dir / live["run_id"]).is_dir() and ops_env.pid_alive(live["pid"])


def test_prune_older_than_goes_by_the_time_the_run_ended(ops_env):
    import os
    import time

    runs = ops_env.runs_dir
    ended_long_ago = _run(runs, "a-20260101T000000-0001")
    recent = _run(runs, "a-20260102T000000-0002")
    week = time.time() - 8 * 86400
    os.utime(runs / ended_long_ago / "exit_code", (week, week))
    done = ops_env.sub("runs", "--prune", "--older-than", "7", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed"] == [ended_long_ago]
    assert _ids(runs) == {recent}


@pytest.mark.parametrize("argv", [["--keep", "2"], ["--yes"], ["--older-than", "1"],
                                  ["a-20260101T000000-0001", "--prune"], ["--prune", "--keep", "-1"]])
def test_prune_options_without_prune_or_with_a_run_are_usage_errors(ops_env, argv):
    done = ops_env.sub("runs", *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
