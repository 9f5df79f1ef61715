"""One training step through the user's harness, shared by profile, replay and realize."""
