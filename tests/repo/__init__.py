"""The repository itself: type checks over services/, every benchmark module imports."""
