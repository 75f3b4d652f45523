"""Shared fixtures: environment isolation for every test, and the real SSH + emulated-Proxmox test bed.

Fixtures for the `ssh` tier (each fails loudly with the reason when root / openssh-server / util-linux is missing,
and refuses tests not marked `@pytest.mark.ssh`):
- `sshd`          the session's real sshd on 127.0.0.1 (restarted here if a test left it stopped); see support/sshd.py
- `fresh_sshd`    a private sshd for one test (its own port and keys)
- `containers`    factory: `containers(n=1, ctids=None) -> list[EmulatedContainer]`, all behind one pct shim;
                  stopped at teardown; see support/container.py
- `container`     one started container, ctid 200
- `testbed`       factory: `testbed(n=1, ctids=None, host="pve-test", default_host="local") -> Testbed`: sshd +
                  containers + inventory.yaml (support/testbed.py). For CLI end-to-end tests:
                  `tb = testbed(); cli(["--inventory", tb.inventory, …, "--host", tb.host, "--ct", tb.containers[0].ctid])`
- `host_tools`    factory: `host_tools(name, script_text) -> Path` puts an executable on the PATH of every SSH
                  session of `sshd` (e.g. a fake `nvidia-smi`); removed at teardown
- `repo_root`     the repository root (pass it as PYTHONPATH to subprocesses, with sys.executable)
- `tiny_target_dir`  one tiny Qwen3 target + tokenizer saved to disk (trainer.tiny), built once per run and shared by
                  xdist's workers (`built_once`), for the trainer's tests and the end-to-end runs of the real trainer
On failure, the sshd log and the container init logs are attached to the test report.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `support` importable whatever pytest's import mode

from support import container as ct_mod  # noqa: E402
from support import sshd as sshd_mod  # noqa: E402
from support.testbed import DEFAULT_HOST_NAME, build_testbed  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIRST_CTID = 200
# One intra-op thread per process (and per subprocess, which inherit it), set before torch is first imported: the
# suite runs two workers on two cores, and two processes each spinning two OpenMP threads slow each other's tiny
# ops several-fold (the whole suite ~25% slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The Ctrl-C tests send SIGINT to a CLI they started, as a terminal does. A shell starts a background job (`pytest &`,
# a CI step's job) with SIGINT ignored; its children inherit that, and Python then installs no KeyboardInterrupt
# handler, so the CLI would never see the Ctrl-C. A handled signal is reset to its default across exec: every
# subprocess of the suite meets SIGINT as from a terminal, however pytest itself was started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ------------------------------------------------------------------------------------------------ every test
@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway HOME and XDG dirs, plain fixed-width output, no DFLASH_OPS_* settings leaking in, and no system
    ssh config.

    Heavy tool caches (Hugging Face, Triton) keep their real location: they hold downloads and compiled kernels,
    not state the code under test owns. Returns the temporary HOME.
    """
    real_home = Path.home()
    home = tmp_path_factory.mktemp("home")
    for var in [v for v in os.environ if v.startswith("DFLASH_OPS_")]:
        monkeypatch.delenv(var)
    # This machine's /etc/ssh/ssh_config stays out of every test (and of the CLI subprocesses they start); the tests
    # of the system file point this at their own.
    monkeypatch.setenv("DFLASH_OPS_SSH_SYSTEM_CONFIG", "")
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", str(real_home / ".cache" / "huggingface")))
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", str(real_home / ".triton" / "cache")))
    monkeypatch.setenv("HOME", str(home))
    for var, sub in [("XDG_CONFIG_HOME", ".config"), ("XDG_STATE_HOME", ".local/state"),
                     ("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share")]:
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    return home


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """`build(dir)` once per pytest run, its directory shared: under pytest-xdist every worker's temp dir lies in
    one per-run root, and the first worker there builds while the others wait on a lock (fcntl; released when its
    holder dies). Without xdist it is the session's temp dir. Callers must not write into the directory."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:                    # the same in every worker of this run, new in the next (a --basetemp is reused)
        root, name = root.parent, f"{name}-{run}"
    out, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if out.exists():       # a builder that died half-way
                shutil.rmtree(out)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """Built once per run (~10 s of CPU: a few dozen training steps), shared by the xdist workers."""
    from trainer.tiny import build_tiny_target

    return built_once(tmp_path_factory, "tiny_target", lambda out: build_tiny_target(out, train_steps=60))


# ------------------------------------------------------------------------------------------------ ssh tier
def _require_ssh_tier(request: pytest.FixtureRequest, reasons: list[str]) -> None:
    """Fail (never skip) when the test is unmarked or the machine lacks what the real test bed needs."""
    if request.node.get_closest_marker("ssh") is None:
        pytest.fail(f"{request.node.nodeid} uses the real sshd/containers: mark it @pytest.mark.ssh", pytrace=False)
    if reasons:
        pytest.fail("ssh test bed unavailable: " + "; ".join(reasons), pytrace=False)


@pytest.fixture(scope="session")
def _session_sshd(tmp_path_factory: pytest.TempPathFactory):
    # Started lazily by the first test that asks for `sshd`; prerequisites are checked there, per test.
    server = sshd_mod.Sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def sshd(request: pytest.FixtureRequest, _session_sshd: sshd_mod.Sshd) -> sshd_mod.Sshd:
    """The shared sshd, running. A test may restart it (same port and host key); stopping it is repaired here."""
    _require_ssh_tier(request, sshd_mod.missing_prerequisites())
    if not _session_sshd.running:
        _session_sshd.stop()
        _session_sshd.start()
    request.node.stash[_LOG_SOURCES].append(("sshd log", _session_sshd.log_tail))
    return _session_sshd


@pytest.fixture
def host_tools(sshd: sshd_mod.Sshd):
    """Factory: `host_tools(name, script_text) -> Path`, an executable found by name in SSH sessions of `sshd`."""
    installed: list[Path] = []

    def install(name: str, text: str) -> Path:
        path = sshd.install_executable(name, text)
        installed.append(path)
        return path

    try:
        yield install
    finally:
        for path in installed:
            path.unlink(missing_ok=True)


@pytest.fixture
def fresh_sshd(request: pytest.FixtureRequest, tmp_path: Path):
    """A private sshd for this test only (own port, own keys), stopped at teardown."""
    _require_ssh_tier(request, sshd_mod.missing_prerequisites())
    server = sshd_mod.Sshd(tmp_path / "sshd")
    request.node.stash[_LOG_SOURCES].append(("fresh sshd log", server.log_tail))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def containers(request: pytest.FixtureRequest, tmp_path: Path):
    """Factory of started emulated containers sharing `tmp_path/pve` (one pct shim); all stopped at teardown."""
    _require_ssh_tier(request, ct_mod.missing_prerequisites())
    state_dir = tmp_path / "pve"
    started: list[ct_mod.EmulatedContainer] = []

    def start(n: int = 1, *, ctids: list[int] | None = None) -> list[ct_mod.EmulatedContainer]:
        if ctids is None:
            first = max((ct.ctid for ct in started), default=FIRST_CTID - 1) + 1
            ctids = list(range(first, first + n))
        new = ct_mod.start_containers(ctids, state_dir)
        started.extend(new)
        for ct in new:
            request.node.stash[_LOG_SOURCES].append((f"ct {ct.ctid} init log", ct.log_tail))
        return new

    try:
        yield start
    finally:
        for ct in started:
            ct.stop()


@pytest.fixture
def container(containers) -> ct_mod.EmulatedContainer:
    """One started emulated container, ctid 200."""
    return containers(1)[0]


@pytest.fixture
def testbed(sshd: sshd_mod.Sshd, containers, tmp_path: Path):
    """Factory: `testbed(n=1, *, ctids=None, host="pve-test", default_host="local") -> Testbed` (see module doc)."""

    def build(n: int = 1, *, ctids: list[int] | None = None, host: str = DEFAULT_HOST_NAME,
              default_host: str = "local"):
        return build_testbed(sshd, containers(n, ctids=ctids), tmp_path / "testbed", host=host,
                             default_host=default_host)

    return build


# ------------------------------------------------------------------------------------------------ file order
def slow_files_first(items: list) -> list:
    """The items, files with more `slow` tests first, each file's items kept together and in their order.

    Under `-n 2 --dist loadfile` xdist hands out whole files in this order (`--no-loadscope-reorder`, pyproject):
    the long files start first and the short ones fill in behind them. xdist's own order (most tests first) put the
    files of few long tests (one trainer process each) last, one worker running them while the other sat idle."""
    weight: dict = {}
    for item in items:
        weight[item.path] = weight.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    return sorted(items, key=lambda item: -weight[item.path])  # stable: a file's items stay as collected


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    items[:] = slow_files_first(items)


# ------------------------------------------------------------------------------------------------ failure logs
_LOG_SOURCES = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_LOG_SOURCES] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, tail in item.stash.get(_LOG_SOURCES, []):
            report.sections.append((title, tail()))
