"""DFlash and DFlash 2 block drafters (docs/design/drafter.md), split into the two halves a cluster places apart.

- `DraftBody`: the drafter's own layers. Input: the block's input embeddings and the target's taps
  of newly committed rows; output: the block's final hidden states. Holds no vocabulary-sized
  weight, so it can run in its own process without a second copy of the target's embedding.
- `DraftHead`: everything vocabulary-sized: the target's LM head (bound, not copied), the
  optional output multiplier and logit soft-cap, and DFlash 2's candidate selector.

Knows nothing about Ray, gRPC or the target's caches.
"""

from .body import DraftBody
from .context import ContextCache
from .head import SAMPLING_CANDIDATES, CandidateSelector, DraftHead
from .load import Drafter, load_drafter

__all__ = [
    "SAMPLING_CANDIDATES",
    "CandidateSelector",
    "ContextCache",
    "DraftBody",
    "DraftHead",
    "Drafter",
    "load_drafter",
]
