"""The GPU kit: every GPU figure of the project from prepared commands (README.md beside this file)."""
