"""The engine: makes the units durable. Only `_dbos` imports DBOS."""
