"""What the server keeps in its SQLite file and how: the schema and its migrations (``schema``),
the rows as records (``records``), the store of sessions, models, futures, checkpoints and keys
(``store``, ``store_rows``) and the sampler's records (``sequences``)."""
