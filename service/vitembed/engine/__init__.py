"""The serving engine: decode pool, dynamic batching, admission and deadlines, and the heads and indexes
served next to each model. No HTTP here."""
