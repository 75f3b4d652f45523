"""PROF, PROFSUM and PROFGAP lines of `python -m bench.step --profile N` (from given kernel lists: the profiler
itself needs CUDA)."""
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


def test_the_summary_sums_by_category_and_says_the_uncovered_time_and_the_gemm_rate():
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 6000.0, 20),
               ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", 2000.0, 4),
               ("triton_tem_fused_flex_attention_0", 4000.0, 10), ("triton_poi_fused_add_mul_0", 1000.0, 30),
               ("void at::native::multi_tensor_apply_kernel<FusedAdam>", 500.0, 2), ("Memcpy DtoD", 500.0, 2),
               ("triton_red_fused__to_copy_add_arange_argmax_eq_exp_log_mul_prepare_softmax_online_sub_0", 0.0, 8)]
    from bench.timing import kernel_category, profile_summary

    assert [kernel_category(k[0]) for k in kernels] == ["gemm", "gemm", "attention", "fused elementwise/reduction",
                                                        "optimizer", "copy/fill", "lm-head softmax/CE"]
    lines = profile_summary(kernels, n=2, label="graph", step_ms=10.0, matmul_flops=4e12)
    assert lines[0].split()[2:5] == ["gemm", "4.00", "ms"] and "40.0%" in lines[0] and lines[0].endswith("x12")
    assert "no kernel running" in lines[-2] and lines[-2].split()[-3:] == ["3.00", "ms", "30.0%"]  # 10 - 7 ms
    assert lines[-1] == "PROFSUM graph gemm rate 1000 TFLOP/s (4.0 TFLOP in 4.0 ms)"


def test_gap_lines_count_overlap_once_and_name_the_activities_around_each_gap():
    from bench.timing import gap_lines

    # two steps, us: a second stream's kernel (`side`) overlaps `gemm` and ends after it
    one = [("gemm", 0, 400), ("side", 200, 500), ("cat", 600, 700), ("attn", 1000, 1400)]
    device = one + [(name, start + 1500, end + 1500) for name, start, end in one]
    lines = gap_lines(device, n=2, label="graph")
    # window 2900 us, busy 2 x (500 + 100 + 400) = 2000, idle 900; per step
    assert lines[0] == "PROFGAP graph window 1.45 ms/step, device busy 1.00, idle 0.45"
    assert lines[1].split()[2:5] == ["0.300", "ms", "x1.0"] and lines[1].endswith("after cat | before attn")
    # the gap before `cat` is named after `side`, the activity that ended last, not `gemm`, which started last
    assert lines[2].split()[2:5] == ["0.100", "ms", "x1.0"] and lines[2].endswith("after side | before cat")
    assert lines[3].split()[2:5] == ["0.050", "ms", "x0.5"] and lines[3].endswith("after attn | before gemm")
    assert len(lines) == 4
    assert gap_lines([], n=1, label="eager") == ["PROFGAP eager no device activity recorded"]


def test_only_device_work_counts_not_the_annotation_spans_around_it():
    from types import SimpleNamespace

    import torch

    from bench.timing import on_device

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert on_device(SimpleNamespace(device_type=cuda, is_user_annotation=False))  # a kernel
    assert not on_device(SimpleNamespace(device_type=cuda, is_user_annotation=True))  # "## Call CompiledFxGraph ##"
    assert not on_device(SimpleNamespace(device_type=cpu, is_user_annotation=False))  # cudaLaunchKernel


def test_decode_kernels_fall_in_their_categories_and_no_gemm_rate_without_flops():
    """SDPA's flash / efficient / cuDNN kernels and the Gated DeltaNet state step are attention, FP8 `_scaled_mm`
    GEMMs are gemm, the FP8 activation quantizers are their own category; without FLOPs no gemm rate line."""
    from bench.timing import kernel_category, profile_summary

    names = {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>": "attention",
             "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
             "cudnn_generated_fort_native_sdpa_sm90_knob_7": "attention",
             "gated_delta_step": "attention", "step_attention": "attention", "attention_rows": "attention",
             "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128": "gemm",
             "nvjet_qqtst_128x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
             "quantize_e4m3_rows": "fp8 quantize", "swiglu_e4m3_row": "fp8 quantize",
             "rms_norm_rows": "other elementwise"}
    assert {name: kernel_category(name) for name in names} == names
    lines = profile_summary([("nvjet_x", 2000.0, 2)], n=2, label="static", step_ms=2.0, matmul_flops=0.0)
    assert not any("gemm rate" in line for line in lines) and lines[0].split()[2] == "gemm"
