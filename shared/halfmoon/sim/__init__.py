"""Trace-driven discrete-event simulator of a Halfmoon cluster running the shared policies."""
