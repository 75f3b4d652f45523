"""PROF lines of `python -m bench.step --profile N` (formatting only: the profiler itself needs CUDA)."""
from bench.timing import profile_lines


def test_prof_lines_are_slowest_first_per_step_with_full_names_and_a_total():
    long_name = "triton_red_fused__to_copy_add_amax_arange_argmax_div_eq_exp_gather_log_mul_select_sub_sum_" * 2
    kernels = [("gemm_a", 4000.0, 4), (long_name, 16000.0, 30), ("adam", 0.0, 2)]
    lines = profile_lines(kernels, n=2, label="compile+graph", top=2)
    assert lines[0].split()[:4] == ["PROF", "compile+graph", "8.00", "ms"]  # 16000 us over 2 steps
    assert lines[0].endswith(" " + long_name) and "80.0%" in lines[0] and "x15" in lines[0]
    assert lines[1].split()[2] == "2.00" and lines[1].endswith(" gemm_a")
    assert len(lines) == 3 and lines[-1] == "PROF compile+graph total device time 10.0 ms/step"


def test_no_kernels_gives_just_a_zero_total():
    assert profile_lines([], n=1, label="eager") == ["PROF eager total device time 0.0 ms/step"]
