"""Engine integrations of kvdepot (each imports its engine only when used)."""
