"""Feature stores: Zarr, HDF5 and NumPy folders of per-sample rows, written once, read many times."""
# ruff: noqa: F401  (transitional: names the other packages import, until they import the submodules)

from ..errors import StoreError
from .core import (
    FORMATS,
    ArraySpec,
    FeatureStore,
    Layout,
    Location,
    StoreLock,
    StoreWriter,
    array_key,
    array_specs,
    detect_format,
    fill_value,
    format_for,
    is_url,
    location,
    open_features,
    open_or_create,
    remove_store,
    safe_name,
    settings_differences,
    url_fs,
)

__all__ = ["open_features", "FeatureStore", "StoreError"]
