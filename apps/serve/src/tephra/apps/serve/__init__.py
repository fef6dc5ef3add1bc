"""A Tinker-compatible HTTP server over tephra's engine contract (see the app's README)."""
