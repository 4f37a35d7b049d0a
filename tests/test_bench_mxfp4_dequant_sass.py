"""benchmarks/mxfp4_dequant_sass.py on the CPU: the SASS line parser, and the sm_90a build of triton_kernels'
MXFP4 upcast whose counts docs/performance.md "Session 36" cites (two BF16x2 multiplies per weight byte: the
bias, then the scale)."""
from __future__ import annotations

from benchmark_loader import load_benchmark


def test_opcode_counts_reads_predicated_and_dotted_opcodes() -> None:
    sass = load_benchmark("mxfp4_dequant_sass.py")
    text = ("        /*0070*/                   LOP3.LUT R5, R2, 0x81c081c0, RZ, 0xc0, !PT ;\n"
            "        /*0080*/              @!P0 HMUL2.BF16_V2 R4, R5, R6 ;\n"
            "        /*0090*/               @P1 LOP3.LUT R7, R2, R3, RZ, 0xfc, !PT ;\n"
            "        .text.kernel:\n")
    assert sass.opcode_counts(text) == {"LOP3": 2, "HMUL2": 1}


def test_the_upcast_builds_for_sm90_and_multiplies_twice_per_weight_byte(tmp_path) -> None:
    sass = load_benchmark("mxfp4_dequant_sass.py")
    assert sass.main(["--out", str(tmp_path / "r.json")]) == 0
    r = sass.measure()
    assert r["bytes_per_thread"] == 64 and r["instructions_per_thread"] > 0
    assert r["per_byte"]["LOP3"] > 0.5 and r["per_byte"].get("SHF", 0) > 0
    assert r["fp_per_byte"] == 2.0          # one BF16x2 product per pair for the bias, one for the scale
    assert (tmp_path / "r.json").exists()
