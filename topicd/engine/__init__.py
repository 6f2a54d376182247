"""The engine: topics, their logs and every topic operation (no HTTP, no files)."""
