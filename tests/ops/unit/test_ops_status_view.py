"""status's text layout: lines break between values only, and stay inside the width whenever a value fits."""
from __future__ import annotations

from dflash_ops.cli.lines import wrap


def _text(lines) -> list[str]:
    return [" " * pad + "  ".join(c for c, _ in cells) for pad, cells in lines]


def test_wrap_breaks_between_cells_with_a_hanging_indent():
    cells = [(w, "") for w in ("job-20261130T101500-1a2b", "running", "pid 4242", "up 1h02m", "gpus 0,1")]
    assert _text(wrap(cells, 80, 4, 8)) == ["    job-20261130T101500-1a2b  running  pid 4242  up 1h02m  gpus 0,1"]
    narrow = _text(wrap(cells, 40, 4, 8))
    assert narrow == ["    job-20261130T101500-1a2b  running", "        pid 4242  up 1h02m  gpus 0,1"]
    assert all(len(line) <= 40 for line in narrow)


def test_a_cell_wider_than_the_line_is_kept_whole_on_its_own_line():
    long_id = "x" * 90
    assert _text(wrap([("a", ""), (long_id, ""), ("b", "")], 80, 2, 4)) == ["  a", "    " + long_id, "    b"]


def _status(run_id: str, state: str = "killed", exit_code=143, pid=4194304):
    from dflash_ops.spec import RunStatus

    return RunStatus(run_id=run_id, name=run_id.rsplit("-", 2)[0], state=state, pid=pid, exit_code=exit_code,
                     started_at=1_700_000_000.0, ended_at=1_700_007_384.0, now=1_700_007_400.0, run_dir="/r/x")


def test_runs_fit_the_width_as_a_table_or_as_wrapped_rows_never_cut():
    from dflash_ops.cli.render import runs_lines

    short = [_status("job-20261130T101500-1a2b", "exited", 0, 42), _status("job-20261130T111500-3c4d", "running", None)]
    table = _text(runs_lines("runs on local", short, 80))
    assert table[1].split() == ["run", "id", "state", "pid", "started", "duration"]
    assert table[2].startswith("  job-20261130T101500-1a2b  exited 0  42 ") and len(table) == 4
    assert all(len(line) <= 80 for line in table)
    long = [_status("graphwarm-ddp-b16-lr3e-4-20261130T012345-ab12"), _status("x" * 64 + "-20261130T012345-ab12")]
    for width in (80, 60):
        rows = _text(runs_lines("runs on pve1/ct200", long, width))
        assert "…" not in "".join(rows) and all(len(line) <= width for line in rows if len(line.split()) > 1)
        for r in long:       # every value whole, each after its label
            assert any(line.split()[0] == r.run_id for line in rows)
            assert any("pid 4194304" in line for line in rows) and any("took 2h03m" in line for line in rows)
            assert any("killed (143)" in line for line in rows)


def test_a_runs_many_fd_only_holders_are_one_line():
    from dflash_ops.cli.status_view import gpu_lines
    from dflash_ops.gpus import facts

    def holder(pid, *, app=False, pgid=100, comm="python3"):
        return facts.Holder(pid=pid, comm=comm, gpu_indices=(0,), used_mib=4096 if app else 0, is_compute_app=app,
                            pgid=pgid, starttime=1, ctid=200, ct_pid=pid - 1000, ct_pgid=pgid - 1000)

    held = (holder(1100, app=True), *(holder(1101 + i, comm="pt_main_thread" if i % 2 else "python3")
                                      for i in range(14)), holder(2000, pgid=2000, comm="dl_worker"))
    runs = {h.pid: "gw-20261130T101500-1a2b" for h in held if h.pgid == 100}
    snap = facts.GpuSnapshot(gpus=(facts.GpuInfo(0, "GPU-0", 4096, 143771, 97),))
    lines = _text(gpu_lines(snap, held, runs, 120))
    assert lines == ["  gpu 0  4096 / 143771 MiB   97%",
                     "      pid 1100 (ct200:100)  python3  4096 MiB  run gw-20261130T101500-1a2b",
                     "      14 processes (ct200)  python3, pt_main_thread  fd only  run gw-20261130T101500-1a2b",
                     "      pid 2000 (ct200:1000)  dl_worker  fd only"]
