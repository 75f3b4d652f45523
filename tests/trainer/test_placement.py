"""Placement and torchrun-environment resolution (pure), and the dist / pipeline config sections."""
import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.placement import DistEnv, Placement, cpu_threads, dist_env, resolve_device, resolve_placement


def test_the_environments_omp_num_threads_caps_the_configs_threads():
    assert cpu_threads(2, {}) == 2 and cpu_threads(0, {"OMP_NUM_THREADS": "1"}) == 0  # 0: torch's default (OMP's)
    assert cpu_threads(2, {"OMP_NUM_THREADS": "1"}) == 1 and cpu_threads(2, {"OMP_NUM_THREADS": "8"}) == 2
    assert cpu_threads(4, {"OMP_NUM_THREADS": " 3 "}) == 3
    for odd in ("", "0", "-1", "two", "2,1"):  # not a positive count (OpenMP's nested lists too): the config's figure
        assert cpu_threads(4, {"OMP_NUM_THREADS": odd}) == 4


def test_cpu_threads_leave_the_busy_cores_to_their_processes():
    """A recipe's 2 threads on a 2-core box whose other core is busy run as 1 (2 ran tiny CPU work 4-6x slower);
    never fewer than one, and a config that sets none (0, torch's default) stays unset."""
    assert cpu_threads(2, {}, free_cores=1) == 1 and cpu_threads(2, {}, free_cores=2) == 2
    assert cpu_threads(2, {}, free_cores=0) == 1 and cpu_threads(2, {}, free_cores=-3) == 1
    assert cpu_threads(8, {"OMP_NUM_THREADS": "4"}, free_cores=6) == 4 and cpu_threads(0, {}, free_cores=1) == 0


def test_dist_env_reads_torchrun_variables_or_defaults_to_one_process():
    assert dist_env({}) == DistEnv(0, 1, 0)
    assert dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == DistEnv(3, 8, 3)
    assert dist_env({"RANK": "0", "WORLD_SIZE": "2"}).is_main
    with pytest.raises(ConfigError, match="must all be integers"):
        dist_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="must all be integers"):
        dist_env({"RANK": "1"})
    with pytest.raises(ConfigError, match="bad torchrun environment: RANK=2 WORLD_SIZE=2"):
        dist_env({"RANK": "2", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("spec, local, want", [
    ("auto", 3, "cuda:3"), ("cuda", 1, "cuda:1"), ("cuda:local", 5, "cuda:5"), ("cuda:local+2", 5, "cuda:7"),
    ("cuda:4", 0, "cuda:4"), ("cpu", 2, "cpu"),
])
def test_device_specs_on_an_8_gpu_host(spec, local, want):
    assert resolve_device(spec, local, True, 8) == want


def test_device_specs_without_cuda():
    assert resolve_device("auto", 1, False, 0) == "cpu"
    with pytest.raises(ConfigError, match="device cuda:local\\+2 needs CUDA"):
        resolve_device("cuda:local+2", 0, False, 0)
    with pytest.raises(ConfigError, match="resolves to cuda:8 on local rank 6, but this host has 8 GPU"):
        resolve_device("cuda:local+2", 6, True, 8)
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda:0", 0, False, 0, cpu_hint="use --device cpu (or auto)")
    assert e.value.hint == "use --device cpu (or auto)"


@pytest.mark.parametrize("spec", ["gpu", "mps", "cuda:1x", "cuda:-1", ""])
def test_a_spec_that_names_no_device_is_one_config_error(spec):
    for cuda in (True, False):  # not a ValueError's traceback on a GPU host
        with pytest.raises(ConfigError, match=f"device {spec!r} is not a device"):
            resolve_device(spec, 0, cuda, 8)


def test_seed_placement_targets_on_0_to_5_drafters_on_2_to_7():
    got = [resolve_placement("cuda:local+2", "cuda:local", "auto", DistEnv(r, 6, r), True, 8) for r in range(6)]
    assert [(p.target, p.drafter) for p in got] == [(f"cuda:{r}", f"cuda:{r + 2}") for r in range(6)]
    assert {p.backend for p in got} == {"nccl"}


def test_backend_follows_the_drafter_device_and_one_process_has_none():
    assert resolve_placement("cpu", "same", "auto", DistEnv(0, 2, 0), False, 0) == Placement("cpu", "cpu", "gloo")
    assert resolve_placement("auto", "same", "auto", DistEnv(0, 1, 0), True, 1) == Placement("cuda:0", "cuda:0", None)
    with pytest.raises(ConfigError, match="dist.backend=nccl needs the drafter on CUDA"):
        resolve_placement("auto", "same", "nccl", DistEnv(1, 2, 1), False, 0)


def test_config_sections_and_their_messages():
    cfg = load_config("smoke")
    assert (cfg.dist.backend, cfg.pipeline.enabled, cfg.pipeline.target_device, cfg.pipeline.slots) == \
        ("auto", False, "same", 3)
    gpu = load_config("gpu", ["pipeline.enabled=true", "pipeline.target_device=cuda:local", "device=cuda:local+2"])
    assert gpu.pipeline.enabled and gpu.device == "cuda:local+2"
    bad = {
        "pipeline.enabled=true": "pipeline.enabled needs CUDA (device=cpu); use --set pipeline.enabled=false",
        "pipeline.target_device=cuda:1": "add --set pipeline.enabled=true or use pipeline.target_device=same",
        "pipeline.slots=1": "pipeline.slots must be >= 2",
        "pipeline.prefetch=0": "pipeline.prefetch must be >= 1",
        "dist.backend=mpi": "dist.backend must be one of",
        "dist.backend=nccl": "dist.backend=nccl needs CUDA (device=cpu); use --set dist.backend=gloo",
        "device=cuda:local+x": "device must be auto, cpu, cuda, cuda:N or cuda:local\\+K",
    }
    for item, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
            load_config("smoke", [item])
    with pytest.raises(ConfigError, match="pipeline.target_device must be same, cuda, cuda:N or cuda:local\\+K"):
        load_config("gpu", ["pipeline.enabled=true", "pipeline.target_device=cpu"])
