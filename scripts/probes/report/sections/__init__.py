"""One module per section of the report's template (the module is named after the section);
``replay`` reads the replay's measured savings for Summary and Apply it; ``shared`` holds what
every section uses."""
