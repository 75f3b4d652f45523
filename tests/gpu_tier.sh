#!/usr/bin/env bash
# The gpu tier (tests marked `gpu`) on one H200, from the repository root, in one part or two:
#
#   bash tests/gpu_tier.sh 1     the training side: tests/trainer/gpu
#   bash tests/gpu_tier.sh 2     the rest: every other gpu test under tests/trainer (decoding), then gpu-reset alone
#   bash tests/gpu_tier.sh       both, one after the other
#
# Each part fits one device call well under 8 minutes: the tests spread over worker processes that share the one GPU
# (GPU_TIER_WORKERS, 6 by default), each test bounded by --timeout. A worker keeps one file's in-process tests
# together (--dist loadfile), as a serial run would: tests of many files in one process add up compiled flex entries
# past what a process is meant to hold, and a capture then meets eager flex. The long files whose tests are each a
# process of their own (the stop tests' trainer runs) or a family of their own spread test by test. The gpu-reset
# test runs last and alone: it needs idle GPUs and kills what holds them. The two-GPU tests skip on one GPU.
# Exit 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
case $part in 1|2|all) ;; *) echo "usage: bash tests/gpu_tier.sh [1|2|all]" >&2; exit 2;; esac
workers=${GPU_TIER_WORKERS:-6}
pytest_gpu() { python3 -m pytest -m gpu -p no:cacheprovider -rA --durations=10 --timeout 300 "$@"; }
rc=0
spread=(tests/trainer/gpu/test_families_2026_gpu.py tests/trainer/gpu/test_stop_gpu.py)
if [ "$part" != 2 ]; then
    pytest_gpu -n "$workers" --dist load "${spread[@]}" || rc=1
    pytest_gpu -n "$workers" --dist loadfile tests/trainer/gpu "${spread[@]/#/--ignore=}" || rc=1
fi
if [ "$part" != 1 ]; then
    pytest_gpu -n "$workers" --dist loadfile tests/trainer --ignore=tests/trainer/gpu || rc=1
    pytest_gpu tests/ops/status/test_gpu_reset_h200.py || rc=1
fi
exit $rc
