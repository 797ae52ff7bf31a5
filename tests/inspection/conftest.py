"""Texts shared by the inspection tests."""

from __future__ import annotations

import random

import pytest

WORDS = ("the animal didn't cross the street because it was too tired and the river ran fast "
         "under an old bridge while children played near houses, dogs barked; she said he left "
         "early: they watched birds fly over hills, trees and fields.").split()


@pytest.fixture(scope="session")
def long_text() -> str:
    """A text of ~870 tokens: MiniLM keeps its first 512 (its positions)."""
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(700))
