"""The NVIDIA attention backends; each module imports its kernel library only when run."""
