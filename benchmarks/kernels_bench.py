"""MLA kernel benchmark on one GPU: prefill/training TFLOP/s against torch SDPA, decode GB/s against HBM.

    python benchmarks/kernels_bench.py --json kernels_bench.json [--quick] [--hbm-tb-s 4.8]
    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/kernels_bench.py --compile all   # no GPU: resources per kernel config

Prints one JSON object per measurement and appends it as a record (benchmarks/harness.py:
benchmarks/records/kernels_bench.jsonl, or ``--records PATH``), then a summary JSON object and a Markdown table.
Shapes: DeepSeek-like (d_n 128, d_r 64, d_v 128, r 512, H 32..128) and SmolLM2-MLA (H 9, d_n 64,
d_v 64, d_r 16..32, r 128..512). bf16 throughout. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import harness
from kernels_compile import compile_report

DEVICE = "cuda"


# (name, B, H, T, d_n, d_r, d_v) of the prefill cases, (name, B, H, T, d_n, d_r, d_v, r) of the decode cases
PREFILL_SHAPES = (
    ("deepseek-H32", 1, 32, 4096, 128, 64, 128),
    ("deepseek-H128", 1, 128, 2048, 128, 64, 128),
    ("smollm2-mla-dr16", 4, 9, 2048, 64, 16, 64),
    ("smollm2-mla-dr32", 4, 9, 2048, 64, 32, 64),
)
DECODE_SHAPES = (
    ("deepseek-H128-r512", 32, 128, 4096, 128, 64, 128, 512),
    ("deepseek-H32-r512", 64, 32, 8192, 128, 64, 128, 512),
    ("deepseek-H128-r512-B1", 1, 128, 32768, 128, 64, 128, 512),
    ("smollm2-mla-r128", 64, 9, 4096, 64, 32, 64, 128),
    ("smollm2-mla-r480", 64, 9, 4096, 64, 16, 64, 480),
)
SMOKE_PREFILL_SHAPES = (("smoke", 1, 2, 64, 16, 16, 16),)  # --smoke: tiny shapes on the CPU
SMOKE_DECODE_SHAPES = (("smoke", 2, 3, 64, 16, 16, 16, 24),)


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    if DEVICE != "cuda":  # --smoke on CPU: one timed call, only to exercise the code path
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms))


def attention_flops(batch, heads, tokens, d_qk, d_v, backward=False):
    """Causal: half of the Tq x Tk score matrix. Forward QK^T + PV; backward recomputes QK^T and adds
    dV, dP, dQ, dK (3 d_qk-wide + 2 d_v-wide products)."""
    pairs = batch * heads * tokens * tokens / 2
    forward = 2 * pairs * (d_qk + d_v)
    return 2 * pairs * (3 * d_qk + 2 * d_v) if backward else forward


def prefill_case(name, batch, heads, tokens, d_nope, d_rope, d_v, dtype=None):
    import torch

    from mha2mla.kernels.ops import flash_mla_attention

    dtype = dtype or torch.bfloat16
    dev = DEVICE
    q = torch.randn(batch, heads, tokens, d_nope + d_rope, device=dev, dtype=dtype, requires_grad=True)
    k_nope = torch.randn(batch, heads, tokens, d_nope, device=dev, dtype=dtype, requires_grad=True)
    k_pe = torch.randn(batch, tokens, d_rope, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, heads, tokens, d_v, device=dev, dtype=dtype, requires_grad=True)
    scale = (d_nope + d_rope) ** -0.5
    grad = torch.randn(batch, heads, tokens, d_v, device=dev, dtype=dtype)

    def ours():
        return flash_mla_attention(q, k_nope, k_pe, v, scale, backend="triton")

    key = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1).detach().requires_grad_(True)

    def sdpa():  # the per-head key that transformers builds
        return torch.nn.functional.scaled_dot_product_attention(q, key, v, is_causal=True, scale=scale)

    result = {"kind": "prefill", "name": name, "B": batch, "H": heads, "T": tokens, "d_n": d_nope, "d_r": d_rope,
              "d_v": d_v, "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad():
        reference = sdpa().float()
        result["max_abs_err_vs_sdpa"] = (ours().float() - reference).abs().max().item()
    fwd_flops = attention_flops(batch, heads, tokens, d_nope + d_rope, d_v)
    bwd_flops = attention_flops(batch, heads, tokens, d_nope + d_rope, d_v, backward=True)
    for label, fn in (("ours", ours), ("sdpa", sdpa)):
        fn().backward(grad)  # first use: compiles, and autotunes our kernel for this shape (mha2mla/kernels/tuning.py)
        with torch.no_grad():
            fwd_ms = bench_ms(fn)
        out = fn()
        bwd_ms = bench_ms(lambda out=out: out.backward(grad, retain_graph=True))
        result[f"{label}_fwd_ms"] = fwd_ms
        result[f"{label}_bwd_ms"] = bwd_ms
        result[f"{label}_fwd_tflops"] = fwd_flops / fwd_ms / 1e9
        result[f"{label}_bwd_tflops"] = bwd_flops / bwd_ms / 1e9
        del out
    result["fwd_speedup_vs_sdpa"] = result["sdpa_fwd_ms"] / result["ours_fwd_ms"]
    result["bwd_speedup_vs_sdpa"] = result["sdpa_bwd_ms"] / result["ours_bwd_ms"]
    return result


def decode_case(name, batch, heads, tokens, d_nope, d_rope, d_v, rank, hbm_tb_s, dtype=None):
    import torch

    from mha2mla.kernels.ops import mla_decode, mla_decode_latent
    from mha2mla.kernels.reference import mla_decode_reference

    dtype = dtype or torch.bfloat16
    dev = DEVICE
    cache = torch.randn(batch, tokens, rank + d_rope, device=dev, dtype=dtype)  # (B, T, r + d_r)
    q_nope = torch.randn(batch, heads, d_nope, device=dev, dtype=dtype)
    q_pe = torch.randn(batch, heads, d_rope, device=dev, dtype=dtype)
    w_uk = torch.randn(heads, d_nope, rank, device=dev, dtype=dtype) * rank**-0.5
    w_uv = torch.randn(heads, d_v, rank, device=dev, dtype=dtype) * rank**-0.5
    seqlens = torch.full((batch,), tokens, device=dev, dtype=torch.int32)
    scale = (d_nope + d_rope) ** -0.5
    latent, k_pe = cache[..., :rank], cache[..., rank:]
    q_lat = torch.randn(batch, heads, rank, device=dev, dtype=dtype)

    result = {"kind": "decode", "name": name, "B": batch, "H": heads, "T": tokens, "r": rank, "d_r": d_rope,
              "dtype": str(dtype).removeprefix("torch.")}
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale, backend="triton")
    want = mla_decode_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale)
    result["max_abs_err_vs_reference"] = (got.float() - want.float()).abs().max().item()
    cache_bytes = cache.numel() * cache.element_size()
    kernel_ms = bench_ms(lambda: mla_decode_latent(q_lat, q_pe, latent, k_pe, seqlens, scale, backend="triton"))
    step_ms = bench_ms(lambda: mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale, backend="triton"))
    torch_ms = bench_ms(lambda: mla_decode_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale))
    result["cache_mb"] = cache_bytes / 1e6
    result["kernel_ms"] = kernel_ms
    result["kernel_gb_s"] = cache_bytes / kernel_ms / 1e6
    result["kernel_fraction_of_hbm"] = result["kernel_gb_s"] / (hbm_tb_s * 1e3)
    result["step_with_absorption_ms"] = step_ms
    result["torch_absorbed_reference_ms"] = torch_ms
    return result


def speed_table_rows(results: list[dict], device_name: str) -> list[str]:
    """The prefill results as rows of mha2mla/kernels/speed_table.py's MEASURED (what recover's attention auto
    reads): one per (dtype, head dims), the slower of its shapes kept."""
    rows = {}
    for r in results:
        if r["kind"] != "prefill" or "error" in r:
            continue
        key = (r["dtype"], r["d_n"], r["d_r"], r["d_v"])
        forward, backward = rows.get(key, (float("inf"), float("inf")))
        rows[key] = (min(forward, r["fwd_speedup_vs_sdpa"]), min(backward, r["bwd_speedup_vs_sdpa"]))
    gpu = device_name.removeprefix("NVIDIA ").split()[0] if device_name else "?"
    return [f'KernelSpeed("{gpu}", "{dtype}", {d_n}, {d_r}, {d_v}, forward_speedup={fwd:.2f}, backward_speedup={bwd:.2f})'
            for (dtype, d_n, d_r, d_v), (fwd, bwd) in sorted(rows.items())]


def print_table(results: list[dict]) -> None:
    """The Markdown table of the measurements: TFLOP/s per prefill case, GB/s (share of HBM) per decode case."""
    print("\n| kind | shape | ours fwd / bwd | SDPA fwd / bwd | decode GB/s (share of HBM) |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['kind']} | {r['name']} | error: {r['error'][:60]} | | |")
        elif r["kind"] == "prefill":
            print(f"| prefill | {r['name']} B{r['B']} H{r['H']} T{r['T']} | {r['ours_fwd_tflops']:.0f} / "
                  f"{r['ours_bwd_tflops']:.0f} TFLOP/s | {r['sdpa_fwd_tflops']:.0f} / {r['sdpa_bwd_tflops']:.0f} TFLOP/s | |")
        else:
            print(f"| decode | {r['name']} B{r['B']} H{r['H']} T{r['T']} | | | {r['kernel_gb_s']:.0f} "
                  f"({100 * r['kernel_fraction_of_hbm']:.0f}%) |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, measures nothing")
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth of the GPU (H200: 4.8)")
    parser.add_argument("--compile", choices=["all", "table"], default=None,
                        help="no GPU needed: compile every kernel config (table: the first candidate per head width) "
                        "for sm_90 and print its registers, spills, shared memory and wgmma count (TRITON_INTERPRET "
                        "must be unset)")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.compile:
        rows = compile_report(args.compile)
        if args.records:  # a compile check (tests/kernels/test_compile.py runs it), recorded only when asked
            env = harness.environment()
            for row in rows:
                harness.record("kernels-compile", {"compile": args.compile}, row, env)
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump(rows, handle, indent=2)
        return 1 if any("error" in r for r in rows) else 0
    return measure(args)


def measure(args) -> int:
    """Time every prefill and decode case (tiny ones on the CPU with ``--smoke``), one record each, then the summary."""
    import torch

    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print(json.dumps({"error": "kernels_bench.py needs a CUDA GPU"}))
        return 2
    prefill, decode = list(PREFILL_SHAPES), list(DECODE_SHAPES)
    if args.smoke:
        prefill, decode = list(SMOKE_PREFILL_SHAPES), list(SMOKE_DECODE_SHAPES)
    elif args.quick:
        prefill, decode = prefill[::2], decode[::2]
    results = []
    started = time.time()
    env = harness.environment()
    settings = {"smoke": args.smoke, "quick": args.quick, "hbm_tb_s": args.hbm_tb_s}
    for case in prefill:
        try:
            results.append(prefill_case(*case))
        except Exception as error:
            results.append({"kind": "prefill", "name": case[0], "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(results[-1]), flush=True)
        harness.record("kernels", settings, results[-1], env)
        torch.cuda.empty_cache()
    for case in decode:
        try:
            results.append(decode_case(*case, hbm_tb_s=args.hbm_tb_s))
        except Exception as error:
            results.append({"kind": "decode", "name": case[0], "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(results[-1]), flush=True)
        harness.record("kernels", settings, results[-1], env)
        torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    summary = {"device": device_name, "torch": torch.__version__, "seconds": time.time() - started,
               "hbm_tb_s": args.hbm_tb_s, "results": results, "speed_table_rows": speed_table_rows(results, device_name)}
    print(json.dumps(summary))
    print_table(results)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
