"""The drafters' top-k on the GPU: torch.topk against workbench.engine.topk.chunked_topk, per candidate shape.

    python scripts/gpu_topk.py --out $OUT/topk.json

Each shape is timed as a CUDA graph of 8 calls (microseconds per call, median of 5 replays), in one process; `same`
says the chunked values equal torch.topk's; `chunked` whether chunked_topk takes its chunked path there (else it is
torch.topk itself).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.gpu_kernels import capture, graph_us  # noqa: E402
from workbench.engine.topk import chunked_topk, uses_chunks  # noqa: E402

SHAPES = [  # (what, shape, k)
    ("tiny redrafter W4: W*V candidates", (1, 4 * 4096), 4),
    ("tiny eagle K4: a level's K rows over V", (1, 4, 4096), 4),
    ("small redrafter W4", (1, 4 * 8192), 4),
    ("small eagle K4", (1, 4, 8192), 4),
    ("8B redrafter W4, hot 32k", (1, 4 * 32000), 4),
    ("8B eagle K4, hot 32k", (1, 4, 32000), 4),
    ("8B eagle K4, whole vocabulary", (1, 4, 128256), 4),
    ("8B redrafter W4, whole vocabulary", (1, 4 * 128256), 4),
    ("tiny redrafter W4, batch 4", (4, 4 * 4096), 4),
    ("tiny eagle K4, batch 4", (4, 4, 4096), 4),
    ("small eagle K4, batch 4", (4, 4, 8192), 4),
    ("8B redrafter W4 hot 32k, batch 4", (4, 4 * 32000), 4),
    ("8B eagle K4 hot 32k, batch 4", (4, 4, 32000), 4),
    ("small redrafter W4, batch 16", (16, 4 * 8192), 4),
    ("tiny redrafter W4, batch 16", (16, 4 * 4096), 4),
    ("tiny eagle K4, batch 16", (16, 4, 4096), 4),
    ("8B redrafter W4 hot 32k, batch 16", (16, 4 * 32000), 4),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for what, shape, k in SHAPES:
        x = torch.randn(shape, device="cuda")
        rec = {"what": what, "shape": list(shape), "k": k}
        for name, fn in (("torch", lambda: x.topk(k, -1)), ("chunked", lambda: chunked_topk(x, k))):
            graph, _ = capture(fn)
            rec[name + "_us"] = statistics.median(graph_us(graph, 10) for _ in range(5))
        rec["chunked"] = uses_chunks(shape, k)
        rec["same"] = torch.equal(x.topk(k, -1).values, chunked_topk(x, k)[0])
        rec["speedup"] = rec["torch_us"] / rec["chunked_us"]
        rows.append(rec)
        print(f"{what:42s} torch {rec['torch_us']:7.2f} us  chunked {rec['chunked_us']:6.2f} us  "
              f"{rec['speedup']:5.2f}x  same={rec['same']}  chunked path={rec['chunked']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
