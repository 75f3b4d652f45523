"""Shared fixtures: the session's tiny Qwen3 target (tests/conftest.py: `tiny_target_dir`) loaded through the real
code, one tiny target per supported family, and small configs and states over them."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    """A CPU run (no NVIDIA GPU here, or the gpu tests deselected, as the default `-m 'not gpu'` does) runs Triton's
    kernels under its CPU interpreter (tests/trainer/decode/test_kernels.py). Triton reads the choice when it is
    imported, so it is made here, before any test can import it. A `-m gpu` run on the H200 compiles them."""
    cpu_run = "not gpu" in " ".join((config.getoption("markexpr", "") or "").split())
    if cpu_run or not (Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi")):
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def kernels_off(monkeypatch):
    """Every decode kernel on (trainer/decode/switches.py), whatever DFLASH_DECODE_KERNELS_OFF says where the suite
    runs; a test switches some off by calling this fixture's value with their names, and they are on again after it."""
    from trainer.decode import switches

    monkeypatch.setattr(switches, "_off", set())
    monkeypatch.delenv(switches.ENV, raising=False)  # nor in a subprocess the test starts
    return switches.switch_off


@pytest.fixture
def interpreter(monkeypatch):
    """Our Triton kernels on CPU tensors, under Triton's interpreter (chosen in pytest_configure, before triton is
    imported)."""
    import triton  # noqa: F401 -- a dev dependency: its absence is a failure, not a skip

    from trainer import triton_device

    assert triton_device.interpreting(), ("TRITON_INTERPRET=1 must be set before triton is imported "
                                          "(tests/trainer/conftest)")
    monkeypatch.setattr(triton_device, "CPU_UNDER_INTERPRETER", True)
    patch_languages_once_per_launch(monkeypatch)


def patch_languages_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter swaps triton.language's builtins for interpreted ones at each launch and again at
    every call of a jitted helper inside each program (tl.sum, our row helpers): thousands of identical re-patches
    per launch, each walking the module's members, about half of a decode test's time. Here a helper's call skips
    the patch when the launch in progress has already patched the modules it sees, so the language each program
    runs is the one it ran before, patched once. For the test's duration; other Triton versions are left as they
    are (slower, not wrong)."""
    import inspect

    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = getattr(ti, "_patch_lang", None)
    if not triton.__version__.startswith("3.6.") or original is None:
        return
    patched: list[set[int]] = []  # per launch in progress: the language modules patched so far

    class Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:  # the launch's end (its `finally`)
            patched.pop()
            self.scope.restore()

    class Unchanged:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        seen = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if not patched:  # a launch: patched here, restored at its end as before
            scope = original(fn)
            patched.append(seen)
            return Launch(scope)
        if seen <= patched[-1]:  # a helper inside the launch whose modules are patched already
            return Unchanged()
        patched[-1] |= seen  # a helper seeing another module (tl.sum sees triton.language.core): patched as before
        return original(fn)

    monkeypatch.setattr(ti, "_patch_lang", patch_lang)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny saved target per supported family (tests/trainer/families.py), built once per run and shared by
    xdist's workers (`built_once`); tests read them, none writes into them."""
    from tests.conftest import built_once
    from tests.trainer.families import FAMILIES, build_family_target

    def build(root: Path) -> None:
        for f in FAMILIES:
            build_family_target(root / f, f)

    root = built_once(tmp_path_factory, "families", build)
    return {f: root / f for f in FAMILIES}


@pytest.fixture(scope="session")
def two_layer_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny saved targets of two layers (a hybrid's: one linear-attention, one full-attention), for the tests that
    run the batch generator under Triton's interpreter, whose cost grows with the layers; built once per run like
    `family_dirs`. Load them with tests/trainer/families.py `load_two_layers`."""
    from tests.conftest import built_once
    from tests.trainer.families import TWO_LAYER_FAMILIES, build_family_target

    def build(root: Path) -> None:
        for f in TWO_LAYER_FAMILIES:
            build_family_target(root / f, f, layers=2)

    root = built_once(tmp_path_factory, "two_layer_families", build)
    return {f: root / f for f in TWO_LAYER_FAMILIES}


@pytest.fixture(scope="session")
def target(tiny_target_dir):
    """Truncated training target with 2 taps (6 layers -> taps [1, 3])."""
    from trainer.model.target import load_target

    return load_target(tiny_target_dir, num_draft_layers=2)


@pytest.fixture(scope="session")
def full_target(tiny_target_dir):
    from trainer.model.target import load_target

    return load_target(tiny_target_dir, num_draft_layers=2, truncate=False)


def small_cfg(target_dir, *sets: str):
    """The smoke recipe shrunk for unit tests, pointed at the session target."""
    from trainer.config import load_config

    base = [f"model.target={target_dir}", "data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8",
            "optim.max_steps=6", "log.every=1", "ckpt.every=0", "eval_at_end=false", "threads=0"]
    return load_config("smoke", base + list(sets))


def make_state(target, block_size: int = 4, seed: int = 0, layers: int = 2, chunk: int = 7):
    import torch

    from trainer.model.drafter import Drafter, DrafterConfig
    from trainer.step.step import TrainState, build_optimizer

    torch.manual_seed(seed)
    dcfg = DrafterConfig.from_target(target.hf_config, num_layers=layers, num_taps=len(target.layer_ids))
    drafter = Drafter(dcfg)
    opt, lr_ = build_optimizer(drafter, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                               device=torch.device("cpu"))
    return TrainState(target=target, drafter=drafter, optimizer=opt, lr_=lr_, block_size=block_size, gamma=7.0,
                      loss_chunk=chunk, clip=1.0)


@pytest.fixture(scope="module")
def cuda_target(tiny_target_dir):
    """The full tiny target on CUDA in fp32 (gpu tier)."""
    import torch

    from trainer.model.target import load_target

    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return load_target(tiny_target_dir, num_draft_layers=2, device="cuda", dtype="float32", truncate=False)
