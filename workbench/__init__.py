"""Speculative decoding workbench: the engine package (models, KV cache, drafters, verifier, step loop, metrics).

No Streamlit imports here: this package runs the same under the dashboard, a study worker, or a bare CLI.
"""
