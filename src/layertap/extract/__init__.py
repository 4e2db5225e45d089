"""Extraction at scale: stream chosen layers over a dataset into a store, resumably, in many processes."""
# ruff: noqa: F401  (transitional: names the other packages import, until they import the submodules)

from . import digests
from .run import Verify, extract_dataset, model_fingerprint

__all__ = ["extract_dataset", "Verify"]
