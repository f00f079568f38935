"""benchmarks/kernel_breakdown.py on a synthetic Perfetto trace: GPU events only, summed by category."""

import gzip
import json

from helpers import benchmark_script

kb = benchmark_script("kernel_breakdown")


def _trace(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_e4m3e4m3_f32", "dur": 3000.0},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_bf16bf16_f32", "dur": 2000.0},
        {"ph": "X", "pid": 1, "name": "cudnn_flash_fprop", "dur": 1000.0},
        {"ph": "X", "pid": 1, "name": "loop_multiply_fusion", "dur": 500.0},
        {"ph": "X", "pid": 1, "name": "loop_multiply_fusion", "dur": 500.0},
        {"ph": "X", "pid": 1, "name": "mystery", "dur": 250.0},
        {"ph": "X", "pid": 1, "name": "nvjet_sm90_qrsss_128x160_128x5_2x1_v_bz_TNT", "dur": 700.0},
        {"ph": "X", "pid": 1, "name": "nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_TNT", "dur": 400.0},
        {"ph": "X", "pid": 1, "name": "fused_rotate_quantize_mx__5", "dur": 300.0},
        {"ph": "X", "pid": 1, "name": "fused_fold_from_mx__4", "dur": 100.0},
        {"ph": "X", "pid": 2, "name": "PjitFunction(train_step)", "dur": 99999.0},  # host: ignored
    ]
    folder = tmp_path / "profile" / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path / "profile"


def test_breakdown_sums_gpu_kernels_by_category(tmp_path):
    by_cat, kernels = kb.breakdown(kb.load_events(str(_trace(tmp_path))))
    assert by_cat == {
        "fp8 gemm": 3.7,  # by name (e4m3) and nvjet's type letters (q, r)
        "gemm": 2.4,
        "attention": 1.0,
        "elementwise fusion": 1.0,
        "quantizer (Pallas)": 0.4,
        "other": 0.25,
    }
    assert kernels[0] == ("sm90_xmma_gemm_e4m3e4m3_f32", 3.0, 1)
    assert ("loop_multiply_fusion", 1.0, 2) in kernels
    table = kb.to_markdown(by_cat, kernels, steps=2, top=3)
    assert "| fp8 gemm | 1.85 | 42.3% |" in table


def test_idle_time_is_the_span_no_kernel_covers():
    events = [  # two streams: 0-10 and 5-12 overlap, then gaps of 3 and 0.05 ms
        {"ts": 0.0, "dur": 10_000.0},
        {"ts": 5_000.0, "dur": 7_000.0},
        {"ts": 15_000.0, "dur": 1_000.0},
        {"ts": 16_050.0, "dur": 950.0},
        {"dur": 5.0},  # no start time: left out
    ]
    wall, idle, gaps = kb.idle_time(events)
    assert (wall, idle, gaps) == (17.0, 3.05, [3.0])
    assert kb.idle_time([]) == (0.0, 0.0, [])
