"""benchmarks/trainer_throughput.py: its FLOP count and MFU against hand-computed values (and
prime-rl's published figures, which the same count reproduces from their tokens/s), the peak
table, the baseline ratios, and the fields a tiny CPU run writes. No wall-clock assertions."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location(
        "trainer_throughput", ROOT / "benchmarks" / "trainer_throughput.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trainer_throughput"] = module
    spec.loader.exec_module(module)
    return module


tt = _load()

QWEN3_06B_PARAMS = 596_049_920
"""By hand: embedding 151936 x 1024 = 155,582,464 (tied: the head shares it); per layer
q 1024x2048 + k, v 1024x1024 each + o 2048x1024 = 6,291,456, MLP 3 x 1024 x 3072 =
9,437,184, q/k norms 2 x 128, two RMSNorms 2 x 1024: 15,730,944, x 28 = 440,466,432; final
norm 1024."""

TINY_PARAMS = 205_184
"""By hand: embedding 2048 x 64 = 131,072; per layer q 64x64 + k, v 64x32 + o 64x64 = 12,288,
MLP 3 x 64 x 128 = 24,576, norms 2 x 16 + 2 x 64 = 160: 37,024, x 2 = 74,048; final norm 64."""


@pytest.mark.parametrize(
    ("shape", "expected"), [("qwen3-0.6b", QWEN3_06B_PARAMS), ("tiny", TINY_PARAMS)]
)
def test_parameter_count_of_the_shapes_matches_the_hand_count(shape: str, expected: int) -> None:
    data = tt.hf_config(shape, 16384)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):  # sizes only: no memory, no initialisation
        model = AutoModelForCausalLM.from_config(config)
    assert tt.count_params(model) == (expected, expected)


def test_flops_of_qwen3_06b_at_16k_and_64k_by_hand() -> None:
    flops = tt.step_flops(QWEN3_06B_PARAMS, QWEN3_06B_PARAMS, 28, 16, 128, [16384])
    # 6 N T and 6 L H d_head n^2, multiplied out by hand
    assert flops["dense"] == 58_594_091_335_680
    assert flops["attention"] == 92_358_976_733_184
    assert flops["total"] == 58_594_091_335_680 + 92_358_976_733_184
    long = tt.step_flops(QWEN3_06B_PARAMS, QWEN3_06B_PARAMS, 28, 16, 128, [65536])
    assert long["dense"] == 234_376_365_342_720
    assert long["attention"] == 1_477_743_627_730_944


@pytest.mark.parametrize(
    ("seq", "tokens_per_s", "published_mfu"), [(16384, 11896, 0.111), (65536, 10147, 0.268)]
)
def test_mfu_reproduces_prime_rl_published_mfu_from_its_tokens_per_s(
    seq: int, tokens_per_s: float, published_mfu: float
) -> None:
    flops = tt.step_flops(QWEN3_06B_PARAMS, QWEN3_06B_PARAMS, 28, 16, 128, [seq])["total"]
    value = tt.mfu(flops, seq / tokens_per_s, tt.peak_bf16_tflops("NVIDIA H100 80GB HBM3"))
    assert round(value, 3) == published_mfu
    assert tt.mfu(flops, 1.0, None) is None  # no published peak (a CPU): no MFU


def test_packed_documents_and_lora_count_by_hand() -> None:
    # two documents of 3 and 5 tokens, N = 100 of which 10 train (LoRA), L=2, H=3, d=4:
    # dense (4*100 + 2*10) * 8 = 3360; attention 6*2*3*4*(9 + 25) = 4896
    flops = tt.step_flops(100, 10, 2, 3, 4, [3, 5])
    assert flops == {"dense": 3360.0, "attention": 4896.0, "total": 8256.0}
    assert tt.doc_lengths(16384, 3) == [5462, 5461, 5461]
    with pytest.raises(SystemExit, match="--docs=4 with seq=200"):
        tt.doc_lengths(200, 4)


def test_peak_table_and_baseline_ratio_adjusted_by_peak() -> None:
    assert tt.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert tt.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert tt.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert tt.peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert tt.peak_bf16_tflops("cpu") is None
    # on an A100, 2974 tokens/s is a quarter of the H100 baseline's 11896, and
    # 0.25 * 989 / 312 = 0.79247 once the peaks are evened out
    ratios = tt.baseline_ratios("0.6b-16k", {"tokens_per_s": 2974.0, "mfu": 0.0555}, 312.0)
    assert ratios["tokens_per_s_ratio"] == 0.25
    assert ratios["tokens_per_s_ratio_peak_adjusted"] == 0.7925
    assert ratios["mfu_ratio"] == 0.5
    assert ratios["baseline"]["tokens_per_s"] == 11896
    cpu = tt.baseline_ratios("0.6b-16k", {"tokens_per_s": 2974.0, "mfu": None}, None)
    assert cpu["tokens_per_s_ratio_peak_adjusted"] is None and "mfu_ratio" not in cpu
    assert tt.baseline_ratios("tiny", {"tokens_per_s": 1.0}, None) is None


def test_tiny_cpu_run_writes_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    tt.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--docs",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["comparable_to_baselines"] is False and "not comparable" in data["note"]
    assert data["peak_bf16_tflops"] is None
    case = data["cases"]["tiny/docs2"]
    assert case["params"] == case["trainable_params"] == TINY_PARAMS
    assert case["tokens_per_step"] == 512 and case["doc_lengths"] == [256]
    assert case["attn_implementation"] == "sdpa" and case["packed"] is False
    assert len(case["step_s_all"]) == 2 and len(case["losses"]) == 3
    assert case["flops_per_step"] == tt.step_flops(TINY_PARAMS, TINY_PARAMS, 2, 4, 16, [256, 256])
    assert case["mfu"] is None
    assert case["tokens_per_s"] == pytest.approx(512 / case["step_s"], rel=1e-3)
    assert case["peak_memory_gib"] > 0 and case["peak_memory_kind"].startswith("peak RSS")
    # a second case merges into the same file instead of replacing it
    tt.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--seq",
            "256",
            "--out",
            str(out),
            "--attn",
            "eager",
        ]
    )
    merged = json.loads(out.read_text())
    assert sorted(merged["cases"]) == ["tiny/docs2", "tiny/eager/seq256"]
    assert merged["cases"]["tiny/eager/seq256"]["tokens_per_step"] == 256
