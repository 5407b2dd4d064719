"""The validation split: documents held out by a sha256 of their ``doc_id``.

The split is the same on every machine and in every run (Python's ``hash`` is salted per process; we avoid
it), does not depend on the order of the documents, and is computed from one number per document, so the
streaming path (:mod:`atoll.job.data.stream`), which never holds the whole corpus, splits it identically.
"""

from __future__ import annotations

import hashlib

import numpy as np

from atoll.errors import DataError
from atoll.job.data.sources import Document


def doc_unit(doc_id: str) -> float:
    """A deterministic number in [0, 1) from sha256(doc_id): the same in every process and on every machine."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def val_mask(units: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents are held out, from their ``doc_unit`` s (float64, (n,)): bool (n,).

    A document is held out when its unit is below ``val_fraction``. With two or more documents each side
    gets at least one (the lowest unit is moved to validation, or the highest to training); one document
    trains.

    Raises:
        DataError: ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction: {val_fraction} is not between 0 and 1 (exclusive); use e.g. 0.05")
    units = np.asarray(units, dtype=np.float64)
    is_val = units < val_fraction
    if len(units) == 1:
        is_val[:] = False  # one document cannot be split; it trains
    elif len(units):
        if not is_val.any():
            is_val[int(np.argmin(units))] = True
        elif is_val.all():
            is_val[int(np.argmax(units))] = False
    return is_val


def split_documents(
    docs: list[Document], val_fraction: float = 0.05
) -> tuple[list[Document], list[Document]]:
    """Hold out validation documents, chosen by a sha256 of each ``doc_id``.

    A document goes to validation when ``sha256(doc_id)`` maps below ``val_fraction``, so the split does not
    depend on the order of ``docs`` nor on which other documents exist. With two or more documents each side
    gets at least one (the lowest-hash document is moved to validation, or the highest to training).

    Args:
        docs: the corpus; ``doc_id`` values should be unique.
        val_fraction: expected fraction of documents held out, in (0, 1).

    Returns:
        ``(train_docs, val_docs)``, disjoint, each in the input order. With one document: ``([doc], [])``.

    Raises:
        DataError: ``val_fraction`` is not in (0, 1).
    """
    is_val = val_mask(np.array([doc_unit(d.doc_id) for d in docs], dtype=np.float64), val_fraction).tolist()
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val
