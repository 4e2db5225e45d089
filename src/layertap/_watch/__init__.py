"""The parts of `layertap.watch`, one mechanism a file; import them from `layertap.watch`.

- ``rows.py``: `Record`, one row of statistics, its columns and `WatchWarning`;
- ``sinks.py``: where the rows of a sampled step go (`CSV`, `Parquet`, `TensorBoard`, `WandB`, a function);
- ``alerts.py``: `Alerts`, the rules, and the judge that turns a step's rows into alerts;
- ``adapters.py``: `LightningWatch` and `HFWatch`, made on first use around `layertap.watch.Watch`.

The `Watch` itself (hooks, sampled steps, merging) is in ``layertap/watch.py``, above these.
"""
