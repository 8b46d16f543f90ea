"""The store format as code: what a domainflow store holds on disk and how its bytes are checked.

One home, below both the writer (``domainflow.preprocess``) and the readers (``domainflow.readers``), which
``domainflow.train`` reads through too; ``docs/store-format.md`` describes it for users. No torch here, so an
ingest worker imports it for free.

- ``format``: the format version, the root attributes, the array paths and the codecs every array carries.
- ``chunks``: reading store data so that nothing damaged is read as data (``StoreError`` naming the chunk).
- ``time_axis``: a grid store's time axis (CF units and calendars) as dates.
- ``climatology_index``: which climatology entry (day of year, hour slot) each time step uses.
"""
