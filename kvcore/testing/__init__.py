"""kvcore conformance suite for backend authors."""
