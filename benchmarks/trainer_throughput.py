"""Trainer throughput: tephra's RL update (log-probs through the fused kernel, PPO clipped
policy loss, backward, AdamW step) of a Qwen3-shaped model on one device, through engine-fsdp
(`FSDPEngine.forward_backward` + `optimizer_step` on one rank), at the shapes of prime-rl's
published single-H100 baselines, which are printed and stored beside the result.

    python benchmarks/trainer_throughput.py --case 0.6b-16k            # Qwen3-0.6B, 16,384 tokens/step
    python benchmarks/trainer_throughput.py --case 0.6b-64k            # 65,536 tokens/step
    python benchmarks/trainer_throughput.py --case 4b-lora16-16k       # Qwen3-4B, LoRA rank 16
    python benchmarks/trainer_throughput.py --tiny                     # a tiny Qwen3 on CPU (seconds)
    python benchmarks/trainer_throughput.py --case 0.6b-16k --attention-kernels  # + flex vs varlen

The model is built from a transformers `Qwen3Config` with the published sizes (random
weights, nothing downloaded). One step's batch is `--docs` sequences of equal length packed
into one micro-batch of `seq` tokens (`micro_batch.use_packing=true`,
`max_tokens_per_microbatch=seq`); the first 64 tokens of each sequence are its prompt, the
rest its response (what the log-probs and the loss cover). bf16 compute, fp32 master weights
and gradients, activation checkpointing on (`--no-checkpointing` to turn it off).

Attention: the engine runs packed sequences through `flash_attention_2` (when flash-attn is
installed) or `flex_attention` (a document mask from the restarting position ids); `--attn`
picks one. PyTorch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`) is not an
engine choice (engine-fsdp's `model.attn_implementation` takes sdpa, eager,
flash_attention_2, flex_attention), so `--attention-kernels` times the attention op alone,
forward + backward at the case's packing, for every kernel that runs here (flex with a
document mask, torch varlen, flash-attn).

FLOPs of a step (the count prime-rl's MFU figures match; causal attention counted as half of
the full square):
    (4 N + 2 N_trainable) T + 6 L H d_head sum_docs n_doc^2
N the model's parameters (tied embedding counted once), N_trainable those the optimizer
updates (= N without LoRA, giving 6 N T), T tokens of the step, L layers, H query heads,
n_doc each packed sequence's length. MFU = FLOPs / step seconds / the GPU's published dense
bf16 peak (`PEAK_BF16_TFLOPS`); null on a CPU. Step seconds: the median of `--steps` timed
steps after `--warmup` steps. Peak memory: `torch.cuda.max_memory_allocated` (CUDA), the
process's peak resident set (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from tephra.algos.objectives import ActorObjective
from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig
from tephra.engine_fsdp import FSDPEngine

RESULTS = Path(__file__).parent / "results"

SHAPES: dict[str, dict[str, Any]] = {
    # the published Qwen3 configs' sizes (Qwen/Qwen3-0.6B, Qwen/Qwen3-4B config.json)
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # the CPU check: the same architecture, small enough for seconds
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
}
QWEN3_COMMON = dict(model_type="qwen3", rope_theta=1_000_000.0, rms_norm_eps=1e-6)


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    seq: int
    """Tokens per step (one packed micro-batch)."""
    lora_rank: int = 0


CASES = {
    "0.6b-16k": Case("qwen3-0.6b", 16384),
    "0.6b-64k": Case("qwen3-0.6b", 65536),
    "4b-lora16-16k": Case("qwen3-4b", 16384, lora_rank=16),
    "tiny": Case("tiny", 512),
}

BASELINE_GPU = "NVIDIA H100 80GB HBM3"
BASELINES: dict[str, dict[str, float]] = {
    # prime-rl's published single-H100 (SXM) trainer benchmarks: full RL update of
    # Qwen3-0.6B at 16k and 64k tokens per step, Qwen3-4B with LoRA rank 16 at 16k
    "0.6b-16k": {"tokens_per_s": 11896, "mfu": 0.111, "step_s": 1.99, "peak_memory_gib": 12.5},
    "0.6b-64k": {"tokens_per_s": 10147, "mfu": 0.268},
    "4b-lora16-16k": {"tokens_per_s": 6229},
}

PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    # published dense (not sparse) bf16 tensor-core peaks, by a substring of
    # torch.cuda.get_device_name(); the first match wins, so specific names come first
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM (HBM3)
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
]

PROMPT_TOKENS = 64
"""Leading tokens of each packed sequence outside the loss (its prompt)."""


def peak_bf16_tflops(device_name: str) -> float | None:
    """The published dense bf16 peak of a GPU (TFLOP/s), None when the name is not in the
    table (or on a CPU)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def doc_lengths(seq: int, docs: int) -> list[int]:
    """`docs` sequences of (nearly) equal length that together fill `seq` tokens."""
    if docs < 1 or seq < docs * (PROMPT_TOKENS + 2):
        raise SystemExit(
            f"--docs={docs} with seq={seq}: each sequence needs more than "
            f"{PROMPT_TOKENS + 1} tokens; use fewer docs or a longer seq"
        )
    base, extra = divmod(seq, docs)
    return [base + (1 if i < extra else 0) for i in range(docs)]


def step_flops(
    n_params: int, n_trainable: int, layers: int, heads: int, head_dim: int, docs: list[int]
) -> dict[str, float]:
    """Model FLOPs of one update (forward + backward) of packed `docs` (see the module doc):
    dense = (4 N + 2 N_trainable) T; attention = 6 L H d_head sum n^2 (causal: half of the
    2 matmuls x 2 FLOPs x n^2 x H d_head forward, times 3 for forward + backward)."""
    tokens = sum(docs)
    dense = (4 * n_params + 2 * n_trainable) * tokens
    attention = 6 * layers * heads * head_dim * sum(n * n for n in docs)
    return {"dense": float(dense), "attention": float(attention), "total": float(dense + attention)}


def mfu(flops: float, step_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the published peak; None without one."""
    if peak_tflops is None:
        return None
    return flops / step_s / (peak_tflops * 1e12)


def baseline_ratios(
    case: str, result: dict[str, Any], peak_tflops: float | None
) -> dict[str, Any] | None:
    """This result over prime-rl's baseline for `case`: tokens/s ratio as measured, and the
    same adjusted by the ratio of published peaks when this GPU is not an H100 SXM (None
    where the peak is unknown, e.g. on a CPU)."""
    base = BASELINES.get(case)
    if base is None:
        return None
    h100 = peak_bf16_tflops(BASELINE_GPU)
    assert h100 is not None
    ratio = result["tokens_per_s"] / base["tokens_per_s"]
    out: dict[str, Any] = {
        "baseline": {"source": "prime-rl, published", "gpu": "H100 SXM 80GB", **base},
        "tokens_per_s_ratio": round(ratio, 4),
        "tokens_per_s_ratio_peak_adjusted": (
            round(ratio * h100 / peak_tflops, 4) if peak_tflops is not None else None
        ),
    }
    if "mfu" in base and result.get("mfu") is not None:
        out["mfu_ratio"] = round(result["mfu"] / base["mfu"], 4)
    return out


def hf_config(shape: str, seq: int) -> dict[str, Any]:
    """The transformers config dict of `shape`, positions long enough for `seq`."""
    # Qwen3's published max_position_embeddings is 40,960; RoPE itself has no limit
    return {**QWEN3_COMMON, **SHAPES[shape], "max_position_embeddings": max(40960, seq)}


def default_attention(device: str) -> str:
    """flash-attention 2 where installed on CUDA, else flex attention (a document mask); on
    a CPU sdpa over padded rows: torch's CPU flex attention has no backward (torch 2.13:
    "FlexAttention does not support backward on CPU")."""
    if device != "cuda":
        return "sdpa"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "flex_attention"


def rl_batch(vocab: int, docs: list[int], seed: int = 0) -> Any:
    """One row per sequence (equal lengths, so no padding), random tokens, prompt of
    `PROMPT_TOKENS`, advantages of +-1 per sequence (old log-probs: `run_case` adds the
    engine's own, so the update starts on-policy as an RL step's first update does)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(docs), max(docs)
    ids = torch.zeros(rows, width, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, n in enumerate(docs):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        attn[i, :n] = 1
        resp[i, PROMPT_TOKENS:n] = 1
    adv = torch.where(torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0) * resp
    return B.make_batch(ids, attn, resp, advantages=adv)


def _synced(device: str) -> float:
    if device == "cuda":  # GPU work is asynchronous: wait for it before reading the clock
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, trainable ones) of the module; shared (tied) tensors once. FSDP's
    DTensors count their global size."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def run_case(
    case_name: str,
    case: Case,
    *,
    device: str,
    attn: str,
    docs: int,
    steps: int,
    warmup: int,
    checkpointing: bool,
) -> dict[str, Any]:
    """Build the engine of `case`, run `warmup` + `steps` updates, return the figures."""
    shape = SHAPES[case.shape]
    lengths = doc_lengths(case.seq, docs)
    packed = attn in ("flash_attention_2", "flex_attention")  # else padded rows
    engine = FSDPEngine.build(
        EngineConfig(
            model={
                "hf_config": hf_config(case.shape, case.seq),
                "attn_implementation": attn,
                "gradient_checkpointing": checkpointing,
            },
            device=device,
            precision={"param_dtype": "bfloat16" if device == "cuda" else "float32"},
            optimizer={"lr": 1e-6},
            # packed: one micro-batch of `seq` real tokens; padded (sdpa): rows x longest row
            micro_batch={
                "max_tokens_per_microbatch": case.seq if packed else len(lengths) * max(lengths),
                "use_packing": packed,
            },
            lora={"rank": case.lora_rank, "alpha": 2.0 * case.lora_rank} if case.lora_rank else {},
        )
    )
    n_params, n_trainable = count_params(engine.hf_model)
    batch = rl_batch(shape["vocab_size"], lengths)
    with engine.eval_mode():  # the old policy's log-probs: the pass an RL step runs first
        batch[B.OLD_LOG_PROBS] = engine.forward(batch)["log_probs"]
    loss_fn = ActorObjective()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    losses = []
    for i in range(warmup + steps):
        t0 = _synced(device)
        with engine.train_mode():
            metrics = engine.forward_backward(batch, loss_fn)
            grad_norm = engine.optimizer_step()
        t1 = _synced(device)
        losses.append(metrics["loss"])
        if i >= warmup:
            times.append(t1 - t0)
        print(f"  {case_name} step {i}: {t1 - t0:.3f} s, grad norm {grad_norm:.3g}", flush=True)
    step_s = statistics.median(times)
    flops = step_flops(
        n_params,
        n_trainable,
        shape["num_hidden_layers"],
        shape["num_attention_heads"],
        shape["head_dim"],
        lengths,
    )
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_bf16_tflops(name) if device == "cuda" else None
    result: dict[str, Any] = {
        "model": case.shape,
        "model_shape": shape,
        "lora_rank": case.lora_rank,
        "params": n_params,
        "trainable_params": n_trainable,
        "tokens_per_step": case.seq,
        "docs_per_step": len(lengths),
        "doc_lengths": sorted(set(lengths)),
        "attn_implementation": attn,
        "packed": packed,
        "gradient_checkpointing": checkpointing,
        "compute_dtype": "bfloat16" if device == "cuda" else "float32",
        "warmup_steps": warmup,
        "timed_steps": steps,
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_s": round(case.seq / step_s, 1),
        "flops_per_step": flops,
        "achieved_tflops": round(flops["total"] / step_s / 1e12, 3),
        "mfu": None if peak is None else round(mfu(flops["total"], step_s, peak) or 0.0, 4),
        "peak_memory_gib": round(peak_memory_gib(device), 3),
        "peak_memory_kind": "torch.cuda.max_memory_allocated"
        if device == "cuda"
        else "peak RSS of the process (ru_maxrss)",
        "losses": [round(x, 6) for x in losses],
    }
    # the baselines ran their case's shape, length and rank on one sequence per step
    same = case == CASES.get(case_name) and len(lengths) == 1
    ratios = baseline_ratios(case_name, result, peak) if same else None
    if ratios is not None:
        result["vs_prime_rl"] = ratios
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _median_ms(fn: Callable[[], None], device: str, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = _synced(device)
        fn()
        times.append(_synced(device) - t0)
    return statistics.median(times) * 1e3


def attention_kernels(case: Case, docs: int, device: str) -> dict[str, Any]:
    """Forward + backward of one layer's attention over the packed `case` (bf16), per
    kernel that runs here: flex attention with a document causal mask, PyTorch's varlen
    attention, flash-attn's varlen function. Milliseconds (median of 5 after 2) and TFLOP/s
    (6 H d_head sum n^2 per call)."""
    shape = SHAPES[case.shape]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    lengths = doc_lengths(case.seq, docs)
    total = sum(lengths)
    flops = 6 * heads * d * sum(n * n for n in lengths)
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    g = torch.Generator(device=device).manual_seed(0)

    def tensors(h: int) -> torch.Tensor:
        return torch.randn(total, h, d, device=device, dtype=torch.bfloat16, generator=g)

    q, k, v = (
        tensors(heads).requires_grad_(),
        tensors(kv).requires_grad_(),
        tensors(kv).requires_grad_(),
    )
    grad = tensors(heads)
    out: dict[str, Any] = {
        "tokens": total,
        "doc_lengths": sorted(set(lengths)),
        "heads": heads,
        "kv_heads": kv,
        "head_dim": d,
        "kernels": {},
    }

    outputs: dict[str, torch.Tensor] = {}

    def record(name: str, call: Callable[[], torch.Tensor]) -> None:
        def fwd_bwd() -> None:
            q.grad = k.grad = v.grad = None
            call().backward(grad)

        try:
            ms = _median_ms(fwd_bwd, device)
            with torch.no_grad():
                outputs[name] = call().float()
            out["kernels"][name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as exc:  # a kernel this torch lacks or refuses: record why
            out["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"  attention {name}: {out['kernels'][name]}", flush=True)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )

    def document_causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (doc[qi] == doc[ki]) & (qi >= ki)

    mask = create_block_mask(document_causal, None, None, total, total, device=device)
    flex = torch.compile(flex_attention)
    record(
        "flex_attention",
        lambda: flex(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=mask,
            enable_gqa=True,
        )[0].transpose(0, 1),
    )
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        # torch 2.10 took `is_causal`; later versions a (left, right) window, (-1, 0) causal;
        # GQA needs `enable_gqa` where it exists, else the KV heads repeated
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        gqa = "enable_gqa" in params
        rep = heads // kv

        def varlen() -> torch.Tensor:
            kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
            extra = {"enable_gqa": True} if gqa else {}
            return varlen_attn(q, kk, vv, cu, cu, max(lengths), max(lengths), **causal, **extra)

        record("torch_varlen", varlen)
    else:
        out["kernels"]["torch_varlen"] = {
            "error": f"torch {torch.__version__} has no torch.nn.attention.varlen"
        }
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        record(
            "flash_attn",
            lambda: flash_attn_varlen_func(
                q, k, v, cu, cu, max(lengths), max(lengths), causal=True
            ),
        )
    else:
        out["kernels"]["flash_attn"] = {"error": "flash-attn is not installed"}
    # the kernels compute the same attention: each output's largest gap to the first's (bf16)
    first = next(iter(outputs), None)
    for name, value in outputs.items():
        out["kernels"][name]["max_abs_diff_vs_" + str(first)] = float(
            (value - outputs[str(first)]).abs().max()
        )
    timed = {n: r["ms"] for n, r in out["kernels"].items() if "ms" in r}
    out["fastest"] = min(timed, key=timed.__getitem__) if timed else None
    return out


def _cpu_model() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _write(path: Path, record: dict[str, Any]) -> None:
    """Merge `record` into the JSON at `path`: cases and kernel timings replace those of
    the same name, so the 16k and 64k runs (separate processes, separate device calls) land
    in one file."""
    old: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if old.get("device") != record["device"]:
        old = {}
    merged = {**old, **{k: v for k, v in record.items() if k not in ("cases", "attention")}}
    merged["cases"] = {**old.get("cases", {}), **record["cases"]}
    merged["attention"] = {**old.get("attention", {}), **record["attention"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--case",
        action="append",
        choices=sorted(CASES),
        help="a case to run (repeatable; default: 0.6b-16k)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny case on this machine's device, 2 warm-up + 3 timed steps",
    )
    parser.add_argument("--seq", type=int, help="tokens per step, overriding the case's")
    parser.add_argument("--lora-rank", type=int, help="LoRA rank, overriding the case's (0: full)")
    parser.add_argument(
        "--docs",
        type=int,
        default=1,
        help="packed sequences per step (1: one sequence of seq tokens, the baselines' layout)",
    )
    parser.add_argument(
        "--attn",
        choices=["auto", "flex_attention", "flash_attention_2", "sdpa", "eager"],
        default="auto",
        help="engine attention (auto: flash-attn if installed, "
        "else flex; on a CPU sdpa; sdpa runs padded rows, no packing)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="keep every activation (no gradient checkpointing)",
    )
    parser.add_argument(
        "--attention-kernels",
        action="store_true",
        help="also time the attention kernels alone (CUDA)",
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--out",
        help="results JSON (merged by case; default "
        "results/trainer_throughput.json, _cpu.json on a CPU)",
    )
    args = parser.parse_args(argv)
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    names = ["tiny"] if args.tiny else (args.case or ["0.6b-16k"])
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 2)
    attn = default_attention(device) if args.attn == "auto" else args.attn
    out = (
        Path(args.out)
        if args.out
        else RESULTS
        / ("trainer_throughput.json" if device == "cuda" else "trainer_throughput_cpu.json")
    )
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({_cpu_model()})"
    peak = peak_bf16_tflops(name) if device == "cuda" else None
    record: dict[str, Any] = {
        "device": name,
        "comparable_to_baselines": device == "cuda",
        "note": "CPU numbers check the script only; they are not comparable to the GPU baselines"
        if device == "cpu"
        else "one GPU, engine-fsdp on one rank",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "peak_bf16_tflops": peak,
        "flop_formula": "(4 N + 2 N_trainable) T + 6 L H d_head sum_docs n_doc^2 "
        "(= 6 N T + causal attention without LoRA)",
        "cases": {},
        "attention": {},
    }
    torch.manual_seed(0)
    for case_name in names:
        case = CASES[case_name]
        if args.seq:
            case = dataclasses.replace(case, seq=args.seq)
        if args.lora_rank is not None:
            case = dataclasses.replace(case, lora_rank=args.lora_rank)
        print(f"{case_name}: {case} on {name}, attention {attn}", flush=True)
        result = run_case(
            case_name,
            case,
            device=device,
            attn=attn,
            docs=args.docs,
            steps=args.steps,
            warmup=args.warmup,
            checkpointing=not args.no_checkpointing,
        )
        # a case run with other settings than its own is stored under a name that says so
        key = case_name + "".join(
            suffix
            for suffix, changed in (
                (f"/{attn}", attn != default_attention(device)),
                (f"/seq{case.seq}", case.seq != CASES[case_name].seq),
                (f"/lora{case.lora_rank}", case.lora_rank != CASES[case_name].lora_rank),
                (f"/docs{args.docs}", args.docs != 1),
                ("/no-checkpointing", args.no_checkpointing),
            )
            if changed
        )
        record["cases"][key] = result
        summary = {k: result[k] for k in ("tokens_per_s", "step_s", "mfu", "peak_memory_gib")}
        print(f"{key}: {json.dumps(summary)}", flush=True)
        if "vs_prime_rl" in result:
            print(f"  vs prime-rl: {json.dumps(result['vs_prime_rl'])}", flush=True)
        if args.attention_kernels:
            where = f"{case.seq}x{args.docs}"
            if device != "cuda":
                record["attention"][where] = {
                    "skipped": "timed on CUDA only (torch's varlen "
                    "and flash-attn have no CPU kernels, CPU flex "
                    "attention no backward)"
                }
            else:
                try:
                    record["attention"][where] = attention_kernels(case, args.docs, device)
                except Exception as exc:  # the engine's figures above still count
                    record["attention"][where] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        _write(out, record)  # after every case: a later case that fails keeps this one
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
