"""The MLA Triton kernels compiled for an H100/H200 (sm_90) without a GPU: registers, spills, shared memory and
wgmma count per kernel config (no suite of its own: ``python benchmarks/kernels_bench.py --compile all|table`` runs
it and records it).
"""

from __future__ import annotations

import argparse
import json
import sys

FP32_POINTERS = {"LSE", "DELTA", "DKP", "O_PART", "LSE_PART"}
INT_POINTERS = {"QSEG", "KSEG", "KVLO", "QHI", "SEQ_LEN"}


def compile_resources(kernel, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile one kernel for an H100/H200 (sm_90) without a GPU and read its resources from the cubin:
    registers per thread, local memory (spills), shared memory, and the wgmma (Hopper tensor-core) instructions."""
    import inspect
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters.items())
    signature = {}
    for name, param in names:
        if "constexpr" in str(param.annotation):
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = "*fp32" if name in FP32_POINTERS else "*i32" if name in INT_POINTERS else "*bf16"
        else:
            signature[name] = "fp32" if name.startswith("scale") else "i32"
    positions = {name: index for index, (name, _) in enumerate(names)}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(positions[k],): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True).stdout
    os.unlink(handle.name)
    fields = dict(item.split(":", 1) for item in usage.split("Function", 1)[-1].split() if ":" in item)
    return {"registers": int(fields.get("REG", -1)),
            "local_bytes": max(int(fields.get("LOCAL", -1)), int(fields.get("STACK", -1))),  # spills
            "shared_bytes": compiled.metadata.shared, "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")}


def compile_report(which: str = "all") -> list[dict]:
    """Every training-kernel candidate (mha2mla/kernels/tuning.py; ``which`` "table": the first of each width only)
    and the decode's tiles at the benchmark head dims, compiled for sm_90: what each would hold on an H200, before
    any GPU time is spent."""
    from mha2mla.kernels import flash_mla_kernels as flash
    from mha2mla.kernels import tuning
    from mha2mla.kernels.decode import _decode_split_kernel

    rows = []
    common = {"CAUSAL": True, "HAS_SEGMENTS": False, "UPCAST": False, "PRECISION": "tf32"}
    for label, (d_n, d_r, d_v) in (("smollm2-mla", (64, 32, 64)), ("deepseek", (128, 64, 128))):
        dims = {"BLOCK_DN": tuning.next_power_of_two(d_n), "BLOCK_DR": tuning.next_power_of_two(d_r),
                "BLOCK_DV": tuning.next_power_of_two(d_v)}
        candidates = tuning.flash_candidates(d_n, d_r, d_v, interpreting=False)
        for index, config in enumerate(candidates[:1] if which == "table" else candidates):
            passes = (
                ("forward", flash._flash_mla_fwd_kernel, config.block_m, config.block_n, config.num_warps,
                 config.num_stages),
                ("dk/dv", flash._flash_mla_bwd_dkv_kernel, config.bwd_block_m, config.bwd_block_n,
                 config.bwd_num_warps, config.bwd_num_stages),
                ("dq", flash._flash_mla_bwd_dq_kernel, config.bwd_block_n, config.bwd_block_m, config.bwd_num_warps,
                 config.bwd_num_stages),
            )
            for name, kernel, block_m, block_n, warps, stages in passes:
                constexprs = {**common, **dims, "BLOCK_M": block_m, "BLOCK_N": block_n}
                if name == "dk/dv":
                    constexprs["ONE_HEAD"] = True  # one head per program, the GPU's default
                row = {"shape": label, "candidate": index, "kernel": name, "tiles": f"{block_m}x{block_n}",
                       "warps": warps, "stages": stages}
                try:
                    row.update(compile_resources(kernel, constexprs, warps, stages))
                except Exception as error:  # a config the compiler rejects is reported, not fatal
                    row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    for heads, rank, d_rope in ((128, 512, 64), (9, 128, 32), (9, 480, 16)):
        block_h, block_n, warps = tuning.decode_blocks(heads, rank, interpreting=False)
        constexprs = {"UPCAST": False, "PRECISION": "tf32", "BLOCK_H": block_h, "BLOCK_N": block_n,
                      "BLOCK_R": tuning.next_power_of_two(rank), "BLOCK_DR": tuning.next_power_of_two(d_rope)}
        row = {"shape": f"decode H{heads} r{rank}", "candidate": 0, "kernel": "decode split",
               "tiles": f"{block_h}x{block_n}", "warps": warps, "stages": 2}
        try:
            row.update(compile_resources(_decode_split_kernel, constexprs, warps, 2))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| shape | candidate | kernel | tiles | warps / stages | registers | spilled (local bytes) | shared KiB | wgmma |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        resources = (f"error: {r['error'][:60]} | | | |" if "error" in r else
                     f"{r['registers']} | {r['local_bytes']} | {r['shared_bytes'] / 1024:.0f} | {r['wgmma']} |")
        print(f"| {r['shape']} | {r['candidate']} | {r['kernel']} | {r['tiles']} | {r['warps']} / {r['stages']} | {resources}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """No suite: ``--help`` says what the module holds, anything else where to run it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    parser.error("no suite of its own: run python benchmarks/kernels_bench.py --compile all (or table)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
