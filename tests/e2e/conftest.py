"""End-to-end fixtures: `bed` (module scope), the module's E2E test bed (see e2e_bed.py), built on the session's
real sshd and freshly started emulated containers; the containers stop when the module ends, which ends every job
inside them, as stopping a real container does. Every test module here sets `pytestmark = pytest.mark.ssh`.
"""
from __future__ import annotations

import json

import pytest

from e2e_bed import CACHE_DIR_NAME, E2E, JOB, RUNBOOK, hostile_values
from support import container as ct_mod
from support import sshd as sshd_mod
from support.testbed import build_testbed

FIRST_CTID = 300
DEFAULT_CONTAINERS = 3


def _prerequisites(request: pytest.FixtureRequest) -> None:
    """Fail (never skip) when the module is unmarked or the machine lacks what the real test bed needs."""
    if request.node.get_closest_marker("ssh") is None:
        pytest.fail(f"{request.node.nodeid}: e2e modules must set `pytestmark = pytest.mark.ssh`", pytrace=False)
    reasons = sshd_mod.missing_prerequisites() + ct_mod.missing_prerequisites()
    if reasons:
        pytest.fail("ssh test bed unavailable: " + "; ".join(reasons), pytrace=False)


def _write_runbooks(work, job, canary):
    runbooks = work / "runbooks"
    runbooks.mkdir()
    hostile_env = json.dumps("".join(hostile_values(canary)), ensure_ascii=False)
    text = RUNBOOK.format(job=job, hostile=hostile_env)
    (runbooks / "job.yaml").write_text(text)
    cache_dir = json.dumps(str(work / CACHE_DIR_NAME))
    cache_env = f"pre: [clear_inductor_cache]\nenv:\n  TORCHINDUCTOR_CACHE_DIR: {cache_dir}\n"
    (runbooks / "cachejob.yaml").write_text(text.replace("env:\n", cache_env, 1))
    return runbooks


@pytest.fixture(scope="module")
def bed(request: pytest.FixtureRequest, _session_sshd: sshd_mod.Sshd, tmp_path_factory: pytest.TempPathFactory):
    """The module's E2E bed; `CONTAINERS = n` in a test module asks for n containers (ctids 300, 301, ...)."""
    _prerequisites(request)
    if not _session_sshd.running:
        _session_sshd.stop()
        _session_sshd.start()
    work = tmp_path_factory.mktemp("e2e")
    n = getattr(request.module, "CONTAINERS", DEFAULT_CONTAINERS)
    cts = ct_mod.start_containers(list(range(FIRST_CTID, FIRST_CTID + n)), work / "pve")
    try:
        job = work / "job.py"
        job.write_text(JOB)
        canary = work / "canary"
        yield E2E(tb=build_testbed(_session_sshd, cts, work / "testbed"), runbooks=_write_runbooks(work, job, canary),
                  job=job, work=work, canary=canary)
    finally:
        for ct in cts:
            ct.stop()


@pytest.fixture(autouse=True)
def _running_sshd(request: pytest.FixtureRequest) -> None:
    """Every test on the bed starts with the session sshd up (a test may have restarted it); its log joins failures."""
    if "bed" in request.fixturenames:
        request.getfixturevalue("sshd")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    e2e = getattr(item, "funcargs", {}).get("bed")
    if report.failed and isinstance(e2e, E2E):
        for ct in e2e.tb.containers:
            report.sections.append((f"ct {ct.ctid} init log", ct.log_tail()))
