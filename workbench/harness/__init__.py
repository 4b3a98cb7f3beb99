"""What measures the engine: the benchmark runner and its CLI, metrics, GPU telemetry, the HF baseline, prompt files."""
