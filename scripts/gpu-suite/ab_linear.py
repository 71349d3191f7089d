"""One line per `ferrite bench linear` JSON of an A/B step (files ab-VARIANT-EPOCH.json, in the
order they ran): per shape, cuBLAS's dX+dW pair ÷ the chain form (db in the epilogue), ÷ the
plain backward, ÷ our two GEMMs alone, the act' dX kernel's time over the plain dX GEMM, and the
fused bias+GELU forward ÷ the bare GEMM. Usage: python3 ab_linear.py STEP_DIR
"""
import glob
import json
import re
import sys

ACT_DX = "dX GEMM, act' epilogue"
SHAPES = ["8192×4096←4096", "8192×14336←4096", "8192×4096←14336"]


def main(d):
    files = sorted(glob.glob(d + "/ab-*.json"), key=lambda f: int(re.findall(r"-(\d+)\.json$", f)[0]))
    for f in files:
        v = re.findall(r"ab-([\w.]+)-\d+\.json$", f)[0]
        out = {(r["variant"], r["shape"]): r["median_ms"] for r in json.load(open(f))["records"]}
        cells = []
        for s in SHAPES:
            b = lambda n: out[(n, s + " backward gelu_tanh")]
            pair, dx, dw = b("cublas dX+dW"), b("dX GEMM"), b("dW GEMM")
            fwd = out[("gemm", s + " bias+gelu_tanh")] / out[("persistent_pairs", s + " bias+gelu_tanh")]
            cells.append(
                f"chain {pair / b('backward (chain, db in epilogue)'):.3f} bwd {pair / b('backward'):.3f} "
                f"ours2 {pair / (dx + dw):.3f} act' {1000 * (b(ACT_DX) - dx):+4.0f}us "
                f"fwd {fwd:.2f}"
            )
        print(v.ljust(6), " | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
