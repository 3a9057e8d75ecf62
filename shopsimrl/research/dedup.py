"""Near-duplicate detection for exported episodes: MinHash signatures over character shingles,
banded locality-sensitive hashing to find candidates, and the signatures' agreement as the
estimate of their Jaccard similarity.

Character shingles suit the data (Chinese text has no spaces; pages and queries differ by a few
characters between near-identical episodes). Memory per episode is one signature
(``permutations`` 64-bit integers), whatever its length, so a 40,000-episode run fits.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NearDuplicateIndex"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_CHUNK = 4096
"""Shingles hashed at once (× permutations × 8 bytes of memory)."""


class NearDuplicateIndex:
    """Kept signatures, and the query "is this text a near duplicate of one of them?".

    ``threshold``: the estimated Jaccard similarity at or above which two texts are near
    duplicates. ``permutations`` = ``bands`` × rows; 128 = 32 × 4 finds pairs at 0.9 almost
    surely (a miss needs every band to differ: (1 − 0.9⁴)³² ≈ 1e-15) and estimates a
    similarity with a standard error of about 0.03 there.
    """

    def __init__(
        self, threshold: float, *, shingle: int = 5, permutations: int = 128, bands: int = 32, seed: int = 20260901
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        if permutations % bands:
            raise ValueError(f"permutations ({permutations}) must be a multiple of bands ({bands})")
        self.threshold = threshold
        self.shingle = shingle
        self.bands = bands
        self.rows = permutations // bands
        generator = np.random.default_rng(seed)
        # Multiply-shift hash functions: odd multipliers, random offsets (arithmetic mod 2^64).
        self._multipliers = generator.integers(1, 2**63, size=permutations, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._offsets = generator.integers(0, 2**63, size=permutations, dtype=np.uint64)
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]
        self._signatures: list[np.ndarray] = []
        self._keys: list[str] = []

    def signature(self, text: str) -> np.ndarray:
        """The MinHash signature of ``text``'s character shingles."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        if codes.size == 0:
            codes = np.zeros(1, dtype=np.uint64)
        width = min(self.shingle, codes.size)
        count = codes.size - width + 1
        with np.errstate(over="ignore"):
            hashes = np.zeros(count, dtype=np.uint64)
            for offset in range(width):  # a polynomial hash of each window, wrapping mod 2^64
                hashes = hashes * _GOLDEN + codes[offset : offset + count]
            hashes = np.unique((hashes ^ (hashes >> np.uint64(31))) * _MIX)
            signature = np.full(self._multipliers.size, np.iinfo(np.uint64).max, dtype=np.uint64)
            for start in range(0, hashes.size, _CHUNK):  # bounded memory on long episodes
                chunk = hashes[start : start + _CHUNK, None] * self._multipliers[None, :] + self._offsets[None, :]
                signature = np.minimum(signature, (chunk >> np.uint64(32)).min(axis=0))
        return signature

    def _band_keys(self, signature: np.ndarray) -> list[bytes]:
        return [signature[band * self.rows : (band + 1) * self.rows].tobytes() for band in range(self.bands)]

    def most_similar(self, signature: np.ndarray) -> tuple[str, float] | None:
        """The kept text most similar to this signature, when the estimate reaches the threshold."""
        candidates: set[int] = set()
        for band, key in enumerate(self._band_keys(signature)):
            candidates.update(self._buckets[band].get(key, ()))
        best: tuple[str, float] | None = None
        for position in sorted(candidates):
            similarity = float(np.mean(self._signatures[position] == signature))
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (self._keys[position], similarity)
        return best

    def add(self, key: str, signature: np.ndarray) -> None:
        position = len(self._signatures)
        self._signatures.append(signature)
        self._keys.append(key)
        for band, band_key in enumerate(self._band_keys(signature)):
            self._buckets[band].setdefault(band_key, []).append(position)
