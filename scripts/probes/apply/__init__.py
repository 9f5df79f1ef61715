"""Applying the result: recommendations.json and the snippets that paste."""
