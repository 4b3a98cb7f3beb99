"""What a quantized run costs in quality, measured against the unquantized models of the same session.

A run whose `target_quant` / `draft_quant` is not "none" runs on quantized copies of the loaded models
(`workbench.engine.quant`, made once per session and format). Its greedy parity (`greedy_matches_ar`, the fidelity
guard) compares it with the autoregressive output of the *same* quantized target, so it stays exact; what the
quantization changed is measured here, against the loaded (reference) models, and lands in the run record:

    quant_ppl, quant_ppl_ref, quant_ppl_delta_pct   held-out perplexity of the run's target and of the reference
                                                    target on the same tokens: the session's prompt texts (for a
                                                    preset, cut from held-out files), PPL_TOKENS tokens in windows
                                                    of PPL_WINDOW; delta = 100 (ppl / ppl_ref - 1)
    quant_token_agreement                           teacher-forced: the reference target's greedy continuation of
                                                    the run's prompts is fed to the run's target, and the share of
                                                    positions whose argmax is the reference's token is reported
    quant_sequences_identical                       (temperature 0) share of prompts whose greedy output equals the
                                                    reference's, token for token
    quant_acceptance_ref, quant_acceptance_delta    the same method and settings with unquantized models (one
                                                    untimed eager pass): the acceptance the quantization cost
    quant_within_bound                              quant_ppl_delta_pct <= max_ppl_increase_pct (studies' constraint)

The reference is the model as loaded: for a .gguf file that is its dequantized (float) form, so `target_quant gguf`
(the file's own 4-bit blocks kept packed) scores 0 perplexity delta and full agreement in float32 up to summation
order, and its quant_note names which GGUF tensors were kept packed and which dequantized.
For an unquantized target the perplexity delta is 0 and the agreement 1 by definition (nothing is recomputed); with
only the draft quantized the output is unchanged (speculation is lossless) and the cost shows in acceptance.
Reference outputs, perplexities and acceptances are cached per session, so a study pays for each once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

PPL_WINDOW = 256  # tokens per perplexity window (fewer when the model's context is shorter)
PPL_TOKENS = 4096  # held-out tokens scored per model
CALIBRATION_WINDOWS, CALIBRATION_LEN = 16, 256  # int4-awq calibration: 16 x 256 tokens of training-split text
QUANT_CACHE_SIZE = 4  # quantized copies a session keeps (oldest dropped first)


def quant_key(cfg, role: str) -> tuple[str, int | None, bool]:
    """(format, int4 group size or None, whether the LM head is quantized too) of the run's target or draft."""
    from workbench.engine.quant import HEAD_FORMATS

    fmt = getattr(cfg, "target_quant" if role == "target" else "draft_quant", "none")  # serving configs have none
    head = bool(getattr(cfg, "quant_head", False)) and fmt in HEAD_FORMATS
    return fmt, getattr(cfg, "int4_group_size", None) if fmt.startswith("int4") else None, head


def is_quantized(cfg) -> bool:
    return cfg.target_quant != "none" or (cfg.method == "draft" and cfg.draft_quant != "none")


def check_weight_formats(session, cfg) -> None:
    """QuantError (a ValueError) for a format the device, dtype or a model's widths cannot run, before any work."""
    from workbench.engine.quant import check_quant

    roles = [("target", session.target)]
    if cfg.method == "draft" and session.draft is not None:
        roles.append(("draft", session.draft))
    for role, model in roles:
        check_quant(quant_key(cfg, role)[0], model.config, session.device, next(model.parameters()).dtype,
                    cfg.int4_group_size, role, getattr(cfg, "quant_kernel", "auto"),
                    source=getattr(model, "source_path", None), head=bool(getattr(cfg, "quant_head", False)))


def quantized_model(session, role: str, cfg):
    """The session's target or draft in the run's format (the loaded model itself for "none")."""
    from workbench.engine.quant import QuantLinear, quantize_model, set_fusion

    base = session.target if role == "target" else session.draft
    fmt, group, head = quant_key(cfg, role)
    kernel = getattr(cfg, "quant_kernel", "auto")  # serving configs have none
    if (fmt == "none" and kernel != "triton") or base is None:  # none + triton: the dense Triton GEMV
        return base
    fusion = getattr(cfg, "gemv_fusion", QuantLinear.fusion)
    key = (role, fmt, group, head, kernel, fusion)  # a copy per fusion: engines cached beside it keep their modules
    if key not in session._quantized:
        calibration = calibration_ids(session, base) if fmt == "int4-awq" else None
        while len(session._quantized) >= QUANT_CACHE_SIZE:
            session._quantized.pop(next(iter(session._quantized)))
        model = quantize_model(base, fmt, group_size=group or 128, calibration=calibration, kernel=kernel,
                               head=head).eval()
        session._quantized[key] = set_fusion(model, fusion)
    return session._quantized[key]


# ---- token sets ----------------------------------------------------------------------------------------------
def _windows(ids: list[int], length: int, count: int, device) -> torch.Tensor:
    n = min(count, len(ids) // length)
    if n == 0:  # shorter than one window: one window of all of it
        return torch.tensor([ids], device=device)
    return torch.tensor(ids[: n * length], device=device).reshape(n, length)


def heldout_ids(session, model) -> torch.Tensor:
    """[W, L] token ids of the session's prompt texts (each distinct text once, in order), for perplexity."""
    key = ("heldout", model.config.max_position_embeddings)
    if key not in session._quality_cache:
        seen, ids = set(), []
        for p in session.prompts:
            if p.text not in seen:
                seen.add(p.text)
                ids += session.tokenizer.encode(p.text).ids
        length = min(PPL_WINDOW, model.config.max_position_embeddings)
        session._quality_cache[key] = _windows(ids, length, PPL_TOKENS // length, session.device)
    return session._quality_cache[key]


def calibration_ids(session, model) -> torch.Tensor:
    """[S, L] token ids of training-split corpus text (workbench.zoo.calibration) for int4-awq."""
    from workbench.zoo.calibration import calibration_texts

    key = ("calibration", model.config.max_position_embeddings)
    if key not in session._quality_cache:
        texts, note = calibration_texts()
        ids = [t for text in texts for t in session.tokenizer.encode(text).ids]
        length = min(CALIBRATION_LEN, model.config.max_position_embeddings)
        session._quality_cache[key] = _windows(ids, length, CALIBRATION_WINDOWS, session.device)
        session._quality_cache["calibration_note"] = note
    return session._quality_cache[key]


# ---- measurements --------------------------------------------------------------------------------------------
@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, chunk: int = 4) -> float:
    """exp(mean next-token NLL) over windows ids [W, L], cache-free causal attention, logits in fp32."""
    nll, count = 0.0, 0
    for part in ids.split(chunk):
        positions = torch.arange(part.shape[1], device=part.device).expand_as(part)
        logits = model.compute_logits(model(part, positions)[:, :-1]).float()  # [w, L-1, V]
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1), reduction="sum"))
        count += part[:, 1:].numel()
    return math.exp(nll / count)


@torch.inference_mode()
def token_agreement(model, prompt_ids: list[list[int]], reference: list[list[int]], device) -> float:
    """Share of positions where model's argmax, fed the prompt and the reference continuation so far, is the
    reference's next token (teacher-forced; reference = the unquantized target's greedy output)."""
    match = total = 0
    for prompt, out in zip(prompt_ids, reference):
        if not out:
            continue
        ids = torch.tensor([prompt + out[:-1]], device=device)
        hidden = model(ids, torch.arange(ids.shape[1], device=device).unsqueeze(0))
        predicted = model.compute_logits(hidden[0, len(prompt) - 1:]).argmax(-1)  # [len(out)]
        match += int((predicted == torch.tensor(out, device=device)).sum())
        total += len(out)
    return match / total if total else float("nan")


def _reference_config(cfg, **changes):
    """Unquantized models, eager steps (a reference pass needs no captured graphs)."""
    return replace(cfg, target_quant="none", draft_quant="none", cuda_graphs=False, compile="off", **changes)


def reference_outputs(session, cfg, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The unquantized target's greedy continuations of the prompts (max_new_tokens each), cached."""
    key = ("greedy", tuple(map(tuple, prompt_ids)), cfg.max_new_tokens)
    if key not in session._quality_cache:
        ref = _reference_config(cfg, method="ar", temperature=0.0, top_k=0, top_p=1.0)
        engine = session._engine(ref, drafter=False)
        session._quality_cache[key] = [o for r in session._pass(engine, prompt_ids, cfg.batch) for o in r.outputs]
    return session._quality_cache[key]


def reference_acceptance(session, cfg, prompt_ids: list[list[int]]) -> float | None:
    """Acceptance of the run's method and settings with unquantized models (one untimed pass), cached."""
    from workbench.harness.metrics import summarize

    ref = _reference_config(cfg, repeats=1, warmup=0, max_ppl_increase_pct=0.0)
    key = ("acceptance", tuple(sorted(asdict(ref).items())), tuple(map(tuple, prompt_ids)))
    if key not in session._quality_cache:
        engine = session._engine(ref, drafter=True)
        session._quality_cache[key] = summarize(session._pass(engine, prompt_ids, cfg.batch)).acceptance_rate
    return session._quality_cache[key]


def quality_columns(session, cfg, prompt_ids: list[list[int]], result) -> dict:
    """The quality columns of a run record (module docstring)."""
    from workbench.engine.quant import gguf_note, norms_folded, weight_bytes

    rec = result.record
    target = session.model_for("target", cfg)
    draft = session.model_for("draft", cfg) if cfg.method == "draft" else None
    heldout = heldout_ids(session, session.target)
    if "ppl_ref" not in session._quality_cache:
        session._quality_cache["ppl_ref"] = perplexity(session.target, heldout)
    ppl_ref = session._quality_cache["ppl_ref"]
    notes = [f"perplexity over {heldout.numel()} tokens of {session.prompts_source} ({heldout.shape[1]}-token windows)"]
    if target is session.target:
        ppl, agreement, identical = ppl_ref, 1.0, 1.0
    else:
        key = ("ppl", *quant_key(cfg, "target"))
        if key not in session._quality_cache:
            session._quality_cache[key] = perplexity(target, heldout)
        ppl = session._quality_cache[key]
        reference = reference_outputs(session, cfg, prompt_ids)
        agreement = token_agreement(target, prompt_ids, reference, session.device)
        identical = (sum(a == b for a, b in zip(result.ar_outputs, reference)) / len(reference)
                     if cfg.temperature == 0.0 else None)
        notes.append("agreement: teacher-forced on the unquantized target's greedy continuation")
    acc = rec.get("acceptance_rate")
    acc_ref = None
    if cfg.method != "ar" and acc is not None:
        acc_ref = reference_acceptance(session, cfg, prompt_ids) if is_quantized(cfg) else acc
    if "int4-awq" in (cfg.target_quant, cfg.draft_quant if draft is not None else None):
        notes.append(session._quality_cache.get("calibration_note", "calibration: none"))
    folded = [role for role, model in (("target", target), ("draft", draft)) if norms_folded(model)]
    if folded:  # int4 always folds the norms: a different int4 error than the weights quantized as loaded
        notes.append(f"int4 {' and '.join(folded)}: RMSNorm weights folded into q/k/v and gate/up before quantizing")
    gguf = gguf_note(getattr(session.target, "gguf_tensor_types", None), cfg.target_quant, target)
    if gguf:
        notes.append(gguf)
    if draft is not None and cfg.draft_quant == "gguf":
        notes.append("draft: " + gguf_note(getattr(session.draft, "gguf_tensor_types", None), "gguf", draft))
    delta = 100.0 * (ppl / ppl_ref - 1.0)
    return {"quant_ppl": ppl, "quant_ppl_ref": ppl_ref, "quant_ppl_delta_pct": delta,
            "quant_token_agreement": agreement, "quant_sequences_identical": identical,
            "quant_acceptance_ref": acc_ref, "quant_acceptance_delta": None if acc_ref is None else acc - acc_ref,
            "quant_within_bound": bool(delta <= cfg.max_ppl_increase_pct),
            "target_weight_mb": weight_bytes(target) / 2**20,
            "draft_weight_mb": weight_bytes(draft) / 2**20 if draft is not None else None,
            "quant_note": "; ".join(notes)}
