"""One image cache per engine (:mod:`.cache`), counted in layers (:mod:`.layers`), kept in a ledger file
(:mod:`.ledger`), over the Docker engine (:mod:`.engine`)."""

from .cache import ImageCache, Priced
from .ledger import CachedImage, Ledger

__all__ = ["CachedImage", "ImageCache", "Ledger", "Priced"]
