"""The engine core: state, step loop, KV caches, draft trees, verification, sampling, drafters, CUDA graphs.

It knows no benchmark, no result store and no CLI (those live in workbench/harness); the models it runs live in
workbench/models.
"""
from workbench.engine.step import PHASES, EngineConfig, GenerationResult, SpecEngine

__all__ = ["PHASES", "EngineConfig", "GenerationResult", "SpecEngine"]
