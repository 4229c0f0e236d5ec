"""bench/common.py's KERNEL_KINDS tell a kernel's kind by its family, the library or compiler that made it, on the
three H200 traces stored in bench/results/traces/ (bench/mfu.py --trace, 3 traced steps each): torch.compile's
Triton kernels are never matmuls though fp8's cast-and-scale ones hold "scaled_mm" in their names, and the GEMMs
(nvjet) take 244.6 ms of a 1B bf16 step and 134.6 ms of an fp8 one (1.82x), what docs/performance.md says."""
import gzip
import importlib.util
import json
import os

import pytest

from conftest import ROOT

TRACES = os.path.join(ROOT, "bench", "results", "traces")
STEPS = 3  # bench/common.trace_steps's default: each stored trace holds 3 training steps


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("bench_common", os.path.join(ROOT, "bench", "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernels():
    """{trace file: [(kernel name, microseconds)]}: the GPU's own events, read once."""
    found = {}
    for name in sorted(os.listdir(TRACES)):
        with gzip.open(os.path.join(TRACES, name), "rt") as f:
            events = json.load(f)["traceEvents"]
        found[name] = [(e["name"], e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert len(found) == 3, sorted(found)
    return found


# the families a kernel name starts with (after "void "), and the kind each must be
FAMILIES = (("nvjet", "matmul"), ("cublas", "matmul"), ("cutlass", "matmul"), ("triton", "fused by torch.compile"),
            ("cudnn", "attention"), ("memset", "copies"), ("memcpy", "copies"))


def test_every_stored_kernel_is_classified_by_its_family(common, kernels):
    seen = set()
    for trace, work in kernels.items():
        for name, _ in work:
            kind, bare = common.kernel_kind(name), name.lower().removeprefix("void ")
            for family, want in FAMILIES:
                if bare.startswith(family):
                    assert kind == want, (trace, name, kind)
                    seen.add(family)
            if "multi_tensor_apply" in bare:
                assert kind == "optimizer", (trace, name)
    assert seen >= {"nvjet", "cublas", "triton", "cudnn", "memset"}
    scaled = [n for work in kernels.values() for n, _ in work if n.startswith("triton") and "scaled_mm" in n]
    assert scaled and {common.kernel_kind(n) for n in scaled} == {"fused by torch.compile"}
    # cuDNN's attention kernels hold "wgmma", a GEMM word: still attention
    assert common.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert common.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert common.kernel_kind("triton_tem_fused_mm_0") == "fused by torch.compile"


def test_the_matmul_time_of_the_1b_traces_is_the_gemms(common, kernels):
    """Per traced step: the GEMMs of the bf16 step 244.6 ms, of the fp8 one 134.6 ms; fp8's Triton kernels that
    cast and scale for its matmuls 42.5 ms, counted as torch.compile's."""
    ms = {precision: {k: v / 1e3 / STEPS for k, v in common.kernel_micros(
        os.path.join(TRACES, f"{precision}-mfu-none-24layers-mb12.json.gz")).items()} for precision in ("bf16", "fp8")}
    assert round(ms["bf16"]["matmul"], 1) == 244.6 and round(ms["fp8"]["matmul"], 1) == 134.6, ms
    assert round(ms["bf16"]["matmul"] / ms["fp8"]["matmul"], 2) == 1.82
    cast_scale = sum(t for n, t in kernels["fp8-mfu-none-24layers-mb12.json.gz"] if n.startswith("triton")
                     and "scaled_mm" in n) / 1e3 / STEPS
    assert round(cast_scale, 1) == 42.5
    shares = common.kernel_time(os.path.join(TRACES, "fp8-mfu-none-24layers-mb12.json.gz"))
    assert round(shares["matmul"], 3) == 0.468 and round(sum(shares.values()), 6) == 1
