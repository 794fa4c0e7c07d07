"""The data modules (prompts, preference pairs, unpaired labelled completions, SFT text, score vectors) and their
shared pieces."""

from aitraining_pl.datamodules.base import TextDataModule
from aitraining_pl.datamodules.cached import CachedDataModule
from aitraining_pl.datamodules.colours import ColourSquaresDataModule
from aitraining_pl.datamodules.io import DataSource, DataValidationError
from aitraining_pl.datamodules.kto import KTODataModule
from aitraining_pl.datamodules.preference import PreferenceDataModule, RowPairsDataModule
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.datamodules.resumable import ResumableDataLoader, SeededShuffleSampler
from aitraining_pl.datamodules.scores import ScoresDataModule
from aitraining_pl.datamodules.sft import SFTDataModule

__all__ = [
    "TextDataModule",
    "CachedDataModule",
    "PromptDataModule",
    "PreferenceDataModule",
    "KTODataModule",
    "RowPairsDataModule",
    "SFTDataModule",
    "ScoresDataModule",
    "ColourSquaresDataModule",
    "DataSource",
    "DataValidationError",
    "ResumableDataLoader",
    "SeededShuffleSampler",
]
