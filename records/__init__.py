"""The SQLite host record (filled by the adaptive-threads issue)."""
