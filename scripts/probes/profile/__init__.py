"""The profile stage: scaling fit, padding penalty, CE wall clock, kernel table, MFU."""
