"""Hugging Face transformers `generate()` on the same weights and prompts: the reference users know.

Plain generate runs in the benchmark's batch size (left padding); assisted generation (`assistant_model`) and prompt
lookup (`prompt_lookup_num_tokens`) run one prompt at a time because transformers supports only batch 1 there.
Outputs are forced to max_new_tokens (min_new_tokens), as our engine decodes a fixed length.
"""
from __future__ import annotations

import time

import torch

from workbench.models import DTYPES

_HF_CACHE: dict[tuple[str, str, str], object] = {}


def _load(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    key = (path, str(dtype), str(device))
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return _HF_CACHE[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_tokens_per_s(session, cfg, prompt_ids: list[list[int]]) -> dict:
    if session.target_path.endswith(".gguf"):
        return {"hf_reason": "HF comparison skipped for GGUF models"}
    dev, dtype = session.device, DTYPES[session.dtype]
    target = _load(session.target_path, dtype, dev)
    sampling = dict(do_sample=False) if cfg.temperature == 0 else dict(
        do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p)
    common = dict(max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens, pad_token_id=0, **sampling)
    out: dict = {}

    def timed(run_one, batch: int) -> float:
        """Generated tokens per second over all prompts, in chunks of `batch`, after one warm-up call."""
        run_one(prompt_ids[:1])  # warm-up
        _sync(dev)
        t0 = time.perf_counter()
        generated = sum(len(t) for i in range(0, len(prompt_ids), batch) for t in run_one(prompt_ids[i:i + batch]))
        _sync(dev)
        return generated / (time.perf_counter() - t0)

    def plain(chunk):
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            gen = target.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **common)
        return [row[width:].tolist() for row in gen]

    def one_prompt(**speculation):  # transformers' speculative modes take batch 1 only
        def run(chunk):
            ids = torch.tensor([chunk[0]], device=dev)
            with torch.inference_mode():
                gen = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **speculation, **common)
            return [gen[0, ids.shape[1]:].tolist()]
        return run

    torch.manual_seed(cfg.seed)
    out["hf_tokens_per_s"] = timed(plain, cfg.batch)
    if cfg.method == "draft" and session.draft_path:
        assistant = _load(session.draft_path, dtype, dev)
        out["hf_spec_tokens_per_s"] = timed(one_prompt(
            assistant_model=assistant, num_assistant_tokens=cfg.k, num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0), 1)
    elif cfg.method == "ngram":
        out["hf_spec_tokens_per_s"] = timed(one_prompt(
            prompt_lookup_num_tokens=cfg.k, max_matching_ngram_size=cfg.ngram_max), 1)
    out["hf_batch"] = cfg.batch
    return out
