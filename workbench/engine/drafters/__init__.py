"""Drafters: one module each, all behind the `Drafter` contract in base.py."""
from workbench.engine.drafters.base import BatchState, DraftContext, Drafter
from workbench.engine.drafters.draft_model import DraftModelDrafter
from workbench.engine.drafters.eagle import EagleDrafter, EagleHead
from workbench.engine.drafters.ngram import NgramDrafter, lookup
from workbench.engine.drafters.redrafter import RedrafterDrafter, RedrafterHead

__all__ = ["BatchState", "DraftContext", "Drafter", "DraftModelDrafter", "EagleDrafter", "EagleHead", "NgramDrafter", "RedrafterDrafter", "RedrafterHead",
           "lookup"]
