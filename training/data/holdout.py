"""Whole sources held out of training, for the unseen-source dev set.

A dev set whose noises come from the same packages as the training noises (split by file) overstates
how well a model does on noises it has never met: sibling loops and effects of one game sound alike.
So some sources are held out *whole*: no file of theirs is trained on, in either split of the corpus,
and `enhancer-train devset --unseen` builds its mixtures from them alone, with the validation
speakers (never trained on either).

The held-out sources were chosen among those no shipped model has seen, so that old and new models
are compared on equal terms, and so that each covers a category users meet:

| category | source (corpus folder) | what it holds |
| --- | --- | --- |
| noise | `noise/lugaru` | wind, desert ambience, fire, footsteps, impacts |
| noise | `noise/unknown-horizons` | market crowd, tavern, smithy, windmill, bells |
| music | `music/lugaru`, `music/unknown-horizons`, `music/lincity-ng` | game soundtracks of three games |

A source is named by its folder under the corpus root (`<category>/<source>/...`), which is how the
corpus manifests write paths.
"""
from __future__ import annotations

from pathlib import Path

from .manifests import Item

UNSEEN_SOURCES: dict[str, tuple[str, ...]] = {
    "noise": ("lugaru", "unknown-horizons"),
    "music": ("lugaru", "unknown-horizons", "lincity-ng"),
}


def corpus_source(item: Item, root) -> str | None:
    """The source folder of a corpus file (`ROOT/noise/lugaru/x.ogg` -> "lugaru"), or None when the
    file does not lie in the corpus layout. `root` is taken as resolved (`split_unseen` resolves it once)."""
    try:
        parts = Path(item.path).resolve().relative_to(root).parts
    except ValueError:
        return None
    return parts[1] if len(parts) >= 3 else None


def split_unseen(items: list[Item], category: str, root) -> tuple[list[Item], list[Item]]:
    """(kept for training, held out)."""
    kept, held = [], []
    root, unseen = Path(root).resolve(), UNSEEN_SOURCES.get(category, ())
    for it in items:
        (held if corpus_source(it, root) in unseen else kept).append(it)
    return kept, held
