"""One module per section of the report's template."""
