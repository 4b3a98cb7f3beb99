"""Drafters: one module each, all behind the `Drafter` contract in base.py."""
from workbench.drafters.base import BatchState, DraftContext, Drafter
from workbench.drafters.draft_model import DraftModelDrafter
from workbench.drafters.ngram import NgramDrafter, lookup

__all__ = ["BatchState", "DraftContext", "Drafter", "DraftModelDrafter", "NgramDrafter", "lookup"]
