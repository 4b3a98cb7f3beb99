"""Profile the engine's decode steps on the GPU: where host time goes (torch.profiler, CPU-side op table)."""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from workbench.harness.bench import BenchSession
from workbench.engine import SpecEngine, EngineConfig
from workbench.engine.drafters import make_drafter

preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
s = BenchSession.load(preset=preset, device="cuda", dtype="bfloat16")
p = s.encode(2)
for name, drafter in [("ar", None), ("draft", make_drafter("draft", {"k": 4}, draft=s.draft))]:
    e = SpecEngine(s.target, drafter, EngineConfig(max_new_tokens=64, timing=False), s.device)
    e.generate(p); torch.cuda.synchronize()
    t = time.perf_counter(); r = e.generate(p); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"{name}: {len(r.steps)} steps, {dt / len(r.steps) * 1e3:.2f} ms/step, {sum(map(len, r.outputs)) / dt:.1f} tok/s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        e.generate(p)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
