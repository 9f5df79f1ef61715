"""The report: loads every output, builds each section, renders the markdown."""
