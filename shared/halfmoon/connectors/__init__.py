"""Halfmoon's KV pool behind other engines' KV connector interfaces (each module imports its engine itself)."""
