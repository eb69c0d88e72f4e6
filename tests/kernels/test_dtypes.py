"""Mixed input dtypes at the attention entry point (``flash_mla_attention``): resolved in one place,
``attention_compute_dtype`` (docs/kernels.md, "Precision"). Runs under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, FP32_ATOL, TOLERANCE, attention_inputs, forward_and_grads, max_abs_err

from mha2mla.kernels import flash_mla_attention, flash_mla_reference
from mha2mla.kernels.ops import attention_compute_dtype

MIXED = (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)  # q, k_nope, k_pe, v as transformers builds them


def mixed_inputs(seed=0):
    """Leaves in the dtypes of MIXED, and their float32 copies (the exact reference's inputs)."""
    leaves = [t.detach().to(dtype).requires_grad_(True)
              for t, dtype in zip(attention_inputs(2, 3, 45, 45, 12, 8, 10, seed=seed), MIXED)]
    exact = [t.detach().float().requires_grad_(True) for t in leaves]
    return leaves, exact


def test_compute_dtype_is_autocast_dtype_or_promotion():
    a, b = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE, dtype=torch.bfloat16)
    assert attention_compute_dtype(a, b) == torch.float32
    assert attention_compute_dtype(b, b) == torch.bfloat16
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert attention_compute_dtype(a, b) == torch.bfloat16
        assert attention_compute_dtype(a, a) == torch.bfloat16


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_autocast_mixed_dtypes_match_float32_reference(backend):
    """Under bf16 autocast, q and k_pe in float32 with k_nope and v in bf16: the output is bf16, each gradient
    comes back in its input's dtype, and all match the float32 reference within bf16 tolerance."""
    leaves, exact = mixed_inputs()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out, grads, grad_out = forward_and_grads(flash_mla_attention, leaves, backend=backend)
    assert out.dtype == torch.bfloat16
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, exact, grad_out.float())
    atol, rtol = TOLERANCE[torch.bfloat16]
    for name, got, want, leaf in zip(("out", "dq", "dk_nope", "dk_pe", "dv"), (out, *grads), (ref, *ref_grads),
                                     (out, *leaves)):
        assert got.dtype == leaf.dtype, name
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def test_autocast_kernel_matches_reference_backend():
    """Both backends compute from the same bf16-rounded inputs, so they agree more closely than either does with
    float32 (what is left is the order of float32 sums and the rounding of p before the value product)."""
    leaves, _ = mixed_inputs(seed=1)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out, grads, grad_out = forward_and_grads(flash_mla_attention, leaves, backend="triton")
        ref, ref_grads, _ = forward_and_grads(flash_mla_attention, leaves, grad_out, backend="reference")
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_mixed_dtypes_without_autocast_are_exact_in_float32():
    """The exact setting: without autocast mixed inputs are promoted to float32, and the kernel reproduces the
    float32 reference on the same values within the float32 bound (gradients of bf16 inputs within that plus
    their own rounding to bf16, half a bf16 ulp: at most 2^-8 relative)."""
    leaves, exact = mixed_inputs(seed=2)
    out, grads, grad_out = forward_and_grads(flash_mla_attention, leaves, backend="triton")
    assert out.dtype == torch.float32
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, exact, grad_out)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        rounding = 2.0**-8 * want.abs() if got.dtype == torch.bfloat16 else 0.0
        assert ((got.float() - want).abs() <= FP32_ATOL + rounding).all()
        assert max_abs_err(got, want) > 0 or got.dtype == torch.float32  # bf16 gradients really are rounded
