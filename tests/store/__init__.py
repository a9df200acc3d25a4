"""The store's operations by family (`trio_sessions._store`), fence by fence, on both backends
through the sync engine (the `db` fixture); SQLite-only seams are marked `sqlite_only`."""
